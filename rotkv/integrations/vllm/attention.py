"""One layer's attention and cache update for one vLLM step, on plain tensors (no vLLM import).

:func:`layer_step` takes the step's :class:`~rotkv.integrations.vllm.state.StepPlan` (planned once per step
from vLLM's ``query_start_loc``, ``seq_lens`` and ``block_table``), the layer's queries, keys and values of
the step's new tokens (vLLM's ``[tokens, heads, D]``), its INT2 body over vLLM's blocks
(:class:`~rotkv.kernels.body.PagedBody`, :mod:`rotkv.integrations.vllm.layout`), its bf16 side pool, the
layer's rotation and codecs; it writes the attention output. The order of a step is the module docstring's
of :mod:`rotkv.integrations.vllm.state`. On CUDA it runs rotkv's kernels (the split-K decode over the body and
the side pool, the fused quantizing write); elsewhere their PyTorch references (``rotkv.kernels.reference``),
which the CPU tests compare against rotkv's own cache.

Keys are stored as ``(k - mu) R_K`` and values as ``v R_V`` (rotkv's semantics); queries are rotated by
their KV group's ``R_K`` and outputs turned back by ``R_V^T``.

A preset with a refine tier gives the layer its :class:`~rotkv.cache.refine.RefineRings`, one ring row per
side-pool slot (the module docstring of :mod:`rotkv.integrations.vllm.state`): the flush writes the flushed
pages' refine bits (``RefineRings.write``, rotkv's), the decode kernel and its reference read the decode rows'
rings (gathered by slot into the ``[B, K, H, P, D/4]`` rings they take), and a prefill row's history adds its
refined pages (``RefineRing.add``) to the dequantized body.
"""

from __future__ import annotations

import numpy as np
import torch

from rotkv.cache.refine import RefineRings
from rotkv.integrations.vllm.config import WHERE
from rotkv.kernels import backend as kernels
from rotkv.kernels.body import PagedBody, RefineTier
from rotkv.kernels.reference import decode_reference, dequant_rows, quant_write_reference
from rotkv.rotations.base import LayerRotation


# the CUDA prefill's two-part attention (history and own tokens merged by log-sum-exp) on every device; the
# CPU tests set it to check that path against rotkv's cache
MERGED_PREFILL = False


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1)  # [T, H, D] -> [H, T, D]


def rotate_kv(rot: LayerRotation, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype):
    """``(k - mu) R_K`` and ``v R_V`` of ``[T, H, D]`` tokens, in ``dtype`` (the side pool's), with rotkv's
    arithmetic for ``[B, H, T, D]`` tensors (bf16x2 for bf16 on CUDA, as rotkv's cache)."""
    kr = rot.keys(_heads_first(k)[None], dtype)[0]
    vr = rot.values(_heads_first(v)[None], dtype)[0]
    return _heads_first(kr), _heads_first(vr)


def _rotate_q(rot: LayerRotation, q: torch.Tensor, dtype) -> torch.Tensor:
    """``[T, Hq, D]`` -> ``q R_K(g)`` ``[T, Hq, D]``."""
    return rot.queries(q.transpose(0, 1)[None], dtype)[0].transpose(0, 1)


def _unrotate_o(rot: LayerRotation, o: torch.Tensor, dtype) -> torch.Tensor:
    return rot.outputs(o.transpose(0, 1)[None], dtype)[0].transpose(0, 1)


def slot_rings(spec, codecs, geo, kv_heads: int, head_dim: int, rows: int, device) -> RefineRings | None:
    """One layer's refine rings for ``rows`` side-pool slots (rotkv's :class:`~rotkv.cache.refine.RefineRings`
    of ``spec`` and the layer's (key, value) ``codecs``), or None (no refine tier, or no 2-bit side): ``geo
    .refine_pages`` slots per row from the start, ``uint8 [rows, K, H, P, D / 4]`` per refined side."""
    rings = RefineRings.build(spec, codecs, kv_heads, geo.page, head_dim, device)
    if rings is None:
        return None
    rings.fit(rows)
    rings.grow(np.zeros(rows, dtype=np.int64), geo.refine_pages * max(geo.refine_every, 1))  # K slots, all empty
    if rings.pages != geo.refine_pages or rings.every != geo.refine_every:
        raise ValueError(f"the refine rings hold {rings.pages} pages (every {rings.every}), the step plan reads "
                         f"{geo.refine_pages} (every {geo.refine_every})")
    return rings


