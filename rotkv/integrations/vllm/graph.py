"""The decode step on fixed buffers, which vLLM captures in its full CUDA graphs.

vLLM captures the whole model for batches of decode rows (one new token each), padded to a captured size,
and replays the capture: the kernels run again with the pointers and shapes they had, and no Python runs.
So the step may read only tensors that stay at one address, in shapes set by the batch size alone, and
nothing it does may depend on the step's host values. :class:`StaticDecode` holds those tensors (one set per
metadata builder, sized for ``rows`` rows); :meth:`StaticDecode.load` fills them before each step (outside
the graph) from the step's host plan (:func:`~rotkv.integrations.vllm.state.plan_step`); :func:`static_step`
is the layer's step on them. Against the general step (:func:`~rotkv.integrations.vllm.attention.layer_step`):

- vLLM's padding rows (no token, block table 0) are one-token requests in the scratch slot of the side pool
  (:func:`static_rows`); their outputs are discarded;
- the decode kernel's grid is sized for the longest body and tier ``max_len`` allows (its splits past a row's
  pages do nothing);
- the flush writes one page per row: a decode row flushes at most one page a step (the window moves by one
  token), and a row that flushes none has its page bound for vLLM's null block 0, which no request's body holds
  (the one-launch flush skips it; the per-side writes write it there).

With ``graph_fusion`` (``ROTKV_TUNING``, on by default) a layer's step is five launches where the rotation kernel
applies: one rotation of the queries, keys and values (``rotkv.kernels.rotate.rotate_many``), the decode kernel's
two or three (its output turned back by ``R_V^T`` inside its merge), and one flush of keys and values
(``rotkv.kernels.write.flush_pages``, the refine bits of a refine tier in the same launch).

A preset with a refine tier gathers the rows' ring rows by slot for the decode kernel (padding rows: the scratch
slot's), and every row's flushed page writes its refine bits: a row that flushes none into the scratch slot's
ring row, whose pages no row reads (the scratch rows have no body).
"""

from __future__ import annotations

import numpy as np
import torch

from rotkv.integrations.vllm.attention import (_rotate_q, _unrotate_o, decode_rows, flush_into_body, page_slots,
                                               ring_tiers, rotate_kv, write_body)
from rotkv.integrations.vllm.state import Geometry, StepPlan, plan_step, upload_int64
from rotkv.kernels.plan import plan_graph_rotations


def static_rows(lengths: np.ndarray, slots: np.ndarray, num_tokens: np.ndarray, scratch: int):
    """A decode batch as :func:`plan_step` plans it here: every row one token (row ``r``: call token ``r``),
    the padding rows (no token) one-token requests in the ``scratch`` slot. Returns ``(query_start, lengths,
    slots)``."""
    pad = num_tokens == 0
    b = len(lengths)
    return (np.arange(b + 1, dtype=np.int64), np.where(pad, 1, lengths).astype(np.int64),
            np.where(pad, scratch, slots).astype(np.int64))


def is_static_batch(num_tokens: np.ndarray, call_tokens: int) -> bool:
    """Whether a step's rows (new tokens per row) run as :func:`static_step`: one token each, the padding rows
    (none) after them, and a call token for every row (vLLM pads a full graph's call to one per row)."""
    n = np.asarray(num_tokens)
    real = int((n == 1).sum())
    return len(n) > 0 and bool(np.all(n[:real] == 1)) and bool(np.all(n[real:] == 0)) and call_tokens >= len(n)


