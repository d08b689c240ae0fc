"""One layer's attention and cache update for one vLLM step, on plain tensors (no vLLM import).

:func:`layer_step` takes the step's :class:`~rotkv.integrations.vllm.state.StepPlan` (planned once per step
from vLLM's ``query_start_loc``, ``seq_lens`` and ``block_table``), the layer's queries, keys and values of
the step's new tokens (vLLM's ``[tokens, heads, D]``), its INT2 body over vLLM's blocks
(:class:`~rotkv.kernels.body.PagedBody`, :mod:`rotkv.integrations.vllm.layout`), its bf16 side pool, the
layer's rotation and codecs; it writes the attention output. The order of a step is the module docstring's
of :mod:`rotkv.integrations.vllm.state`. On CUDA it runs rotkv's kernels (the split-K decode over the body and
the side pool, the fused quantizing write, the dequantizer of the prefill rows' history in launches within
``ROTKV_PREFILL_HISTORY_MB``); elsewhere their PyTorch references (``rotkv.kernels.reference``), which the CPU tests
compare against rotkv's own cache.

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


# the CUDA prefill's attention in parts (each piece of the history and the own tokens apart, merged by their
# log-sum-exp) on every device; the CPU tests set it to check that path against rotkv's cache
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


def flush_into_body(side_k, side_v, page, off, slots, blocks, body: PagedBody, codecs, refine=None,
                    ring_target: tuple | None = None) -> bool:
    """Pages of the side pools into the body, keys and values in one launch of rotkv's flush kernel
    (``rotkv.kernels.write.flush_pages``: token ``i`` of page ``r`` read at side-pool ``page``/``off`` ``[r * P +
    i]``, written at body ``slots``; a page bound for block 0 skipped), with the layer's refine bits where it has a
    refine tier (``refine``: its RefineRings; page ``r``'s bits at ring row ``ring_target[0][r]``, body index
    ``ring_target[1][r]``). False, writing nothing, where that kernel does not apply (kernels off,
    :func:`~rotkv.kernels.plan.flush_reason`): the caller gathers and writes."""
    from rotkv.kernels.plan import plan_flush

    if not kernels.enabled(side_k) or not plan_flush(side_k, (body.k, body.v)):
        return False
    from rotkv.kernels.write import flush_pages

    rings = (None, None) if refine is None else tuple(r.data if r is not None else None
                                                      for r in (refine.keys, refine.values))
    flush_pages(side_k, side_v, page, off, slots, blocks, body.k, body.v, codecs[0].clip, codecs[1].clip,
                rings=rings, ring_target=None if refine is None else ring_target[:2])
    return True


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
                tier_max: int, pad: int, scale: float, tiers: dict | None = None, graphed: bool = False,
                out: torch.Tensor | None = None, out_rotation: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of decode rows ``qr [B, Hq, D]`` over their body pages (``table``: the kernels' ``(indptr,
    block ids, last-page lengths)``, ``body_max`` the grid's body length; no body: ``body_max`` 0) and their
    side-pool tier (``tier`` likewise, ``tier_max``, positions below ``pad`` empty); ``tiers``: the refine
    tiers' kernel arguments. rotkv's decode kernel on CUDA (where a kernel reads the tiers), else the
    PyTorch reference; ``graphed`` (a step inside a CUDA graph): on CUDA the kernel or an error. ``out_rotation``
    (with a contiguous bf16 ``out [B, Hq, D]``): the outputs turned back by that split matrix (``R_V^T``), inside
    the kernel's merge, or by its PyTorch form after the reference."""
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
                                    tier_max, sm_scale=scale, cfg=cfg, tier_start=pad, plan=kplan, out=out,
                                    out_rotation=out_rotation,
                                    max_split_tokens=cfg.graph_split_tokens if graphed else None, **tiers)
        if graphed:
            raise ValueError(f"rotkv: no decode kernel reads the refine tier here ({kplan.why}), and the PyTorch "
                             f"path cannot run in a CUDA graph: set {WHERE}[\"cuda_graphs\"] to false")
    o = decode_reference(qr, body if has_body else None, table if has_body else None, side_k, side_v, tier,
                         sm_scale=scale, tier_start=pad, **tiers)
    if out_rotation is not None:
        from rotkv.rotations.base import _rotate_bf16x2_bmm

        o = _rotate_bf16x2_bmm(o.to(torch.bfloat16).transpose(0, 1)[None], out_rotation, None)[0].transpose(0, 1)
    if out is None:
        return o
    out.copy_(o)
    return out