def page_slots(blocks: torch.Tensor, page: int) -> torch.Tensor:
    """The token slots ``[n * P]`` (int64) of body pages ``blocks [n]``: page ``i``'s tokens at ``i*P .. i*P+P-1``."""
    return (blocks.long()[:, None] * page + torch.arange(page, device=blocks.device)[None]).reshape(-1)


def write_body(x: torch.Tensor, blocks: torch.Tensor | None, part, clip: float, slots: torch.Tensor | None = None) -> None:
    """Quantize ``x [n * P, H, D]`` (rotated tokens, page ``i`` = tokens ``i*P .. i*P+P-1``) into body pages
    ``blocks [n]`` of ``part`` (or at token ``slots``, :func:`page_slots`): rotkv's fused write kernel on CUDA,
    its reference elsewhere."""
    if slots is None:
        slots = page_slots(blocks, part.codes.shape[2])
    if kernels.enabled(x):
        from rotkv.kernels.write import quant_write

        quant_write(x, slots, part, clip=clip)
    else:
        quant_write_reference(x, slots, part, clip=clip)


def _decode(plan, qr: torch.Tensor, body: PagedBody, side_k, side_v, block_table, scale: float,
            refine=None) -> torch.Tensor:
    """The decode rows' attention ``[Bd, Hq, D]`` (rotated basis) over their body pages (the newest refined,
    ``refine``: the layer's RefineRings or None) and side-pool tier."""
    dev = qr.device
    table, tiers = None, {}
    if plan.dbody_max > 0:
        table = (plan.device("dbody_indptr", dev), plan.device("dbody_pos", dev, block_table),
                 plan.device("dbody_last", dev))
        tiers = ring_tiers(refine, plan.device("dslots", dev)) if refine is not None else {}
    return decode_rows(qr, body, table, plan.dbody_max, side_k, side_v, plan.device("dtier", dev), plan.dtier_max,
                       plan.pad, scale, tiers)


def ring_tiers(refine, rows: torch.Tensor) -> dict:
    """The decode kernel's refine-tier arguments of decode rows whose side-pool slots are ``rows``: their rows of
    the layer's rings, in row order (the kernels index rings by request); {} without a refine tier."""
    if refine is None:
        return {}
    return {name: RefineTier(ring.data[rows], ring.pages, ring.every)
            for name, ring in (("refine", refine.keys), ("refine_values", refine.values)) if ring is not None}


_LOGGED: set = set()


def _log_kernel(kplan, work: int) -> None:
    """Say once per process and kernel which decode kernel the graphed step captures (and why not the CUDA one)."""
    launch = kplan.launch(work) if kplan.covered else None
    key = (launch.kernel if launch else None, kplan.cuda_why)
    if key not in _LOGGED:
        _LOGGED.add(key)
        import logging

        logging.getLogger("vllm.rotkv").info("rotkv decode kernel in the graphed step: %s (the CUDA kernel: %s)",
                                             key[0] or "none", kplan.cuda_why or "covers it")


