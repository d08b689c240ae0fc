"""The Triton bf16x2 rotation (rotkv.kernels.rotate) against its PyTorch form and the float32 rotation.

Both forms compute ``x R_hi + x R_lo (- c_hi - c_lo)`` from exact bf16 products with float32
accumulation and round to bf16 once; only the summation order differs, so they agree to one bf16
ulp, and both stay within one ulp of the float32 rotation rounded to bf16.
"""

import pytest
import torch

pytest.importorskip("triton")

from rotkv.kernels.plan import rotate_reason  # noqa: E402
from rotkv.kernels.rotate import rotate_bf16x2  # noqa: E402
from rotkv.rotations.base import _rotate_bf16x2_bmm, bf16x2_matrix  # noqa: E402
from rotkv.rotations.identity import random_orthogonal  # noqa: E402

CUDA = torch.cuda.is_available()


def _ulps(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """|got - want| over (bf16's ulp at |want| + the float32 accumulation's reach, 2^-15 ||x_row||):
    the sums differ in order only, by about 2^-24 D |terms|, which one bf16 rounding turns into at
    most one ulp of y, or into a few ulps of a y much smaller than its terms (a key near its mean)."""
    w = want.float().abs().clamp_min(2.0 ** -126)
    ulp = torch.exp2(torch.floor(torch.log2(w)) - 7)
    reach = 2.0 ** -15 * x.float().norm(dim=-1, keepdim=True)
    return (got.float() - want.float()).abs() / (ulp + reach)


CASES = [  # (B, Hq, H, T, D, shift, layout)
    (37, 6, 2, 1, 64, True, "bthd"),  # a decode step: one token per row, a program per head and 16 rows (3 blocks)
    (2, 3, 3, 37, 64, True, "bhtd"),  # keys: a mean, ragged T
    (2, 9, 3, 70, 64, False, "bthd"),  # queries of SmolLM2's heads, the projections' [B, T, H, D] memory
    (1, 4, 2, 65, 128, False, "bthd"),
    (1, 2, 1, 33, 256, True, "bhtd"),  # Gemma3's head_dim
    (3, 2, 2, 5, 80, False, "bhtd"),  # a head_dim that is a multiple of 16 only
]
if not CUDA:  # the interpreter takes seconds per launch: the first four
    CASES = CASES[:4]


@pytest.mark.parametrize("b,hq,h,t,d,shift,layout", CASES)
def test_rotate_kernel_matches_bmm_and_float32(b, hq, h, t, d, shift, layout, device):
    g = torch.Generator().manual_seed(b * 1000 + t + d)
    r = torch.stack([random_orthogonal(d, seed=i + d) for i in range(h)])
    mu = 3 * torch.randn(h, d, generator=g) if shift else None
    x = (torch.randn(b, t, hq, d, generator=g) * torch.linspace(0.1, 8, d)).to(torch.bfloat16)
    x = x.transpose(1, 2) if layout == "bthd" else x.transpose(1, 2).contiguous()  # [B, Hq, T, D]
    a = bf16x2_matrix(r, mu)
    xd, ad = x.to(device), a.to(device)
    assert rotate_reason(xd, ad) is None
    got = rotate_bf16x2(xd, ad).cpu()
    ones = torch.tensor([1, 1, 0, 0, 0, 0, 0, 0], dtype=torch.bfloat16)
    ref = _rotate_bf16x2_bmm(x, a, ones)
    grp = hq // h
    xf = x.float() if mu is None else x.float() - mu.repeat_interleave(grp, 0)[None, :, None]
    f32 = torch.einsum("bhtd,hde->bhte", xf, r.repeat_interleave(grp, 0)).to(torch.bfloat16)
    assert got.shape == x.shape and got.dtype == torch.bfloat16 and got.is_contiguous()
    assert _ulps(got, ref, x).max() <= 1.0
    assert _ulps(got, f32, x).max() <= 1.0
    assert (got == f32).float().mean() > 0.9  # one-ulp differences only where float32 lies near a rounding edge


def test_rotate_kernel_writes_into_out_and_handles_empty(device):
    r = random_orthogonal(64, seed=1)[None]
    a = bf16x2_matrix(r).to(device)
    x = torch.randn(1, 1, 16, 64).to(torch.bfloat16).to(device)
    out = torch.full_like(x, 7.0)
    assert rotate_bf16x2(x, a, out=out) is out
    assert not (out == 7.0).any()
    empty = torch.empty(2, 1, 0, 64, dtype=torch.bfloat16, device=device)
    assert rotate_bf16x2(empty, a).shape == (2, 1, 0, 64)


def test_rotate_reason_names_what_it_cannot_take():
    a = bf16x2_matrix(random_orthogonal(64, seed=1)[None])
    assert "bf16" in rotate_reason(torch.zeros(1, 1, 4, 64), a)
    assert "multiple of 16" in rotate_reason(torch.zeros(1, 1, 4, 72, dtype=torch.bfloat16),
                                             bf16x2_matrix(random_orthogonal(72, seed=1)[None]))
    assert "groups" in rotate_reason(torch.zeros(1, 3, 4, 64, dtype=torch.bfloat16),
                                     bf16x2_matrix(torch.stack([random_orthogonal(64, seed=i) for i in range(2)])))
    assert "contiguous" in rotate_reason(torch.zeros(1, 1, 64, 4, dtype=torch.bfloat16).transpose(-1, -2), a)
    with pytest.raises(ValueError, match="rotate_bf16x2: bf16"):
        rotate_bf16x2(torch.zeros(1, 1, 4, 64), a)


@pytest.mark.parametrize("shift", [True, False])
def test_rotate_kernel_writes_each_row_into_its_tier_slot(shift, device):
    """``rows``: each decode row's rotated key lands in its own (page, slot) of a ``[pages, H, P, D]``
    pool, the same bytes as rotating into a temporary and scattering it there; nothing else changes."""
    torch.manual_seed(0)
    b, h, p, d, pages = 5, 3, 16, 64, 12
    r = torch.stack([random_orthogonal(d, seed=i) for i in range(h)])
    a = bf16x2_matrix(r, torch.randn(h, d) if shift else None).to(device)
    x = torch.randn(b, 1, h, d).to(torch.bfloat16).to(device).transpose(1, 2)  # [B, H, 1, D], the projection's memory
    pool = torch.randn(pages, h, p, d).to(torch.bfloat16).to(device)
    page = torch.tensor([3, 0, 11, 7, 5], device=device)
    slot = torch.tensor([0, 15, 4, 9, 4], device=device)
    want = pool.clone()
    want[page, :, slot] = rotate_bf16x2(x, a)[:, :, 0]
    rows = page * pool.stride(0) + slot * pool.stride(2)
    assert rotate_bf16x2(x, a, out=pool, rows=rows) is pool
    assert torch.equal(pool.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="rows has to be int64"):
        rotate_bf16x2(x, a, out=pool, rows=rows.int())
    with pytest.raises(ValueError, match="rows need an out"):
        rotate_bf16x2(x, a, out=pool[:, :2], rows=rows)


def test_rotate_many_equals_each_rotation_on_its_own(device):
    """``rotate_many``: a decode step's keys and values into their tier slots (``rows``) and its GQA queries into a
    buffer, in one launch: the same bytes as three ``rotate_bf16x2`` calls; with one or two jobs as well; a job
    whose ``out`` does not fit is refused before anything is written."""
    from rotkv.kernels.rotate import rotate_many

    torch.manual_seed(1)
    b, h, hq, p, d, pages = 3, 2, 6, 16, 64, 9
    rk = torch.stack([random_orthogonal(d, seed=i) for i in range(h)])
    rv = torch.stack([random_orthogonal(d, seed=10 + i) for i in range(h)])
    ak = bf16x2_matrix(rk, torch.randn(h, d)).to(device)  # keys: a mean (the shift rows)
    av, aq = bf16x2_matrix(rv).to(device), bf16x2_matrix(rk).to(device)
    k, v = (torch.randn(b, 1, h, d).to(torch.bfloat16).to(device).transpose(1, 2) for _ in range(2))  # [B, H, 1, D]
    q = torch.randn(b, hq, 1, d).to(torch.bfloat16).to(device)
    pk, pv = (torch.randn(pages, h, p, d).to(torch.bfloat16).to(device) for _ in range(2))
    rows = torch.tensor([4, 0, 8], device=device) * pk.stride(0) + torch.tensor([15, 2, 7], device=device) * pk.stride(2)
    want_k, want_v = pk.clone(), pv.clone()
    rotate_bf16x2(k, ak, out=want_k, rows=rows)
    rotate_bf16x2(v, av, out=want_v, rows=rows)
    want_q = rotate_bf16x2(q, aq)
    qr = torch.empty_like(q)
    rotate_many([(k, ak, pk, rows), (v, av, pv, rows), (q, aq, qr, None)])
    for got, want in ((pk, want_k), (pv, want_v), (qr, want_q)):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    q2 = torch.randn(b, hq, 5, d).to(torch.bfloat16).to(device)  # two jobs of different token counts
    out2, outk = torch.empty_like(q2), torch.empty_like(k)
    rotate_many([(q2, aq, out2, None), (k, ak, outk, None)])
    assert torch.equal(out2.view(torch.int16), rotate_bf16x2(q2, aq).view(torch.int16))
    assert torch.equal(outk.view(torch.int16), rotate_bf16x2(k, ak).view(torch.int16))
    before = pk.clone()
    with pytest.raises(ValueError, match="rows need an out"):
        rotate_many([(k, ak, pk, rows), (v, av, pv[:, :1], rows)])
    assert torch.equal(pk, before)
    with pytest.raises(ValueError, match="1 to 3 jobs"):
        rotate_many([])