def history_launches(pages, page_bytes: int, budget_mb: int | None = None) -> list[tuple[int, int, int, int]]:
    """How the prefill rows' body pages are dequantized (``pages``: each prefill row's body pages; ``page_bytes``:
    one page's dequantized keys and values): launches ``(i0, i1, j0, j1)`` in row order, each body pages ``j0 ..
    j1 - 1`` (of those a row has) of prefill rows ``i0 .. i1 - 1`` into K and V buffers of ``(i1 - i0) * (j1 - j0)``
    pages that stay within ``budget_mb`` MiB (None: ``ROTKV_PREFILL_HISTORY_MB``, the bound rotkv's cache puts on
    a row group, ``rotkv.cache.layer.row_groups``). Rows whose bodies fit are grouped whole (``j0 = 0``, ``j1``
    the group's longest body); a row whose body alone exceeds the budget is read in page ranges of its own
    (``i1 = i0 + 1``). One page at least per launch; rows without a body are in no launch of their own."""
    from rotkv.cache.layer import history_units

    cap = history_units(page_bytes, budget_mb)  # pages one launch may hold
    pages = [int(x) for x in pages]
    out, i = [], 0
    while i < len(pages):
        w = pages[i]
        if w > cap:  # this row alone exceeds the budget: its pages in ranges of `cap`
            out += [(i, i + 1, j0, min(j0 + cap, w)) for j0 in range(0, w, cap)]
        if w == 0 or w > cap:
            i += 1
            continue
        i1 = i + 1
        while i1 < len(pages) and (i1 + 1 - i) * max(w, pages[i1]) <= cap:
            w = max(w, pages[i1])
            i1 += 1
        while pages[i1 - 1] == 0:  # no trailing rows without a body
            i1 -= 1
        out.append((i, i1, 0, w))
        i = i1
    return out


def _whole_rows(pages, launch) -> bool:
    """Whether ``launch`` (:func:`history_launches`) reads whole bodies (else a page range of one row)."""
    i0, i1, j0, j1 = launch
    return j0 == 0 and max(int(x) for x in pages[i0:i1]) <= j1


def dequant_launch(plan, launch, body: PagedBody, block_table: torch.Tensor, dtype) -> tuple:
    """One launch of :func:`history_launches` by rotkv's Triton dequantizer (``rotkv.kernels.dequant``, as rotkv's
    cache reads a prefill's history), one kernel per side: keys and values ``[i1 - i0, H, (j1 - j0) * P, D]`` in
    ``dtype``, prefill row ``i0 + g``'s pages ``j0 ..`` (those it has) first in row ``g`` (the rest untouched). The
    table is the plan's (uploaded with the step): a group of whole rows reads its rows' slices of
    ``pbody_indptr`` and ``pbody_last``; a page range of one row its slice of ``pbody_pos`` and an index
    pointer ``[0, j1 - j0]`` filled on the device."""
    from rotkv.kernels.dequant import dequant_dense

    i0, i1, j0, j1 = launch
    dev, p = body.k.codes.device, body.k.codes.shape[2]
    pos = plan.device("pbody_pos", dev, block_table)
    last = plan.device("pbody_last", dev)[i0:i1]
    if _whole_rows(plan.body_before[plan.prefill_rows], launch):
        indptr = plan.device("pbody_indptr", dev)[i0:i1 + 1]
    else:
        s = int(plan.pbody_indptr[i0])  # host
        pos = pos[s + j0:s + j1]
        indptr = torch.arange(0, 2 * (j1 - j0), j1 - j0, dtype=torch.int32, device=dev)
    shape = (i1 - i0, body.kv_heads, (j1 - j0) * p, body.k.head_dim)
    out = tuple(torch.empty(shape, dtype=dtype, device=dev) for _ in range(2))
    for part, o in zip(body.parts, out):
        dequant_dense(part, indptr, pos, last, shape[2], o)
    return out


def dequant_kernel_reads(body: PagedBody, t: torch.Tensor) -> bool:
    """Whether rotkv's Triton dequantizer reads ``body`` on ``t``'s device: the decision rotkv's cache takes for
    its pools (``rotkv.kernels.plan.plan_pools``)."""
    from rotkv.kernels.plan import plan_pools

    return plan_pools(t, body).dequant


def _row_blocks(plan, i: int, block_table: torch.Tensor, geo) -> torch.Tensor:
    """Prefill row ``i``'s body blocks (vLLM block ids) on the device, page 0 first."""
    r = int(plan.prefill_rows[i])
    return block_table[r, geo.block_offset:geo.block_offset + int(plan.body_before[r])]