def decode_rows(qr: torch.Tensor, body: PagedBody, table: tuple | None, body_max: int, side_k, side_v, tier: tuple,
                tier_max: int, pad: int, scale: float, tiers: dict | None = None, graphed: bool = False) -> torch.Tensor:
    """Attention of decode rows ``qr [B, Hq, D]`` over their body pages (``table``: the kernels' ``(indptr,
    block ids, last-page lengths)``, ``body_max`` the grid's body length; no body: ``body_max`` 0) and their
    side-pool tier (``tier`` likewise, ``tier_max``, positions below ``pad`` empty); ``tiers``: the refine
    tiers' kernel arguments. rotkv's decode kernel on CUDA (where a kernel reads the tiers), else the
    PyTorch reference; ``graphed`` (a step inside a CUDA graph): on CUDA the kernel or an error."""
    tiers = tiers or {}
    has_body = body_max > 0
    if kernels.enabled(qr):
        from rotkv.kernels.decode import decode_attention
        from rotkv.kernels.plan import plan_decode

        cfg, kplan = kernels.decode_config(), None
        if tiers:  # as rotkv's cache: where no kernel reads the refine tier (refine_kernel=0), the PyTorch path
            kplan = plan_decode(qr, body, cfg, ("refine" in tiers, "refine_values" in tiers))
        if graphed and has_body:
            _log_kernel(kplan or plan_decode(qr, body, cfg), qr.shape[0] * body.kv_heads * body_max)
        if kplan is None or kplan.covered:
            return decode_attention(qr, body if has_body else None, table, body_max, (side_k, side_v), tier,
                                    tier_max, sm_scale=scale, cfg=cfg, tier_start=pad, plan=kplan, **tiers)
        if graphed:
            raise ValueError(f"rotkv: no decode kernel reads the refine tier here ({kplan.why}), and the PyTorch "
                             f"path cannot run in a CUDA graph: set {WHERE}[\"cuda_graphs\"] to false")
    return decode_reference(qr, body if has_body else None, table if has_body else None, side_k, side_v, tier,
                            sm_scale=scale, tier_start=pad, **tiers)


def _add_refined(plan, i: int, nb: int, blocks: torch.Tensor, ks, vs, body: PagedBody, refine) -> None:
    """Add prefill row ``i`` (of the plan's prefill rows)'s refined pages (its newest ``refined_pages(nb, K,
    every)`` of ``nb`` body pages in ``blocks``, planned in the step's upload) to its dequantized body keys and
    values ``ks[0], vs[0] [H, nb * P, D]``, in place."""
    a, b = int(plan.prefine_indptr[i]), int(plan.prefine_indptr[i + 1])
    if b == a:
        return
    idx = plan.device("prefine_index", blocks.device)[a:b]
    slot = plan.device("prefine_slot", blocks.device)[a:b]
    local = torch.zeros_like(idx)
    ids = blocks[idx]
    for x, ring, part in zip((ks[0], vs[0]), (refine.keys, refine.values), body.parts):
        if ring is not None:
            ring.add(x[None], nb, slot, local, idx, part.scale[ids])


def body_dense_kernel(plan, body: PagedBody, block_table: torch.Tensor, dtype) -> tuple | None:
    """The prefill rows' body pages dequantized by rotkv's Triton dequantizer (``rotkv.kernels.dequant``, as rotkv's
    cache reads a prefill's history): keys and values ``[Bp, H, pbody_max, D]`` in ``dtype``, prefill row ``i``'s
    ``body_before * P`` tokens first in row ``i`` (the rest untouched); one launch per side for every prefill row.
    None where no prefill row has a body, or the kernels do not read this body on its device (then
    :func:`_history` dequantizes each row with PyTorch, the reference)."""
    if plan.pbody_max == 0 or not dequant_kernel_reads(body, body.k.codes):
        return None
    from rotkv.kernels.dequant import dequant_dense

    dev = body.k.codes.device
    table = (plan.device("pbody_indptr", dev), plan.device("pbody_pos", dev, block_table),
             plan.device("pbody_last", dev))
    shape = (len(plan.prefill_rows), body.kv_heads, plan.pbody_max, body.k.head_dim)
    out = tuple(torch.empty(shape, dtype=dtype, device=dev) for _ in range(2))
    for part, o in zip(body.parts, out):
        dequant_dense(part, *table, plan.pbody_max, o)
    return out


def dequant_kernel_reads(body: PagedBody, t: torch.Tensor) -> bool:
    """Whether rotkv's Triton dequantizer reads ``body`` on ``t``'s device: the decision rotkv's cache takes for
    its pools (``rotkv.kernels.plan.plan_pools``)."""
    from rotkv.kernels.plan import plan_pools

    return plan_pools(t, body).dequant