class StaticDecode:
    """The fixed buffers of the graphed decode step, for up to ``rows`` rows of a model of ``geo`` (its
    ``max_len``), on ``device``. Views of the first ``b`` rows (:meth:`tables`) keep their addresses across
    steps, so a graph captured for ``b`` rows reads each step's values."""

    def __init__(self, geo: Geometry, rows: int, scratch: int, device, kv_heads: int, head_dim: int):
        self.geo, self.rows, self.scratch = geo, rows, scratch
        # the side pools' strides (contiguous [pages, H, P, D]): a decode token's element offset for the rotation
        # kernel that writes it straight into its slot
        self.side_strides = (kv_heads * geo.page * head_dim, head_dim)
        p = geo.page
        self.body_pages = int(geo.body_pages(geo.max_len))
        self.body_max = self.body_pages * p
        self.tier_max = geo.slot_pages * p
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.wpage, self.woff, self.wrow = (torch.zeros(rows, **i64) for _ in range(3))
        self.body_indptr, self.body_last = torch.zeros(rows + 1, **i32), torch.zeros(rows, **i32)
        self.body_ids = torch.zeros(max(rows * self.body_pages, 1), **i32)
        self.tier_indptr, self.tier_last = torch.zeros(rows + 1, **i32), torch.zeros(rows, **i32)
        self.tier_idx = torch.zeros(rows * geo.slot_pages, **i32)
        self.flush_blocks = torch.zeros(rows, **i64)  # the flushed pages' blocks (none: vLLM's null block 0)
        self.flush_slots = torch.zeros(rows * p, **i64)  # their token slots
        # the refine tier: the rows' side-pool slots (their ring rows), and each flushed page's ring row and body index
        self.dslots = torch.zeros(rows, **i64)
        self.ring_row, self.ring_index = torch.zeros(rows, **i64), torch.zeros(rows, **i64)
        self.flush_page, self.flush_off = torch.zeros(rows * p, **i64), torch.zeros(rows * p, **i64)

    def load(self, plan: StepPlan, block_table: torch.Tensor) -> None:
        """Write a step's plan (every row a decode row, :func:`static_rows`) into the buffers: one host-to-device
        copy of the packed host arrays, then device copies (the body's block ids and the flush's destinations
        gathered from vLLM's ``block_table``)."""
        b, p = len(plan.decode_rows), self.geo.page
        if b > self.rows:
            raise ValueError(f"rotkv: a decode batch of {b} rows, the graphed step holds {self.rows}")
        if len(plan.decode_rows) != len(plan.lengths) or len(plan.flush_from_call) or len(plan.pwrite_page):
            raise ValueError("rotkv: the graphed decode step takes a batch of decode rows only")
        frow = plan.flush_pos // block_table.shape[1]
        if len(np.unique(frow)) != len(frow):
            raise ValueError("rotkv: a decode row flushes more than one page in a step")
        # per row: the flat block-table position of its flushed page (-1: none) and its page's side-pool tokens
        fpos = np.full(b, -1, dtype=np.int64)
        fpos[frow] = plan.flush_pos
        if plan.rwrite_sel is not None:
            raise ValueError("rotkv: a decode row's flush keeps no refine bits")
        ring_row = np.full(b, self.scratch, dtype=np.int64)  # rows that flush none: the scratch ring row
        ring_index = np.zeros(b, dtype=np.int64)
        ring_row[frow], ring_index[frow] = plan.rwrite_slot, plan.rwrite_index
        fpage = np.zeros((b, p), dtype=np.int64)  # rows that flush none read page 0 (written to block 0)
        foff = np.zeros((b, p), dtype=np.int64)
        fpage[frow] = plan.flush_side_page.reshape(-1, p)
        foff[frow] = plan.flush_side_off.reshape(-1, p)
        tier_indptr, tier_idx, tier_last = plan.dtier
        parts = [plan.dwrite_page, plan.dwrite_off, plan.dbody_indptr, plan.dbody_last, tier_indptr,
                 tier_idx[:tier_indptr[-1]], tier_last, fpos, fpage.ravel(), foff.ravel(), plan.dslots, ring_row,
                 ring_index, plan.dbody_pos]
        views = upload_int64(parts, self.wpage.device)
        wpage, woff, bindptr, blast, tindptr, tidx, tlast, fpos_d, fpage_d, foff_d, dslots, rrow, rindex, bpos = views
        table = block_table.reshape(-1)
        self.wpage[:b].copy_(wpage)
        self.woff[:b].copy_(woff)
        torch.add(wpage * self.side_strides[0], woff, alpha=self.side_strides[1], out=self.wrow[:b])
        self.body_indptr[:b + 1].copy_(bindptr)
        self.body_last[:b].copy_(blast)
        if len(bpos):
            self.body_ids[:len(bpos)].copy_(table[bpos])
        self.tier_indptr[:b + 1].copy_(tindptr)
        self.tier_idx[:len(tidx)].copy_(tidx)
        self.tier_last[:b].copy_(tlast)
        self.flush_blocks[:b].copy_(torch.where(fpos_d >= 0, table[fpos_d.clamp(min=0)].long(), 0))
        self.flush_slots[:b * p].copy_(page_slots(self.flush_blocks[:b], p))
        self.dslots[:b].copy_(dslots)
        self.ring_row[:b].copy_(rrow)
        self.ring_index[:b].copy_(rindex)
        self.flush_page[:b * p].copy_(fpage_d)
        self.flush_off[:b * p].copy_(foff_d)

    def tables(self, b: int) -> dict:
        """The first ``b`` rows' views (fixed addresses): the decode kernel's body and tier tables, the decode
        writes and the flush."""
        p = self.geo.page
        return dict(wpage=self.wpage[:b], woff=self.woff[:b], wrow=self.wrow[:b],
                    body=(self.body_indptr[:b + 1], self.body_ids, self.body_last[:b]),
                    tier=(self.tier_indptr[:b + 1], self.tier_idx, self.tier_last[:b]),
                    flush_blocks=self.flush_blocks[:b], flush_slots=self.flush_slots[:b * p],
                    flush_page=self.flush_page[:b * p], flush_off=self.flush_off[:b * p], dslots=self.dslots[:b],
                    ring_target=(self.ring_row[:b], self.ring_index[:b], None))


