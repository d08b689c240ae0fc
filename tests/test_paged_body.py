"""The typed paged body (rotkv.kernels.body) and the one table of widths (rotkv.quant.widths)."""

import pytest
import torch

from rotkv.kernels.body import PagedBody, TokenPart
from rotkv.quant import widths
from rotkv.quant.quantizer import meta_dtype


def test_width_table():
    assert widths.WIDTHS == (2, 4, 8)
    assert widths.KEY_WIDTHS == (2, 3, 4, 8) == widths.QUANT_WIDTHS
    assert widths.KERNEL_WIDTHS == (2, 4) and widths.CUDA_DECODE_WIDTHS == (2,)
    for w in widths.TABLE:  # the quantizer's default metadata is the table's
        assert meta_dtype(w.bits) == getattr(torch, w.meta)
    assert widths.check_width(4) == 4
    with pytest.raises(ValueError, match=r"`k_bits` has to be one of \[2, 4\] but got 8"):
        widths.check_width(8, "k_bits", widths.KERNEL_WIDTHS)


@pytest.mark.parametrize("bits,g", [(2, 32), (3, 64), (4, 16), (8, 64)])
def test_token_part_states_its_widths(bits, g):
    part = TokenPart.zeros(3, 2, 16, 64, bits, g)
    assert part.codes.shape == (3, 2, 16, 64 * bits // 8) and part.scale.shape == (3, 2, 16, 64 // g)
    assert (part.bits, part.group_size, part.head_dim, part.groups) == (bits, g, 64, 64 // g)
    assert part.row_bytes == 64 * bits // 8 + 2 * (64 // g) * 2


def test_token_part_rejects_bad_tensors():
    good = TokenPart.zeros(2, 1, 16, 64, 2, 32)
    codes, scale, lo = good.tensors
    with pytest.raises(ValueError, match="`bits` has to be one of"):
        TokenPart(codes, scale, lo, 5, 32, 64)
    with pytest.raises(ValueError, match="do not hold 64 dims at 4 bits"):
        TokenPart(codes, scale, lo, 4, 32, 64)
    with pytest.raises(ValueError, match="group size 16"):
        TokenPart(codes, scale, lo, 2, 16, 64)
    with pytest.raises(ValueError, match="has to divide head_dim"):
        TokenPart(codes, scale, lo, 2, 48, 64)
    with pytest.raises(ValueError, match="one float dtype"):
        TokenPart(codes, scale, lo.float(), 2, 32, 64)
    with pytest.raises(ValueError, match="uint8"):
        TokenPart(codes.int(), scale, lo, 2, 32, 64)


def test_paged_body():
    body = PagedBody.zeros(4, 2, 16, 128, (4, 2), 64)
    assert body.bits == (4, 2) and body.group_size == 64 and body.head_dim == 128
    assert (body.num_pages, body.kv_heads, body.page_size) == (4, 2, 16)
    assert [t.shape[-1] for t in body.tensors()] == [64, 2, 2, 32, 2, 2]
    mixed = PagedBody(TokenPart.zeros(4, 2, 16, 128, 2, 64), TokenPart.zeros(4, 2, 16, 128, 2, 32))
    with pytest.raises(ValueError, match="share the group size"):
        mixed.group_size  # noqa: B018
    with pytest.raises(ValueError, match="share pages"):
        PagedBody(TokenPart.zeros(4, 2, 16, 128, 2, 64), TokenPart.zeros(5, 2, 16, 128, 2, 64))
    with pytest.raises(TypeError, match="TokenPart"):
        PagedBody(body.tensors()[:3], body.v)
