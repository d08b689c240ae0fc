import pytest
import torch
from hypothesis import given, settings, strategies as st

from rotkv.quant.packing import pack, unpack
from rotkv.quant.widths import QUANT_WIDTHS
from rotkv.quant.quantizer import (
    body_bits_per_element,
    clip_rows,
    dequantize,
    meta_dtype,
    quantize,
)


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("n", [8, 32, 64, 256])
def test_pack_unpack_bit_exact(bits, n):
    g = torch.Generator().manual_seed(bits * 1000 + n)
    codes = torch.randint(0, 1 << bits, (3, 7, n), generator=g, dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == n * bits // 8
    assert torch.equal(unpack(packed, bits), codes)


def test_planar_layout_int2():
    # byte j holds dims j, j + D/4, j + D/2, j + 3D/4 in bits 0-1, 2-3, 4-5, 6-7
    codes = torch.zeros(1, 64, dtype=torch.uint8)
    codes[0, 5], codes[0, 16 + 5], codes[0, 32 + 5], codes[0, 48 + 5] = 1, 2, 3, 1
    assert pack(codes, 2)[0, 5].item() == 1 | (2 << 2) | (3 << 4) | (1 << 6)


def test_int3_is_bit_sliced_over_the_int2_layout():
    codes = torch.randint(0, 8, (2, 64), dtype=torch.uint8)
    packed = pack(codes, 3)
    assert packed.shape[-1] == 24  # 3 * 64 / 8
    assert torch.equal(packed[:, :16], pack(codes & 3, 2))  # the low bits: an INT2 row
    assert torch.equal(unpack(packed[:, 16:], 1), codes >> 2)  # then the high bit, one per code


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="bits"):
        pack(torch.zeros(1, 8, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="multiple"):
        pack(torch.zeros(1, 6, dtype=torch.uint8), 2)


def test_clip_index_is_zero_based():
    x = torch.arange(1, 65, dtype=torch.float32)  # |x| sorted ascending is 1..64
    y = clip_rows(x, 0.96)  # int(0.96 * 64) = 61 -> threshold sorted[61] = 62: two values clipped
    assert y.max().item() == 62.0 and (y != x).sum().item() == 2
    assert torch.equal(clip_rows(x, 1.0), x)


@settings(max_examples=60, deadline=None)
@given(
    bits=st.sampled_from([2, 3, 4, 8]),
    group=st.sampled_from([32, 64]),
    rows=st.integers(1, 6),
    scale=st.floats(1e-3, 1e3),
    offset=st.floats(-100, 100),
    clip=st.sampled_from([1.0, 0.96, 0.92]),
    seed=st.integers(0, 2**31 - 1),
)
def test_roundtrip_within_half_step_of_stored_metadata(bits, group, rows, scale, offset, clip, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=g) * scale + offset
    q = quantize(x, bits, group, clip)
    assert q.scale.dtype == meta_dtype(bits) and q.lo.dtype == meta_dtype(bits)
    xc = clip_rows(x, clip).reshape(rows, 64 // group, group)
    xh = dequantize(q).reshape(rows, 64 // group, group)
    step = q.scale.float().unsqueeze(-1)
    lo = q.lo.float().unsqueeze(-1)
    # the stored range covers the (clipped) group ...
    assert (lo <= xc.amin(-1, keepdim=True)).all()
    top = xc.amax(-1, keepdim=True)
    assert (lo + step * ((1 << bits) - 1) - top >= -1e-6 * (top.abs() + 1)).all()  # fp32 rounding only
    # ... and every element is within half a stored step (plus fp32 rounding)
    tol = step / 2 + 1e-5 * (xc.abs() + lo.abs() + step)
    assert ((xh - xc).abs() <= tol).all()


def test_constant_group_is_exact_enough():
    x = torch.full((2, 64), 0.3)
    q = quantize(x, 2, 64)
    assert torch.allclose(dequantize(q), x, atol=1e-3)


def test_rejects_non_finite_and_bad_group():
    x = torch.randn(2, 64)
    x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize(x, 2, 64)
    with pytest.raises(ValueError, match="group_size"):
        quantize(torch.randn(2, 64), 2, 48)
    with pytest.raises(ValueError, match="bits"):
        quantize(torch.randn(2, 64), 5, 64)


def test_fp16_metadata_overflow_is_refused():
    with pytest.raises(ValueError, match="bits=8"):
        quantize(torch.tensor([[0.0] * 63 + [1e6]]), 2, 64)
    q = quantize(torch.tensor([[0.0] * 63 + [1e6]]), 8, 64)
    assert q.scale.dtype == torch.float32


def test_nominal_body_bits():
    assert body_bits_per_element(2, 64) == 2.5
    assert body_bits_per_element(2, 128) == 2.25
    assert body_bits_per_element(8, 64) == 9.0


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([2, 4]), scale=st.floats(1e-2, 1e2), offset=st.floats(-50, 50),
       seed=st.integers(0, 2**31 - 1))
def test_float8_metadata_covers_the_group(bits, scale, offset, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 64, generator=g) * scale + offset
    q = quantize(x, bits, 64, 1.0, meta="float8")
    assert q.scale.dtype == torch.float8_e4m3fn and q.lo.dtype == torch.float8_e4m3fn
    lo, step = q.lo.float(), q.scale.float()
    assert (lo <= x.amin(-1, keepdim=True)).all()  # lo rounded down ...
    assert (lo + step * ((1 << bits) - 1) >= x.amax(-1, keepdim=True) - 1e-5 * x.abs().amax()).all()  # scale up
    assert ((dequantize(q) - x).abs() <= step / 2 + 1e-5 * (x.abs() + lo.abs() + step)).all()
    assert body_bits_per_element(bits, 64, "float8") == bits + 16 / 64


def test_float8_metadata_costs_little_against_float16():
    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(0))
    e16 = (dequantize(quantize(x, 2, 64)) - x).pow(2).mean()
    e8 = (dequantize(quantize(x, 2, 64, meta="float8")) - x).pow(2).mean()
    assert e16 < e8 < 1.25 * e16  # a coarser grid (scale rounded up to 3 mantissa bits), not a broken one


def test_unknown_metadata_dtype_is_refused():
    with pytest.raises(ValueError, match="meta"):
        quantize(torch.randn(2, 64), 2, 64, meta="fp8")


@pytest.mark.parametrize("bits", QUANT_WIDTHS)
@pytest.mark.parametrize("meta", [None, "float16", "float8", "float32"])
def test_token_codec_empty_parts_match_what_encode_gives(bits, meta):
    """The pools size their body from TokenCodec.empty_parts (no probe page encoded): the same
    shapes and dtypes as an encoded page."""
    from rotkv.cache.codecs import TokenCodec

    codec = TokenCodec(bits, 16, 0.96, meta)
    enc = codec.encode(torch.randn(1, 3, 8, 64))
    empty = codec.empty_parts(3, 8, 64)
    assert sorted(empty) == sorted(enc)
    for name, t in enc.items():
        assert empty[name].shape == (0, *t.shape[1:]) and empty[name].dtype == t.dtype, name