def static_plan(geo: Geometry, lengths: np.ndarray, slots: np.ndarray, num_tokens: np.ndarray, scratch: int,
                block_cols: int) -> StepPlan:
    """The host plan of a decode batch for :meth:`StaticDecode.load` (:func:`static_rows`)."""
    qs, lens, sl = static_rows(lengths, slots, num_tokens, scratch)
    return plan_step(geo, qs, lens, sl, block_cols)


def static_step(st: StaticDecode, b: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, body,
                side_k: torch.Tensor, side_v: torch.Tensor, rot, codecs, scale: float, out: torch.Tensor,
                refine=None) -> torch.Tensor:
    """One layer of a decode batch of ``b`` rows on the fixed buffers (the module docstring): the rows' tokens
    into the side pool, the decode kernel over the body and the side pool, one page per row flushed.
    ``q [>= b, Hq, D]``, ``k, v [>= b, H, D]`` (row ``r``'s token at ``r``); ``refine``: the layer's
    :class:`~rotkv.cache.refine.RefineRings` (one ring row per side-pool slot) or None; writes ``out[:b]``."""
    t = st.tables(b)
    tiers = ring_tiers(refine, t["dslots"])
    # rotkv's rotation kernel (bf16 on CUDA) writes the rows' keys and values straight into their side-pool slots
    # and the queries straight into a contiguous [b, Hq, D] buffer (the decode kernel's layout): all three in one
    # launch (graph_fusion), else one launch each; where it does not apply, rotated, then scattered
    qr = torch.empty(b, *q.shape[1:], dtype=q.dtype, device=q.device)
    slots_ok = side_k.stride()[0:3:2] == st.side_strides and side_v.stride()[0:3:2] == st.side_strides
    kv_jobs = [("keys", k[:b, :, None], side_k, t["wrow"]), ("values", v[:b, :, None], side_v, t["wrow"])]
    if not (slots_ok and plan_graph_rotations()
            and rot.rotate_many_into(kv_jobs + [("queries", q[:b, :, None], qr[:, :, None], None)])):
        done_k, done_v = (slots_ok and rot.rotate_into(*job) for job in kv_jobs)
        if not (done_k and done_v):
            kr, vr = rotate_kv(rot, k[:b], v[:b], side_k.dtype)
            if not done_k:
                side_k[t["wpage"], :, t["woff"]] = kr
            if not done_v:
                side_v[t["wpage"], :, t["woff"]] = vr
        if not rot.rotate_into("queries", q[:b].transpose(0, 1)[None], qr.transpose(0, 1)[None]):
            qr = _rotate_q(rot, q[:b], q.dtype)
    # the outputs turned back by R_V^T inside the decode kernel's merge (graph_fusion), else by the rotation kernel
    # straight into ``out``, else rotated, then copied
    a_out = None
    if plan_graph_rotations() and out[:b].is_contiguous():
        a_out = rot.kernel_matrix("outputs", qr.transpose(0, 1)[None], out[:b].transpose(0, 1)[None])
    if a_out is not None:
        decode_rows(qr, body, t["body"], st.body_max, side_k, side_v, t["tier"], st.tier_max, st.geo.pad, scale,
                    tiers, graphed=True, out=out[:b], out_rotation=a_out)
    else:
        o = decode_rows(qr, body, t["body"], st.body_max, side_k, side_v, t["tier"], st.tier_max, st.geo.pad, scale,
                        tiers, graphed=True)
        if not rot.rotate_into("outputs", o.transpose(0, 1)[None], out[:b].transpose(0, 1)[None]):
            out[:b] = _unrotate_o(rot, o, out.dtype)
    if flush_into_body(side_k, side_v, t["flush_page"], t["flush_off"], t["flush_slots"], t["flush_blocks"], body,
                       codecs, refine, t["ring_target"]):
        return out
    for i, (side, part, codec) in enumerate(((side_k, body.k, codecs[0]), (side_v, body.v, codecs[1]))):
        x = side[t["flush_page"], :, t["flush_off"]]  # [b * P, H, D]: row r's page at r * P
        write_body(x, None, part, codec.clip, t["flush_slots"])
        if refine is not None:  # the refine bits from the exact pages and their 2-bit reading (rotkv's write)
            pages = x.view(b, st.geo.page, *x.shape[1:]).transpose(1, 2)  # [b, H, P, D]
            refine.write(i, pages, t["flush_blocks"], None, dict(zip(("codes", "scale", "lo"), part.tensors)), codec,
                         t["ring_target"])
    return out
