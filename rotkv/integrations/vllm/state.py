"""The host side of one vLLM step: which request holds which side-pool slot, and what every layer reads
and writes (the same for every layer, so it is planned once per step by the metadata builder).

Tokens of a request (positions ``0 .. L-1``) live in three places, as in rotkv's paged cache
(``rotkv.cache.plan``): the **sink**, its first ``S`` tokens, and the **window**, its last ``win`` tokens
(``win`` between ``w`` and ``w + P - 1`` once the request is long enough, ``w = window_at(L)``), stay bf16 in
the backend's side pool; the **body** between them is INT2 pages of ``P`` tokens, page ``i`` holding tokens
``S + i P .. S + (i + 1) P - 1``. The body of a request of ``L`` tokens has :func:`body_pages` ``(L)`` pages
(``max(0, (L - S - w(L)) // P)``), a function of ``L`` alone: rotkv's flush rule gives the same count whatever
the chunking. Page ``i`` is stored in the request's vLLM block ``ceil(S / P) + i`` (vLLM has allocated it by
the time the page is flushed: the block covers earlier positions than the page's last token).

Side pool (per layer, ``[slots * (SP + RP), H, P, D]`` pages): request slot ``s`` owns pages ``s * (SP + RP) ..``;
its first ``SP`` pages hold the sink at tier positions ``pad .. pad + S - 1`` (``pad = (-S) % P``, so the
window starts on a page boundary, as in rotkv), the next ``RP`` pages are a ring of window pages: window
page ``a`` (the ``a``-th page after the sink, tokens ``S + a P ..``) sits in ring page ``a % RP``. ``RP`` holds
the longest window plus one page (a decode step writes its token before the flush).

Slots. vLLM's attention metadata has no request ids; the model runner has them on the host
(:mod:`rotkv.integrations.vllm.runner`), and a request is known by its id, fixed while it lives. Where no hooked
runner names the rows (a runner the hooks do not know), a request is known by its first block id
(``block_table[r, 0]``, read from the device), which is fixed while the request holds its blocks and unique among
live requests (prefix caching is off: no block is shared). A request in its first step (no computed tokens)
takes a free slot (or the least recently seen one); a request with computed tokens must find its slot, else
the step fails (never a silent wrong answer). Requests the scheduler reports finished or preempted give their
slots back. Rows of no request (key None: vLLM's padding rows of a full graph, its dummy, profiling and capture
runs, and rows whose first block is vLLM's null block 0) use a scratch slot.

Refine rings (a preset with ``refine_tokens``, ``rotkv.cache.refine``): per layer and side (keys; values with
``refine_values``) a ring ``uint8 [slots + 1, K, H, P, D / 4]`` beside the side pool, row ``s`` the request in
slot ``s``, ``K = ceil(refine_tokens / P)``: body page ``i`` of a request keeps its 2 refine bits in slot
``i % K``, written when the page is flushed (from the exact keys and values, as rotkv's flush does: of a flush
of many pages of one request, its ``K`` newest). A request of ``n`` body pages reads its
``refined_pages(n, K, every)`` newest pages refined (``rotkv.quant.refine``). rotkv's cache grows its rings up
to ``K`` with its longest row; a ring of ``K`` slots from the start gives every row the same pages in the same
reading (``refined_pages`` of a row never exceeds the slots either way).

Every step of a request: (1) a decode row (one new token) writes its token into the side pool; (2) the
queries attend to the body pages ``0 .. body_pages(c) - 1`` (the newest of them refined) and the stored tier
(sink and window of the ``c`` computed tokens), and a prefill row also to its own new tokens, causally; (3)
body pages ``body_pages(c) .. body_pages(L) - 1`` are quantized from the side pool or the row's new tokens, and
their refine bits written to the rings; (4) a prefill row's new tokens that stay (sink or window after the
flush) are written to the side pool.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from rotkv.cache.refine import newest_pages, ring_writes
from rotkv.config import window_at


@dataclass(frozen=True)
class Geometry:
    """Sink ``S``, window ``W`` with its share, page ``P`` and ring pages of the side pool; ``refine_pages``
    (``K``, 0: no refine tier) and ``refine_every``: the refine rings' slots and size rule."""

    sink: int
    window: int
    window_share: float
    page: int
    max_len: int
    refine_pages: int = 0
    refine_every: int = 0

    @property
    def pad(self) -> int:
        return (-self.sink) % self.page

    @property
    def sink_pages(self) -> int:
        return (self.pad + self.sink) // self.page

    @property
    def block_offset(self) -> int:
        """The vLLM block index of body page 0: ``ceil(S / P)``."""
        return -(-self.sink // self.page)

    @property
    def ring_pages(self) -> int:
        """Ring pages per slot: the longest window at ``max_len`` tokens plus the page a decode token may open."""
        return -(-(window_at(self.window, self.window_share, self.max_len) + self.page) // self.page)

    @property
    def slot_pages(self) -> int:
        return self.sink_pages + self.ring_pages

    def body_pages(self, length):
        """Body pages of requests of ``length`` tokens (int or int64 array)."""
        t = np.asarray(length, dtype=np.int64)
        w = window_at(self.window, self.window_share, t)
        out = np.maximum((t - self.sink - w) // self.page, 0)
        return int(out) if out.ndim == 0 else out


class SlotTable:
    """Side-pool slots of live requests, keyed by a per-request key (request id, or first vLLM block id; see the
    module docstring)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.scratch = slots  # the extra slot of rows of no request
        self._of: OrderedDict = OrderedDict()  # key -> slot, least recently seen first
        self._free = list(range(slots - 1, -1, -1))

    def assign(self, keys, computed: np.ndarray) -> np.ndarray:
        """The slot of every row of a step (``keys``: the rows' request keys, None for a row of no request;
        ``computed``: tokens already stored)."""
        keys = list(keys)
        out = np.empty(len(keys), dtype=np.int64)
        in_step = set(keys)
        for i, (k, c) in enumerate(zip(keys, np.asarray(computed).tolist())):
            if k is None:
                out[i] = self.scratch
                continue
            if c == 0:  # a new request (or one restarted after preemption) under this key
                slot = self._of.pop(k, None)
                if slot is None:
                    slot = self._take(in_step)
                self._of[k] = slot
            else:
                slot = self._of.get(k)
                if slot is None:
                    raise RuntimeError(
                        f"rotkv: a request ({k!r}) with {c} computed tokens has no side-pool slot: its bf16 "
                        f"sink and window were evicted. Raise additional_config['rotkv']['spare_slots'] (now "
                        f"{self.slots} slots) or lower max_num_seqs")
                self._of.move_to_end(k)
            out[i] = slot
        return out

    def release(self, keys) -> None:
        """Give back the slots of requests whose state is gone (finished, preempted); unknown keys are ignored."""
        for k in keys:
            slot = self._of.pop(k, None)
            if slot is not None:
                self._free.append(slot)

    def _take(self, in_step: set) -> int:
        if self._free:
            return self._free.pop()
        for k in self._of:  # least recently seen first; never a row of this step
            if k not in in_step:
                return self._of.pop(k)
        raise RuntimeError(f"rotkv: more live requests than side-pool slots ({self.slots})")


@dataclass
class StepPlan:
    """What every layer does in one step (host arrays, int64, and their device copies in ``dev``).

    Rows are vLLM's requests of the step. ``decode`` rows (one new token) are attended by the decode
    kernel; ``prefill`` rows by dense attention over their history and own tokens.
    """

    num_tokens: int
    decode_rows: np.ndarray
    prefill_rows: np.ndarray
    query_start: np.ndarray  # [B + 1]
    computed: np.ndarray  # [B]
    lengths: np.ndarray  # [B]
    slots: np.ndarray  # [B]
    body_before: np.ndarray  # [B] body pages the queries read
    body_after: np.ndarray  # [B]
    # decode rows' write of their token into the side pool: side page, offset; call token index
    dwrite_page: np.ndarray
    dwrite_off: np.ndarray
    dwrite_tok: np.ndarray
    dslots: np.ndarray  # the decode rows' slots (their refine rings)
    # the decode kernel's tables (decode rows in order): body (block positions in the flat block table) and tier
    dbody_indptr: np.ndarray
    dbody_pos: np.ndarray
    dbody_last: np.ndarray  # int32: tokens in each decode row's last body page (P, or 0 without a body)
    dtier: tuple
    dtier_max: int
    dbody_max: int
    # the flush: destination block positions (flat block table), and per token its source
    flush_pos: np.ndarray  # [n] flat block-table positions of the pages written
    flush_from_side: np.ndarray  # token index in the flush (of n * P) read from the side pool
    flush_side_page: np.ndarray
    flush_side_off: np.ndarray
    flush_from_call: np.ndarray  # token index in the flush read from the call's new tokens
    flush_call_tok: np.ndarray
    # the flush's refine-ring writes (refine tier only): positions in the flush (None: every page), the
    # pages' slots and body indices
    rwrite_sel: np.ndarray | None
    rwrite_slot: np.ndarray
    rwrite_index: np.ndarray
    # prefill rows' new tokens that stay: side page, offset, call token index
    pwrite_page: np.ndarray
    pwrite_off: np.ndarray
    pwrite_tok: np.ndarray
    # the prefill rows' history (prefill rows in order): their body pages as the dequantizer's table (block
    # positions in the flat block table), and their stored tier tokens (sink, then window) as side page, offset,
    # each row's run at htier_indptr[i] .. htier_indptr[i + 1] (host)
    pbody_indptr: np.ndarray
    pbody_pos: np.ndarray
    pbody_last: np.ndarray  # int32: tokens in each prefill row's last body page (P, or 0 without a body)
    pbody_max: int
    htier_page: np.ndarray
    htier_off: np.ndarray
    htier_indptr: np.ndarray
    # the prefill rows' refined body pages (refine tier only): body index and side-pool slot (its ring row), each
    # row's run at prefine_indptr[i] .. prefine_indptr[i + 1] (host)
    prefine_index: np.ndarray
    prefine_slot: np.ndarray
    prefine_indptr: np.ndarray
    pad: int = 0
    dev: dict = field(default_factory=dict)

    def device(self, name: str, device, block_table: torch.Tensor | None = None) -> torch.Tensor:
        """A host array on ``device`` (``*_pos`` arrays: the block ids they point at in ``block_table``;
        ``dtier``: the tier table's three arrays). The first call of a step uploads every array at once
        (:meth:`_upload`); the layers then look them up."""
        key = (name, str(device))
        if key not in self.dev:
            arrays = self.dev.get(("uploaded", str(device)))
            if arrays is None:
                arrays = self.dev[("uploaded", str(device))] = self._upload(torch.device(device))
            t = arrays[name]
            if name.endswith("_pos"):
                t = block_table.reshape(-1)[t].to(torch.int32) if len(getattr(self, name)) else \
                    torch.zeros(1, dtype=torch.int32, device=device)
            self.dev[key] = t
        return self.dev[key]

    def _upload(self, device: torch.device) -> dict:
        """Every array of :data:`DEVICE_ARRAYS` and the tier table (``dtier``) on ``device`` by one copy: packed into one
        int64 buffer, pinned on CUDA (a copy from pageable memory waits for the stream: one such copy per
        array and layer would stall the host at every layer), then unpacked into views of their own dtypes."""
        items = [(n, getattr(self, n)) for n in DEVICE_ARRAYS if getattr(self, n) is not None]
        items += [(f"dtier{i}", a) for i, a in enumerate(self.dtier)]
        out = {}
        for (n, a), t in zip(items, upload_int64([a for _, a in items], device)):
            want = torch.from_numpy(np.asarray(a)[:0]).dtype
            out[n] = t if want == torch.int64 else t.to(want)
        out["dtier"] = tuple(out.pop(f"dtier{i}") for i in range(3))
        return out


def upload_int64(arrays: list, device: torch.device) -> list[torch.Tensor]:
    """Host integer ``arrays`` on ``device`` by one copy: packed into one int64 buffer, pinned on CUDA (a copy
    from pageable memory waits for the stream), copied without waiting, and split into int64 views, one per
    array (flattened)."""
    flat = np.concatenate([np.asarray(a, dtype=np.int64).ravel() for a in arrays] + [np.zeros(0, np.int64)])
    host = torch.from_numpy(flat)
    if device.type == "cuda":
        host = host.pin_memory()
    flat_dev = host.to(device, non_blocking=True)
    sizes = [np.asarray(a).size for a in arrays]
    return list(flat_dev.split(sizes)) if arrays else []


# the plan's host arrays that layers read on the device (uploaded together once per step)
DEVICE_ARRAYS = ("dwrite_page", "dwrite_off", "dwrite_tok", "dslots", "dbody_indptr", "dbody_pos", "dbody_last",
                 "flush_pos", "flush_from_side", "flush_side_page", "flush_side_off",
                 "flush_from_call", "flush_call_tok", "rwrite_sel", "rwrite_slot", "rwrite_index", "pwrite_page",
                 "pwrite_off", "pwrite_tok", "pbody_indptr", "pbody_pos", "pbody_last", "htier_page", "htier_off",
                 "prefine_index", "prefine_slot")


def _ranges(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner index, start + j) for ``j < counts[i]`` of every ``i``, flattened."""
    owner = np.repeat(np.arange(len(counts)), counts)
    j = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return owner, starts[owner] + j


def plan_step(geo: Geometry, query_start: np.ndarray, lengths: np.ndarray, slots: np.ndarray,
              block_cols: int) -> StepPlan:
    """Plan one step of rows with new tokens ``query_start[r] .. query_start[r+1] - 1`` of the call, ``lengths``
    tokens each after the step, side-pool ``slots``; ``block_cols``: the width of vLLM's block table (flat
    positions are ``row * block_cols + block``)."""
    p, s, pad, sp = geo.page, geo.sink, geo.pad, geo.sink_pages
    qs = np.asarray(query_start, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    n = qs[1:] - qs[:-1]
    c = lengths - n
    nb0, nb1 = geo.body_pages(c), geo.body_pages(lengths)
    base = slots * geo.slot_pages

    def side_at(rows, t):
        """Side page and offset of token ``t`` of ``rows`` (a sink token or a window token)."""
        sink = t < s
        a = np.where(sink, 0, (t - s) // p)
        tpos = pad + t
        page = np.where(sink, base[rows] + tpos // p, base[rows] + sp + a % geo.ring_pages)
        off = np.where(sink, tpos % p, (t - s) % p)
        return page, off

    decode = np.nonzero(n == 1)[0]
    prefill = np.nonzero(n > 1)[0]
    # decode rows: their token goes to the side pool first
    dt = lengths[decode] - 1
    dpage, doff = side_at(decode, dt)
    # decode tables: body pages 0 .. nb0 - 1 at blocks block_offset + i; tier: sink pages, then window pages
    brow, bi = _ranges(np.zeros(len(decode), dtype=np.int64), nb0[decode])
    dbody_pos = decode[brow] * block_cols + geo.block_offset + bi
    dbody_indptr = np.zeros(len(decode) + 1, dtype=np.int64)
    np.cumsum(nb0[decode], out=dbody_indptr[1:])
    tier_tokens = np.minimum(lengths[decode], s) + np.maximum(lengths[decode] - s - nb0[decode] * p, 0)
    used = np.where(tier_tokens > 0, -(-(pad + tier_tokens) // p), 0)
    sink_used = np.minimum(used, sp)
    win_used = used - sink_used
    trow, tj = _ranges(np.zeros(len(decode), dtype=np.int64), sink_used)
    sink_pages = base[decode][trow] + tj
    wrow, wj = _ranges(nb0[decode], win_used)
    win_pages = base[decode][wrow] + sp + wj % geo.ring_pages
    # each row's pages in order: its sink pages, then its window pages
    order = np.argsort(np.concatenate([trow * 2, wrow * 2 + 1]), kind="stable")
    tier_idx = np.concatenate([sink_pages, win_pages])[order]
    tier_indptr = np.zeros(len(decode) + 1, dtype=np.int64)
    np.cumsum(used, out=tier_indptr[1:])
    tpos = np.where(tier_tokens > 0, pad + tier_tokens, 0)
    tier_last = tpos - np.maximum(used - 1, 0) * p
    dtier = (tier_indptr.astype(np.int32), (tier_idx if len(tier_idx) else np.zeros(1, np.int64)).astype(np.int32),
             tier_last.astype(np.int32))
    # the flush: pages nb0 .. nb1 - 1 of every row, tokens S + i P + j
    k = nb1 - nb0
    frow, fi = _ranges(nb0, k)
    rsel = ring_writes(frow, fi, geo.refine_pages) if geo.refine_pages else None
    rrow, ri = (frow, fi) if rsel is None else (frow[rsel], fi[rsel])
    flush_pos = frow * block_cols + geo.block_offset + fi
    trow_f, tj_f = _ranges(np.zeros(len(frow), dtype=np.int64), np.full(len(frow), p, dtype=np.int64))
    rows_t = frow[trow_f]
    t = s + fi[trow_f] * p + tj_f  # the token's position in its request
    # decode rows have written their token already: every stored token comes from the side pool
    stored = t < np.where(n[rows_t] == 1, lengths[rows_t], c[rows_t])
    at = np.arange(len(t))
    spage, soff = side_at(rows_t[stored], t[stored])
    call_tok = qs[rows_t[~stored]] + t[~stored] - c[rows_t[~stored]]
    # prefill rows' new tokens that stay in the tier after the flush
    prow, pt = _ranges(c[prefill], n[prefill])
    prow = prefill[prow]
    stay = (pt < s) | (pt >= s + nb1[prow] * p)
    prow, pt = prow[stay], pt[stay]
    ppage, poff = side_at(prow, pt)
    # prefill rows' history: body pages 0 .. nb0 - 1 (as the decode rows'), the stored sink and window tokens
    hb = nb0[prefill]
    brow_p, bi_p = _ranges(np.zeros(len(prefill), dtype=np.int64), hb)
    pbody_indptr = np.zeros(len(prefill) + 1, dtype=np.int64)
    np.cumsum(hb, out=pbody_indptr[1:])
    cp = c[prefill]
    srow, st = _ranges(np.zeros(len(prefill), dtype=np.int64), np.minimum(cp, s))
    wstart = s + hb * p
    wrow, wt = _ranges(wstart, np.maximum(cp - wstart, 0))
    order = np.argsort(np.concatenate([srow * 2, wrow * 2 + 1]), kind="stable")
    hrow, ht = np.concatenate([srow, wrow])[order], np.concatenate([st, wt])[order]
    hpage, hoff = side_at(prefill[hrow], ht)
    htier_indptr = np.zeros(len(prefill) + 1, dtype=np.int64)
    np.cumsum(np.bincount(hrow, minlength=len(prefill)), out=htier_indptr[1:])
    # their refined pages: the newest refined_pages(nb0, K, every) of each row's body
    rrow_p, ridx_p = newest_pages(hb, geo.refine_pages, geo.refine_every) if geo.refine_pages else (hrow[:0], hrow[:0])
    prefine_indptr = np.zeros(len(prefill) + 1, dtype=np.int64)
    np.cumsum(np.bincount(rrow_p, minlength=len(prefill)), out=prefine_indptr[1:])
    return StepPlan(
        num_tokens=int(qs[-1]), decode_rows=decode, prefill_rows=prefill, query_start=qs, computed=c, lengths=lengths,
        slots=slots, body_before=nb0, body_after=nb1, dwrite_page=dpage, dwrite_off=doff, dwrite_tok=qs[decode],
        dslots=slots[decode], dbody_indptr=dbody_indptr.astype(np.int32), dbody_pos=dbody_pos,
        dbody_last=np.where(nb0[decode] > 0, p, 0).astype(np.int32), dtier=dtier,
        dtier_max=int(tpos.max(initial=0)), dbody_max=int(nb0[decode].max(initial=0)) * p,
        flush_pos=flush_pos, flush_from_side=at[stored], flush_side_page=spage, flush_side_off=soff,
        flush_from_call=at[~stored], flush_call_tok=call_tok, rwrite_sel=rsel, rwrite_slot=slots[rrow],
        rwrite_index=ri, pwrite_page=ppage, pwrite_off=poff,
        pwrite_tok=qs[prow] + pt - c[prow], pbody_indptr=pbody_indptr.astype(np.int32),
        pbody_pos=prefill[brow_p] * block_cols + geo.block_offset + bi_p,
        pbody_last=np.where(hb > 0, p, 0).astype(np.int32), pbody_max=int(hb.max(initial=0)) * p, htier_page=hpage,
        htier_off=hoff, htier_indptr=htier_indptr, prefine_index=ridx_p, prefine_slot=slots[prefill][rrow_p],
        prefine_indptr=prefine_indptr, pad=pad)