def _history(plan, i: int, body: PagedBody, side_k, side_v, block_table, geo, dtype, refine=None, dense=None):
    """Prefill row ``i`` (of the plan's prefill rows)'s stored keys and values ``[H, n, D]`` in ``dtype``: its body
    pages (dequantized: row ``i`` of ``dense``, :func:`body_dense_kernel`, else here with PyTorch; the newest
    refined where ``refine``, the layer's RefineRings) and its tier (sink, then window) as they were before the
    step."""
    r = int(plan.prefill_rows[i])
    nb, p = int(plan.body_before[r]), geo.page
    ks, vs = [], []
    if nb:
        blocks = block_table[r, geo.block_offset:geo.block_offset + nb].long()
        if dense is not None:
            ks.append(dense[0][i, :, :nb * p])
            vs.append(dense[1][i, :, :nb * p])
        else:
            for part, out in zip(body.parts, (ks, vs)):
                parts = [t[blocks] for t in part.tensors]  # [nb, H, P, W]
                parts = [t.permute(1, 0, 2, 3).reshape(t.shape[1], nb * p, t.shape[3]) for t in parts]
                out.append(dequant_rows(*parts, part.bits, part.group_size).to(dtype))
        if refine is not None:
            _add_refined(plan, i, nb, blocks, ks, vs, body, refine)
    a, b = int(plan.htier_indptr[i]), int(plan.htier_indptr[i + 1])
    if b > a:
        page = plan.device("htier_page", side_k.device)[a:b]
        off = plan.device("htier_off", side_k.device)[a:b]
        ks.append(side_k[page, :, off].transpose(0, 1).to(dtype))
        vs.append(side_v[page, :, off].transpose(0, 1).to(dtype))
    return ks, vs


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The prefill's arithmetic dtype: the model's half dtype on CUDA, else float32 (the reference)."""
    return q.dtype if (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)) else torch.float32


def _prefill(plan, i: int, q: torch.Tensor, kr, vr, body, side_k, side_v, block_table, geo, rot, scale,
             refine=None, dense=None):
    """Prefill row ``i`` (of the plan's prefill rows)'s output ``[n, Hq, D]`` (model basis): its rotated queries
    over its history (``dense``: the prefill rows' body, :func:`body_dense_kernel`, or None) and its own rotated
    keys and values (causal). On CUDA in the model dtype, the history and the own tokens apart (PyTorch's fused
    kernels, no mask) merged by their log-sum-exp, as rotkv's own prefill does
    (``rotkv.cache.layer.attention_lse``); elsewhere one float32 softmax with a mask (the reference)."""
    cdt = _compute_dtype(q)
    r = int(plan.prefill_rows[i])
    a, b = int(plan.query_start[r]), int(plan.query_start[r + 1])
    n = b - a
    ks, vs = _history(plan, i, body, side_k, side_v, block_table, geo, cdt, refine, dense)
    hist = sum(x.shape[1] for x in ks)
    if cdt != torch.float32 or MERGED_PREFILL:
        from rotkv.cache.layer import attention_lse, merge_lse

        qr = _rotate_q(rot, q[a:b], cdt).transpose(0, 1)[None]  # [1, Hq, n, D]
        ko, vo = (_heads_first(x[a:b]).to(cdt)[None] for x in (kr, vr))
        o, lse = attention_lse(qr, ko, vo, True, scale)
        if hist:
            oh, lh = attention_lse(qr, torch.cat(ks, 1)[None], torch.cat(vs, 1)[None], False, scale)
            o = merge_lse(oh, lh, o, lse).to(cdt)
        return _unrotate_o(rot, o[0].transpose(0, 1), q.dtype)
    k = torch.cat(ks + [_heads_first(kr[a:b]).to(cdt)], 1)[None]  # [1, H, hist + n, D]
    v = torch.cat(vs + [_heads_first(vr[a:b]).to(cdt)], 1)[None]
    qr = _rotate_q(rot, q[a:b], cdt).transpose(0, 1)[None]  # [1, Hq, n, D]
    keys = torch.arange(hist + n, device=q.device)
    mask = keys[None, :] < hist + 1 + torch.arange(n, device=q.device)[:, None]  # history, then causal own
    o = torch.nn.functional.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=scale,
                                                         enable_gqa=qr.shape[1] != k.shape[1])
    return _unrotate_o(rot, o[0].transpose(0, 1), q.dtype)


def layer_step(plan, geo, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, body: PagedBody,
               side_k: torch.Tensor, side_v: torch.Tensor, block_table: torch.Tensor, rot: LayerRotation,
               codecs, scale: float, out: torch.Tensor, refine=None) -> torch.Tensor:
    """One layer of one step (see the module docstring). ``q [T, Hq, D]``, ``k, v [T, H, D]`` (the step's new
    tokens, T >= ``plan.num_tokens``: vLLM may pad), ``side_k, side_v [pages, H, P, D]``, ``block_table [B, M]``
    (vLLM's), ``rot`` this rank's heads, ``codecs`` (key, value) TokenCodecs; ``refine``: the layer's
    :class:`~rotkv.cache.refine.RefineRings` (one ring row per side-pool slot) or None; writes ``out [T, Hq, D]``."""
    dev, sdt = q.device, side_k.dtype
    t = plan.num_tokens
    kr, vr = rotate_kv(rot, k[:t], v[:t], sdt)
    if len(plan.decode_rows):  # (1) decode tokens into the side pool
        pg, off, tok = (plan.device(n, dev) for n in ("dwrite_page", "dwrite_off", "dwrite_tok"))
        side_k[pg, :, off] = kr[tok]
        side_v[pg, :, off] = vr[tok]
        # (2) decode attention
        tok = plan.device("dwrite_tok", dev)
        qr = _rotate_q(rot, q[tok], q.dtype)
        o = _decode(plan, qr, body, side_k, side_v, block_table, scale, refine)
        out[tok] = _unrotate_o(rot, o, out.dtype)
    # (2) prefill attention; the prefill rows' body pages dequantized at once by the kernel where it reads them
    dense = body_dense_kernel(plan, body, block_table, _compute_dtype(q)) if len(plan.prefill_rows) else None
    for i, r in enumerate(plan.prefill_rows.tolist()):
        a, b = int(plan.query_start[r]), int(plan.query_start[r + 1])
        out[a:b] = _prefill(plan, i, q[:t], kr, vr, body, side_k, side_v, block_table, geo, rot, scale,
                            refine, dense).to(out.dtype)
    if len(plan.flush_pos):  # (3) the flush
        n = len(plan.flush_pos) * geo.page
        blocks = plan.device("flush_pos", dev, block_table)
        if refine is not None:  # the pages the rings keep: their slots and body indices, positions in the flush
            target = (plan.device("rwrite_slot", dev), plan.device("rwrite_index", dev),
                      None if plan.rwrite_sel is None else plan.device("rwrite_sel", dev))
        for i, (x_new, side, part, codec) in enumerate(((kr, side_k, body.k, codecs[0]),
                                                        (vr, side_v, body.v, codecs[1]))):
            x = torch.empty(n, x_new.shape[1], x_new.shape[2], dtype=sdt, device=dev)
            if len(plan.flush_from_side):
                x[plan.device("flush_from_side", dev)] = side[plan.device("flush_side_page", dev), :,
                                                              plan.device("flush_side_off", dev)]
            if len(plan.flush_from_call):
                x[plan.device("flush_from_call", dev)] = x_new[plan.device("flush_call_tok", dev)]
            write_body(x, blocks, part, codec.clip)
            if refine is not None:  # the refine bits from the exact pages and their 2-bit reading (rotkv's write)
                pages = x.view(len(plan.flush_pos), geo.page, *x.shape[1:]).transpose(1, 2)  # [n, H, P, D]
                refine.write(i, pages, blocks.long(), None, dict(zip(("codes", "scale", "lo"), part.tensors)), codec,
                             target)
    if len(plan.pwrite_page):  # (4) prefill tokens that stay
        pg, off, tok = (plan.device(n, dev) for n in ("pwrite_page", "pwrite_off", "pwrite_tok"))
        side_k[pg, :, off] = kr[tok]
        side_v[pg, :, off] = vr[tok]
    return out
