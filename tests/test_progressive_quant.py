"""Progressive precision: the equivalent right shift equals direct quantization at every step."""

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rotkv.quant.progressive import (
    dequantize_progressive,
    load_codes,
    quantize_at,
    quantize_progressive,
    shift_codes,
    shrink,
)
from rotkv.quant.quantizer import clip_rows, dequantize, quantize


def direct_codes(x, q, group):
    """Exact (rational) half-up quantization of x onto the grid lo + k * scale * M / div at q.bits."""
    xc = clip_rows(x.float(), 1.0).reshape(*x.shape[:-1], -1, group)
    lo, scale = q.lo.double(), q.scale.double()
    out = torch.empty(xc.shape, dtype=torch.int32)
    top = (1 << q.bits) - 1
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in xc.shape[:-1]]).reshape(-1, xc.dim() - 1).tolist():
        s = Fraction(scale[tuple(idx)].item()) * q.mult / q.div
        l = Fraction(lo[tuple(idx)].item())
        for j in range(group):
            a = Fraction(xc[tuple(idx) + (j,)].double().item()) - l
            k = 0 if s == 0 else int((a / s + Fraction(1, 2)) // 1)
            out[tuple(idx) + (j,)] = min(max(k, 0), top)
    return out.reshape(x.shape)


@settings(max_examples=150, deadline=None)
@given(
    start=st.sampled_from([16, 8]),
    final=st.sampled_from([2, 4, 8]),
    anchor=st.sampled_from(["final", "start"]),
    group=st.sampled_from([16, 32]),
    rows=st.integers(1, 3),
    scale=st.floats(1e-3, 1e3),
    offset=st.floats(-50, 50),
    quantized_input=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_equivalent_shift_equals_direct_quantization(start, final, anchor, group, rows, scale, offset, quantized_input, seed):
    if final > start:
        final = start
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 32, generator=g) * scale + offset
    if quantized_input:  # values on a coarse grid: many exact ties at every width
        x = torch.round(x * 4 / scale) * scale / 4
    q = quantize_progressive(x, start, final, group, anchor=anchor)
    assert torch.equal(load_codes(q.codes, q.bits), direct_codes(x, q, group))
    while q.bits > final:
        q = shrink(q, final)
        assert torch.equal(load_codes(q.codes, q.bits), direct_codes(x, q, group)), q.bits


@settings(max_examples=60, deadline=None)
@given(
    final=st.sampled_from([2, 4, 8]),
    anchor=st.sampled_from(["final", "start"]),
    shift=st.sampled_from(["equivalent", "rounded", "plain"]),
    seed=st.integers(0, 2**31 - 1),
    scale=st.floats(1e-2, 1e2),
)
def test_tokens_written_after_a_shrink_join_the_same_grid(final, anchor, shift, seed, scale):
    # quantize_at (new tokens at the body's current width) == shrinking the same rows from 16 bits
    if anchor == "final" and shift != "equivalent":
        anchor = "start"
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(seed)) * scale
    q = quantize_progressive(x, 16, final, 32, anchor=anchor, shift=shift)
    while q.bits > final:
        q = shrink(q, final)
        direct = quantize_at(x, q.bits, q.mult, q.div, q.scale.dtype, 32, shift=shift)
        assert direct.mult == q.mult and direct.div == q.div
        if shift == "equivalent":  # same metadata, same codes
            assert torch.equal(direct.scale, q.scale) and torch.equal(direct.lo, q.lo)
            assert torch.equal(direct.codes, q.codes)
        else:  # its own scale covers the range, which the shifted grid does not
            top = direct.lo.float() + direct.scale.float() * direct.mult * ((1 << q.bits) - 1) / direct.div
            assert (top >= x.reshape(3, 2, 32).amax(-1) * (1 - 1e-6) - 1e-6).all()


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), seed=st.integers(0, 2**31 - 1), scale=st.floats(1e-2, 1e2))
def test_final_anchor_lands_on_the_fixed_width_grid(bits, seed, scale):
    # shrinking a 16-bit body to F gives the same metadata and (up to ties) the same values as
    # the fixed F-bit quantizer, at the same storage cost
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed)) * scale
    q = quantize_progressive(x, 16, bits, 64, anchor="final")
    while q.bits > bits:
        q = shrink(q, bits)
    ref = quantize(x, bits, 64)
    assert torch.equal(q.scale, ref.scale) and torch.equal(q.lo, ref.lo)
    assert q.nbytes == ref.nbytes
    step = ref.scale.float().amax()
    assert (dequantize_progressive(q) - dequantize(ref)).abs().max() <= step * 1.0001 + 1e-6


def test_equivalent_shift_is_integer_round_of_division():
    codes = torch.arange(0, 1 << 16, dtype=torch.int32)
    for c in (8, 4, 2):
        src = codes[: 1 << (2 * c)]
        want = torch.round(src.double() / ((1 << c) + 1)).to(torch.int32)  # no ties: 2^c + 1 is odd
        assert torch.equal(shift_codes(src, c), want)
        assert shift_codes(src, c).max().item() == (1 << c) - 1


@pytest.mark.parametrize("shift", ["plain", "rounded"])
def test_plain_and_rounded_shifts_differ(shift):
    # they differ from direct quantization; their grids stop short of hi, so the largest error
    # grows (MSE alone need not: on Gaussian rows the narrower grid acts as clipping)
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(0))
    errs = {}
    for mode in ("equivalent", shift):
        q = quantize_progressive(x, 16, 2, 64, anchor="start", shift=mode)
        while q.bits > 2:
            q = shrink(q, 2)
        errs[mode] = (dequantize_progressive(q) - x).abs().max().item(), load_codes(q.codes, 2)
    assert not torch.equal(errs["equivalent"][1], errs[shift][1])
    assert errs[shift][0] > 1.2 * errs["equivalent"][0]


def test_plain_shift_is_biased_down():
    x = torch.rand(512, 64, generator=torch.Generator().manual_seed(1))
    q = quantize_progressive(x, 16, 2, 64, anchor="start", shift="plain")
    while q.bits > 2:
        q = shrink(q, 2)
    assert (dequantize_progressive(q) - x).mean() < -0.05


def test_storage_and_errors():
    x = torch.randn(3, 5, 64)
    q = quantize_progressive(x, 16, 2, 32)
    assert q.codes.dtype == torch.uint16 and q.codes.shape == (3, 5, 64)
    q = shrink(q, 2)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (3, 5, 64) and q.mult == 257
    q = shrink(shrink(q, 2), 2)
    assert q.codes.shape == (3, 5, 16) and q.mult == 257 * 17 * 5 and q.div == 21845
    with pytest.raises(ValueError, match="final width 2"):
        shrink(q, 2)
    with pytest.raises(ValueError, match="final width 4"):
        shrink(shrink(quantize_progressive(x, 8, 4, 32), 4), 4)
    with pytest.raises(ValueError, match="start_bits"):
        quantize_progressive(x, 4, 2, 32)
    with pytest.raises(ValueError, match="anchor='start'"):
        quantize_progressive(x, 16, 2, 32, shift="plain")
    with pytest.raises(ValueError, match="shift"):
        quantize_progressive(x, 16, 2, 32, anchor="start", shift="bogus")


def test_constant_group():
    x = torch.full((2, 64), -0.7)
    q = quantize_progressive(x, 16, 2, 64)
    for _ in range(3):
        assert torch.allclose(dequantize_progressive(q), x, atol=1e-3)
        if q.bits > 2:
            q = shrink(q, 2)
