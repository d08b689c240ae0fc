"""Merge of two attention outputs over disjoint key sets by their log-sum-exp, in one pass (Triton).

A prefill chunk attends the stored history and its own tokens apart (``rotkv.cache.layer.attention_lse``) and
merges the two: ``o = o2 + (o1 - o2) w`` with ``w = sigmoid(l1 - l2)``, the first set's share of the softmax mass,
and ``l = logaddexp(l1, l2)``. In PyTorch that is a float32 copy of ``o1`` and four passes over it, then a cast
(a 16K-token chunk of 32 query heads of 128 dims is a 256 MiB float32 buffer). Here each program
loads ``BLOCK_R`` query rows of both outputs once (any strides: the attention kernels' outputs are often views),
merges in float32 and writes the result once, in the dtype the caller asks for, and the merged log-sum-exp where
asked. ``rotkv.cache.layer.merge_lse`` runs it where the plan says (``rotkv.kernels.plan.plan_lse_merge``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rotkv.kernels.plan import interpreting
from rotkv.kernels.rotate import round_bf16

BLOCK_R = 16


@triton.jit
def _lse_merge_kernel(o1, o2, out, l1, l2, lse, R, C, HQ,
                      s1b, s1h, s1c, s2b, s2h, s2c, sob, soh, soc, t1b, t1h, t1c, t2b, t2h, t2c,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr, WRITE_LSE: tl.constexpr,
                      ROUND_BF16: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rm = r < R
    c = (r % C).to(tl.int64)
    h = ((r // C) % HQ).to(tl.int64)
    b = (r // (C * HQ)).to(tl.int64)
    a = tl.load(l1 + b * t1b + h * t1h + c * t1c, mask=rm, other=0.0).to(tl.float32)
    z = tl.load(l2 + b * t2b + h * t2h + c * t2c, mask=rm, other=0.0).to(tl.float32)
    w = tl.sigmoid(a - z)  # the first set's share of the softmax mass
    d = tl.arange(0, BLOCK_D)
    m = rm[:, None] & (d < D)[None, :]
    x1 = tl.load(o1 + (b * s1b + h * s1h + c * s1c)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(o2 + (b * s2b + h * s2h + c * s2c)[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
    y = x2 + (x1 - x2) * w[:, None]
    if ROUND_BF16:  # the interpreter's float32 -> bf16 cast truncates: round to nearest even first, as a GPU does
        y = round_bf16(y)
    tl.store(out + (b * sob + h * soh + c * soc)[:, None] + d[None, :], y.to(out.dtype.element_ty), mask=m)
    if WRITE_LSE:
        hi = tl.maximum(a, z)
        tl.store(lse + r, hi + tl.log(1.0 + tl.exp(tl.minimum(a, z) - hi)), mask=rm)


def lse_merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor, dtype: torch.dtype,
              with_lse: bool, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(o, lse)``: ``o1, o2 [B, Hq, C, D]`` (last dim contiguous, any other strides) with their log-sum-exps
    ``l1, l2 [B, Hq, C, 1]`` float32 merged into ``o`` of ``dtype`` (into ``out`` where given: a ``[B, Hq, C, D]``
    view whose last dim is contiguous) and, with ``with_lse``, ``logaddexp(l1, l2)`` ``[B, Hq, C, 1]`` float32
    (else None). The caller checks the shapes (``rotkv.kernels.plan.lse_merge_reason``)."""
    b, hq, c, d = o1.shape
    if out is None:
        out = torch.empty(b, hq, c, d, dtype=dtype, device=o1.device)
    lse = torch.empty(b, hq, c, 1, dtype=torch.float32, device=o1.device) if with_lse else out
    rows = b * hq * c
    if rows:
        _lse_merge_kernel[(triton.cdiv(rows, BLOCK_R),)](
            o1, o2, out, l1, l2, lse, rows, c, hq, *o1.stride()[:3], *o2.stride()[:3], *out.stride()[:3],
            *l1.stride()[:3], *l2.stride()[:3], D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_R=BLOCK_R,
            WRITE_LSE=with_lse, ROUND_BF16=interpreting() and out.dtype == torch.bfloat16)
    return out, (lse if with_lse else None)
