"""The refine split: a body with a refine tier read by two kernels, merged by log-sum-exp.

Only the Triton v1 body kernel reads the refine tier (``rotkv.cache.refine``), so a decode call over
a refined body would run v1 over every page. With the split, the v1 kernel reads only each request's
refined pages (its newest ``min(K, ceil(n / every))`` of ``n``; a few hundred tokens), and the plan's
main body kernel (the CUDA one) reads the others; both write partials (output, running max, sum, base
2) into one buffer, and one merge combines them with the tier's.

How the pages are split without a new page table: the v1 launch over the refined pages computes each
request's refined count itself (as it always did) and starts at its first refined page; its split 0
of KV head 0 writes ``P - rn * P`` as the request's ``kv_last_page_len`` of a second table that is
the body's own ``kv_indptr`` and ``kv_indices``: the main kernel then counts ``(n - 1) * P + P - rn * P
= (n - rn) * P`` tokens, the unrefined pages, and reads nothing else. Nothing is copied, and every
launch keeps its fixed grid (a CUDA graph captures both).

Which calls split is decided with the rest of the plan (``rotkv.kernels.plan``: ``DecodePlan.refine_split``,
:func:`~rotkv.kernels.plan.plan_refine_split`) from the ``refine_split`` switch (``ROTKV_TUNING``): ``1``
splits where the main launch is the CUDA kernel, ``0`` never, ``reference`` splits everywhere with
:func:`rest_partials_reference`, the PyTorch reference, in place of the main kernel: the CPU tests'
stand-in; ``kernel`` splits nothing where the CUDA kernel can read the tier itself (its ROTKV_REFINE
build, :func:`~rotkv.kernels.plan.plan_refine_kernel`): one launch over every page; ``auto`` (the
default) is ``kernel`` at the head dims of ``rotkv.kernels.plan.AUTO_REFINE_HEAD_DIMS`` and ``1`` at the
others. ``rotkv.kernels.decode.decode_attention`` runs the plan's split; this module holds that reference.
"""

from __future__ import annotations

import torch

from rotkv.kernels.body import PagedBody

LOG2E = 1.4426950408889634


def rest_partials_reference(q: torch.Tensor, body: PagedBody, table: tuple, o_part: torch.Tensor,
                            m_part: torch.Tensor, l_part: torch.Tensor, slot: int, sm_scale: float) -> None:
    """Write partial slot ``slot`` of ``o/m/l_part [B, Hq, NS(, D)]`` as the body kernels write theirs,
    in float32 over the tokens of ``table`` (dequantized, no refine tier): ``m`` the largest score
    ``q.k * sm_scale * log2(e)``, ``l = sum 2^(s - m)``, ``o = sum 2^(s - m) v`` (a request without
    tokens: ``-inf``, 0, 0). q ``[B, Hq, D]``."""
    from rotkv.kernels.reference import dequant_pages

    dense = dequant_pages(body, *table)
    hq = q.shape[1]
    for b, (k, v) in enumerate(dense):
        if k.shape[1] == 0:
            m_part[b, :, slot], l_part[b, :, slot], o_part[b, :, slot] = float("-inf"), 0.0, 0.0
            continue
        rep = hq // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        s = torch.einsum("hd,hld->hl", q[b].float(), k) * (sm_scale * LOG2E)
        m = s.amax(-1)
        p = torch.exp2(s - m[:, None])
        m_part[b, :, slot], l_part[b, :, slot] = m, p.sum(-1)
        o_part[b, :, slot] = torch.einsum("hl,hld->hd", p, v)