def body_piece(plan, i: int, j0: int, j1: int, body: PagedBody, block_table, geo, dtype, bufs=None, g: int = 0,
               refine=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill row ``i``'s body pages ``j0 .. j1 - 1`` dequantized, keys and values ``[H, (j1 - j0) * P, D]`` in
    ``dtype``: row ``g`` of ``bufs`` (:func:`dequant_launch`), else here with PyTorch (the reference); with
    ``refine`` (the layer's RefineRings) the refined pages among them added, in place."""
    p = geo.page
    blocks = _row_blocks(plan, i, block_table, geo) if bufs is None or refine is not None else None
    if bufs is not None:
        k, v = (x[g, :, :(j1 - j0) * p] for x in bufs)
    else:
        k, v = (_dequant_pages(part, blocks[j0:j1].long(), p, dtype) for part in body.parts)
    if refine is not None:
        _add_refined(plan, i, j0, j1, blocks, k, v, body, refine)
    return k, v


def _dequant_pages(part, blocks: torch.Tensor, p: int, dtype) -> torch.Tensor:
    """Body pages ``blocks [n]`` of one part dequantized with PyTorch: ``[H, n * P, D]`` in ``dtype``."""
    n = len(blocks)
    parts = [t[blocks] for t in part.tensors]  # [n, H, P, W]
    parts = [t.permute(1, 0, 2, 3).reshape(t.shape[1], n * p, t.shape[3]) for t in parts]
    return dequant_rows(*parts, part.bits, part.group_size).to(dtype)


def _add_refined(plan, i: int, j0: int, j1: int, blocks: torch.Tensor, k, v, body: PagedBody, refine) -> None:
    """Add the refined pages among body pages ``j0 .. j1 - 1`` of prefill row ``i`` (of the plan's prefill rows;
    its newest ``refined_pages(nb, K, every)``, planned in the step's upload) to their dequantized keys and values
    ``k, v [H, (j1 - j0) * P, D]``, in place (``blocks``: the row's body blocks)."""
    a, b = int(plan.prefine_indptr[i]), int(plan.prefine_indptr[i + 1])
    index = plan.prefine_index[a:b]  # host, ascending: the row's refined pages in this range are a run
    a, b = a + int(np.searchsorted(index, j0)), a + int(np.searchsorted(index, j1))
    if b == a:
        return
    idx = plan.device("prefine_index", blocks.device)[a:b]
    slot = plan.device("prefine_slot", blocks.device)[a:b]
    local = torch.zeros_like(idx)
    ids = blocks[idx].long()
    for x, ring, part in zip((k, v), (refine.keys, refine.values), body.parts):
        if ring is not None:
            ring.add(x[None], j1 - j0, slot, local, idx, part.scale[ids], start=j0)


def _tier(plan, i: int, side_k, side_v, dtype) -> tuple | None:
    """Prefill row ``i``'s stored tier tokens (sink, then window) as they were before the step, keys and values
    ``[H, n, D]`` in ``dtype``, or None where it has none."""
    a, b = int(plan.htier_indptr[i]), int(plan.htier_indptr[i + 1])
    if b == a:
        return None
    page = plan.device("htier_page", side_k.device)[a:b]
    off = plan.device("htier_off", side_k.device)[a:b]
    return side_k[page, :, off].transpose(0, 1).to(dtype), side_v[page, :, off].transpose(0, 1).to(dtype)


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    """The prefill's arithmetic dtype: the model's half dtype on CUDA, else float32 (the reference)."""
    return q.dtype if (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16)) else torch.float32


class _PrefillRow:
    """One prefill row's attention, given its history piece by piece (body page ranges, then its tier) and then
    its own tokens. On CUDA in the model dtype, every piece and the own tokens apart (PyTorch's fused kernels, no
    mask) merged by their log-sum-exp, as rotkv's own prefill does (``rotkv.cache.layer.attention_lse``):
    no concatenated copy of the history; elsewhere (the reference) the pieces are kept and read by one float32
    softmax with a mask."""

    def __init__(self, plan, i: int, q: torch.Tensor, rot: LayerRotation, scale: float, cdt, merged: bool):
        r = int(plan.prefill_rows[i])
        self.a, self.b = int(plan.query_start[r]), int(plan.query_start[r + 1])
        self.qr = _rotate_q(rot, q[self.a:self.b], cdt).transpose(0, 1)[None]  # [1, Hq, n, D]
        self.scale, self.cdt, self.merged = scale, cdt, merged
        self.ks, self.vs = [], []
        self.o = self.lse = None

    def add(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Attend history keys and values ``[H, m, D]`` (rotated basis)."""
        if not self.merged:
            self.ks.append(k)
            self.vs.append(v)
            return
        from rotkv.cache.layer import attention_lse

        self._merge(*attention_lse(self.qr, k[None], v[None], False, self.scale))

    def _merge(self, o: torch.Tensor, lse: torch.Tensor, last: bool = False) -> None:
        """Merges a piece's output and log-sum-exp into the row's; the ``last`` one (the own tokens) straight into
        the compute dtype, laid out ``[1, n, Hq, D]`` (what the output rotation reads), without a log-sum-exp."""
        from rotkv.cache.layer import merge_lse

        if self.o is None:
            self.o, self.lse = o, lse
        elif last:
            n, hq, d = o.shape[2], o.shape[1], o.shape[3]
            out = torch.empty(1, n, hq, d, dtype=self.cdt, device=o.device).transpose(1, 2)
            self.o, self.lse = merge_lse(self.o, self.lse, o, lse, self.cdt, out=out), None
        else:
            self.o, self.lse = merge_lse(self.o, self.lse, o, lse, with_lse=True)

    def finish(self, kr: torch.Tensor, vr: torch.Tensor, rot: LayerRotation, dtype) -> torch.Tensor:
        """The row's output ``[n, Hq, D]`` in ``dtype`` (model basis), with its own rotated keys and values
        (``kr, vr``: the step's ``[T, H, D]``), causal."""
        ko, vo = (_heads_first(x[self.a:self.b]).to(self.cdt)[None] for x in (kr, vr))
        if self.merged:
            from rotkv.cache.layer import attention_lse

            self._merge(*attention_lse(self.qr, ko, vo, True, self.scale), last=True)
            return _unrotate_o(rot, self.o.to(self.cdt)[0].transpose(0, 1), dtype)
        hist, n = sum(x.shape[1] for x in self.ks), self.b - self.a
        k = torch.cat(self.ks + [ko[0]], 1)[None]  # [1, H, hist + n, D]
        v = torch.cat(self.vs + [vo[0]], 1)[None]
        keys = torch.arange(hist + n, device=k.device)
        mask = keys[None, :] < hist + 1 + torch.arange(n, device=k.device)[:, None]  # history, then causal own
        o = torch.nn.functional.scaled_dot_product_attention(self.qr, k, v, attn_mask=mask, scale=self.scale,
                                                             enable_gqa=self.qr.shape[1] != k.shape[1])
        return _unrotate_o(rot, o[0].transpose(0, 1), dtype)


def _prefill(plan, q: torch.Tensor, kr, vr, body, side_k, side_v, block_table, geo, rot, scale, out,
             refine=None) -> None:
    """The prefill rows' outputs into ``out`` (model basis): each row's rotated queries over its history and its
    own rotated keys and values (causal), :class:`_PrefillRow`. The history's body is dequantized in the
    launches of :func:`history_launches` (the K and V of one launch within ``ROTKV_PREFILL_HISTORY_MB``): by the
    Triton dequantizer where it reads the body (:func:`dequant_launch`), else per row with PyTorch; a row is
    finished once its last body page has been read, and a launch's buffers are freed before the next."""
    cdt = _compute_dtype(q)
    merged = cdt != torch.float32 or MERGED_PREFILL
    pages = plan.body_before[plan.prefill_rows]
    launches = []
    if plan.pbody_max > 0:
        size = torch.empty(0, dtype=cdt).element_size()
        launches = history_launches(pages, 2 * body.kv_heads * geo.page * body.k.head_dim * size)
    kernel = bool(launches) and dequant_kernel_reads(body, body.k.codes)
    rows: dict[int, _PrefillRow] = {}  # the rows being read
    done = 0  # prefill rows before this one are written

    def row(i):
        if i not in rows:
            rows[i] = _PrefillRow(plan, i, q, rot, scale, cdt, merged)
        return rows[i]

    def finish(upto):  # rows up to `upto` have read their body: their tier, then their own tokens
        nonlocal done
        for i in range(done, upto + 1):
            tier = _tier(plan, i, side_k, side_v, cdt)
            if tier is not None:
                row(i).add(*tier)
            x = row(i)
            del rows[i]
            out[x.a:x.b] = x.finish(kr, vr, rot, q.dtype).to(out.dtype)
        done = max(done, upto + 1)

    for launch in launches:
        i0, i1, j0, j1 = launch
        bufs = dequant_launch(plan, launch, body, block_table, cdt) if kernel else None
        for i in range(i0, i1):
            e = min(int(pages[i]), j1)  # the row's pages in this launch: j0 .. e - 1
            if e > j0:
                row(i).add(*body_piece(plan, i, j0, e, body, block_table, geo, cdt, bufs, i - i0, refine))
        bufs = None  # freed before the next launch's (the rows hold none of it in the merged path)
        finish(i1 - 1 if j1 >= int(pages[i1 - 1]) else i0 - 1)
    finish(len(pages) - 1)


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
    if len(plan.prefill_rows):  # (2) prefill attention
        _prefill(plan, q[:t], kr, vr, body, side_k, side_v, block_table, geo, rot, scale, out, refine)
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
