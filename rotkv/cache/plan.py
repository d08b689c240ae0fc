"""The host-side page bookkeeping of a paged cache, and the plan of one forward call.

Every layer of a cache stores the same tokens at the same places, so one :class:`PageState`
(shared by all layers) holds, per row of the batch:

- the **tier** pages (bf16 sink + recent window) and how many tokens they hold;
- the **body** pages (quantized, always full: ``P`` tokens each);
- two free lists, one per pool.

Tier positions. The sink is laid out so that the window starts on a page boundary: sink token
``j`` sits at tier position ``pad + j`` with ``pad = (-S) % P``, the window's first token at
position ``pad + S`` (a multiple of ``P``). Positions ``[0, pad)`` are never read (the kernels
and gathers start at ``pad``). So a window page that leaves for the body is always one whole
tier page, and the tier of a row is a plain page list: ``kv_indptr``, ``kv_indices`` and
``kv_last_page_len`` describe it as they describe the body.

Once per forward call, :meth:`PageState.plan` turns the new tokens of every row (left padding:
the real tokens are a suffix of the call's positions) into :class:`Step` s, one per prefill chunk
(decode: one step). A step says where each new token is written, which pages the attention
reads, and which window pages leave for the body after it (the *flush*). Layers then execute
the steps on their own pools; nothing in a step depends on the layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from rotkv.config import window_at

_EMPTY = np.zeros(0, dtype=np.int64)


class FreeList:
    """Page ids ``0 .. capacity-1`` not in use; a stack that hands out low ids first."""

    def __init__(self, capacity: int = 0):
        self.capacity = 0
        self._stack = np.zeros(0, dtype=np.int64)
        self._top = 0
        self._saved = None  # (stack, top, capacity) at the checkpoint, and the entries free() overwrote since
        self._writes: list = []
        self.grow(capacity)

    def checkpoint(self) -> None:
        """Remember the list as it is, so that :meth:`restore` can undo what follows: work proportional to the
        pages handed out and back since, not to the capacity (a grown list keeps its old stack untouched)."""
        self._saved, self._writes = (self._stack, self._top, self.capacity), []

    def restore(self) -> None:
        """Back to the last :meth:`checkpoint` (once)."""
        if self._saved is None:
            return
        for arr, at, old in reversed(self._writes):
            arr[at: at + len(old)] = old
        (self._stack, self._top, self.capacity), self._saved, self._writes = self._saved, None, []

    def grow(self, capacity: int) -> None:
        """Add ids up to ``capacity`` (the pools must then be at least that large)."""
        if capacity <= self.capacity:
            return
        new = np.arange(capacity - 1, self.capacity - 1, -1, dtype=np.int64)  # high ids at the bottom
        stack = np.empty(capacity, dtype=np.int64)
        stack[: len(new)] = new
        stack[len(new): len(new) + self._top] = self._stack[: self._top]
        self._stack, self._top, self.capacity = stack, len(new) + self._top, capacity

    def alloc(self, n: int) -> np.ndarray:
        """``n`` page ids (grows the capacity by at least 25% when the stack runs out)."""
        if n > self._top:
            self.grow(max(self.capacity + n - self._top, (5 * self.capacity) // 4 + 16))
        self._top -= n
        return self._stack[self._top: self._top + n][::-1].copy()

    def free(self, pages: np.ndarray) -> None:
        pages = np.asarray(pages, dtype=np.int64)
        if len(pages):
            if self._saved is not None:
                self._writes.append((self._stack, self._top, self._stack[self._top: self._top + len(pages)].copy()))
            self._stack[self._top: self._top + len(pages)] = pages[::-1]
            self._top += len(pages)

    @property
    def free_count(self) -> int:
        return self._top

    @property
    def used(self) -> int:
        return self.capacity - self._top


@dataclass
class Flush:
    """Pages that leave the window for the body pages ``dst``.

    A decode step's flush moves whole tier pages: ``rows[i]``'s tier page ``src[i]`` becomes body
    page ``dst[i]``, the ``index[i]``-th page of that row's body (0-based; every flush sets ``rows``
    and ``index``, which the tiers use: ``rotkv.cache.tiers``). A prefill step's flush (``direct``) takes the leaving tokens from where they
    are: the flushed pages' tokens, in order (page ``i`` of ``dst`` is tokens ``i*P .. i*P+P-1``),
    are either stored tier tokens (``old_slots``, at ``old_at``) or the step's own new tokens
    (batch row ``new_rows``, call position ``new_pos``, at ``new_at``), which never enter the tier.
    """

    rows: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    old_slots: np.ndarray = field(default_factory=lambda: _EMPTY)
    old_at: np.ndarray = field(default_factory=lambda: _EMPTY)
    new_rows: np.ndarray = field(default_factory=lambda: _EMPTY)
    new_pos: np.ndarray = field(default_factory=lambda: _EMPTY)
    new_at: np.ndarray = field(default_factory=lambda: _EMPTY)
    direct: bool = False
    index: np.ndarray = field(default_factory=lambda: _EMPTY)

    def __len__(self) -> int:
        return len(self.dst)


@dataclass
class Step:
    """One chunk of a forward call (a decode call is one step).

    write: where the new tokens go, as flat arrays over the written tokens: batch row, position
    in the call (``[0, q)``), and tier slot (``page * P + offset``).
    query: ``[B, C]`` call positions of the chunk's queries per row and ``[B]`` how many are real.
    Tables (int64, host): ``tier_pages [B, Tmax]`` with ``tier_tokens [B]`` (tokens, the pad not
    counted) and ``body_pages [B, Nmax]`` with ``body_count [B]`` (full pages), as they are
    when the chunk attends (its own tokens written, the flush not yet done). ``tier_before [B]``:
    tier tokens before the chunk's own (the causal offset of its queries).
    """

    write_rows: np.ndarray
    write_pos: np.ndarray
    write_slots: np.ndarray
    query_pos: np.ndarray
    query_count: np.ndarray
    tier_pages: np.ndarray
    tier_tokens: np.ndarray
    tier_before: np.ndarray
    body_pages: np.ndarray
    body_count: np.ndarray
    flush: Flush
    decode: bool  # one new real token per row
    # a prefill step (every step that is not a decode step): the tier tables are the stored tier
    # before the step (``tier_tokens == tier_before``); the step's own tokens are read from the call
    # by its attention, then the flush and the write (of the own tokens that stay in the tier) run
    direct: bool = False

    def __post_init__(self):
        self._cache: dict = {}

    def cached(self, key, make):
        """A device tensor (or tuple) built once per step and shared by every layer."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def device_write(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(batch row, call position, tier slot) of every written token, int64 on ``device``."""
        return self.cached(("write", device), lambda: tuple(
            to_device(a, device) for a in (self.write_rows, self.write_pos, self.write_slots)))

    def device_query(self, device) -> torch.Tensor:
        """``[B, C]`` call positions of the step's queries (past a row's real queries: unused)."""
        return self.cached(("query", device), lambda: to_device(self.query_pos, device))

    def device_query_out(self, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(batch row, query index in the step, call position) of every real query of the step."""
        def make():
            rows, j = np.nonzero(np.arange(self.query_pos.shape[1])[None, :] < self.query_count[:, None])
            return to_device(rows, device), to_device(j, device), to_device(self.query_pos[rows, j], device)
        return self.cached(("query_out", device), make)

    def device_flush(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(tier pages, body pages) of a decode step's flush, int64 on ``device``."""
        return self.cached(("flush", device), lambda: (to_device(self.flush.src, device), to_device(self.flush.dst, device)))

    def device_flush_rows(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch row, index in that row's body) of every flushed page, int64 on ``device``."""
        return self.cached(("flush_rows", device), lambda: (to_device(self.flush.rows, device), to_device(self.flush.index, device)))

    def device_flush_tokens(self, device) -> tuple[torch.Tensor, ...]:
        """A prefill step's flush on ``device``: (old_slots, old_at, new_rows, new_pos, new_at, dst)."""
        f = self.flush
        return self.cached(("flush_tokens", device), lambda: tuple(
            to_device(a, device) for a in (f.old_slots, f.old_at, f.new_rows, f.new_pos, f.new_at, f.dst)))

    def device_tables(self, device, state: "PageState") -> "Tables":
        """The page tables of the body and the tier (int32, flashinfer's vocabulary) on ``device``."""
        return self.cached(("tables", device), lambda: state.tables(self, device))


@dataclass
class Tables:
    """``body``/``tier``: ``(kv_indptr, kv_indices, kv_last_page_len)``; ``*_max``: the longest
    row's token count (tier: in positions, the pad included), which sizes the kernel's grid."""

    body: tuple
    body_max: int
    tier: tuple
    tier_max: int


def to_device(a: np.ndarray, device) -> torch.Tensor:
    """A host array on ``device`` without a stream sync (a blocking host-to-device copy would drain the GPU's
    queue between the kernels of a forward)."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)


class PageState:
    """Page lists, token counts and free lists of one batch, shared by every layer of a cache."""

    def __init__(self, sink: int, window: int, page_size: int, quantized: bool, chunk: int, window_share: float = 0.0):
        self.sink, self.window, self.page, self.quantized, self.chunk = sink, window, page_size, quantized, chunk
        self.window_share = window_share
        self.pad = (-sink) % page_size
        self.sink_pages = (self.pad + sink) // page_size
        self.tier_free, self.body_free = FreeList(), FreeList()
        self.reset(0)

    @classmethod
    def from_spec(cls, spec) -> "PageState":
        """The page state of a cache of ``spec`` (a CacheSpec)."""
        return cls(spec.sink, spec.window, spec.page_size, spec.quantized, spec.prefill_chunk, spec.window_share)

    def windows(self, tokens):
        """The window of each row holding ``tokens [B]`` tokens (``CacheSpec.window_share``); an int for an int."""
        return window_at(self.window, self.window_share, tokens)

    def tier_pages_for(self, max_len: int) -> int:
        """Tier pages a row needs at most, up to ``max_len`` tokens: the sink's, the largest window's
        and the page it fills before it leaves (quantized), or every token's (unquantized)."""
        p = self.page
        if not self.quantized:
            return -(-(self.pad + max_len) // p)
        return self.sink_pages + -(-(self.windows(max_len) + p) // p) + 1

    def reset(self, rows: int) -> None:
        self.rows = rows
        self.tier_tokens = np.zeros(rows, dtype=np.int64)
        self.body_count = np.zeros(rows, dtype=np.int64)
        self.tier_pages = np.zeros((rows, 4), dtype=np.int64)
        self.body_pages = np.zeros((rows, 4), dtype=np.int64)
        self.tier_free, self.body_free = FreeList(self.tier_free.capacity), FreeList(self.body_free.capacity)
        self.seen = 0  # positions the model has sent, pads included (transformers' sequence length)
        self.plan_steps: list[Step] = []
        self._attended: set = {None}  # layers that ran the current plan ({None}: no plan yet)
        self._undo = None
        self.broken = False

    def steps_for(self, layer: int, q: int, counts: np.ndarray) -> list[Step]:
        """The current call's steps: planned by the first layer that attends, reused by the others."""
        if layer in self._attended or None in self._attended:
            self.plan(q, counts)
            self._attended = set()
        self._attended.add(layer)
        return self.plan_steps

    def tables(self, step: Step, device) -> Tables:
        (body, body_max), (tier, tier_max) = self.host_tables(step)
        dev = lambda t: tuple(torch.from_numpy(a).to(device, non_blocking=True) for a in t)  # noqa: E731
        return Tables(dev(body), body_max, dev(tier), tier_max)

    def host_tables(self, step: Step) -> tuple[tuple[tuple, int], tuple[tuple, int]]:
        """The step's ``((body table, body max), (tier table, tier max))`` as int32 numpy arrays (:class:`Tables`)."""
        p = self.page
        bc = step.body_count
        body = page_table_host(step.body_pages, bc, np.where(bc > 0, p, 0))
        used = self.tier_used_pages(step.tier_tokens)
        tpos = np.where(step.tier_tokens > 0, self.pad + step.tier_tokens, 0)
        tier = page_table_host(step.tier_pages, used, tpos - np.maximum(used - 1, 0) * p)
        return (body, int(bc.max(initial=0)) * p), (tier, int(tpos.max(initial=0)))

    # ---- per-row quantities -------------------------------------------------------------------
    def tier_used_pages(self, tokens: np.ndarray | None = None) -> np.ndarray:
        t = self.tier_tokens if tokens is None else tokens
        return np.where(t > 0, -(-(self.pad + t) // self.page), 0)

    def lengths(self) -> np.ndarray:
        """Stored tokens of every row."""
        return self.tier_tokens + self.body_count * self.page

    def sink_tokens(self) -> np.ndarray:
        return np.minimum(self.tier_tokens, self.sink)

    # ---- growth of the host arrays --------------------------------------------------------------
    @staticmethod
    def _widen(a: np.ndarray, cols: int) -> np.ndarray:
        if cols <= a.shape[1]:
            return a
        out = np.zeros((a.shape[0], max(cols, a.shape[1] * 5 // 4 + 4)), dtype=a.dtype)
        out[:, : a.shape[1]] = a
        return out

    # ---- planning -------------------------------------------------------------------------------
    def plan(self, q: int, counts: np.ndarray) -> list[Step]:
        """Plan a forward call of ``q`` positions whose last ``counts[b]`` are real; commits the
        page bookkeeping (undo with :meth:`rollback` if the call fails before it stores anything)."""
        if self.broken:
            raise RuntimeError("a previous call failed after some layers had stored its tokens; reset the cache "
                               "(cache.reset()) before using it again")
        counts = np.asarray(counts, dtype=np.int64)
        if len(counts) != self.rows:
            raise ValueError(f"batch size changed from {self.rows} to {len(counts)} without reordering the cache")
        self._undo_q = q
        # the arrays as they are (a plan replaces them, or writes only past each row's pages and tokens,
        # which the restored counts do not read), and the free lists' checkpoints: no copy of either
        self._undo = (self.tier_tokens, self.body_count, self.tier_pages, self.body_pages)
        self.tier_free.checkpoint()
        self.body_free.checkpoint()
        steps = []
        c = self.chunk
        n_steps = max(1, -(-int(counts.max(initial=0)) // c))
        first = q - counts  # call position of each row's first real token
        decode = q == 1 and bool((counts == 1).all())
        for k in range(n_steps):
            n = np.clip(counts - k * c, 0, c)
            steps.append(self._step(first + k * c, n, q, decode=True) if decode else self._prefill_step(first + k * c, n, q))
        self.seen += q
        self.plan_steps = steps
        return steps

    def rollback(self) -> None:
        """Undo the last :meth:`plan`. Exact when no layer has run the plan yet (the first layer
        refuses its states); otherwise earlier layers may have written reused pages, and the
        cache refuses further calls until it is reset."""
        if self._undo is None:
            return
        if len(self._attended) > 1:
            self.broken = True
        (self.tier_tokens, self.body_count, self.tier_pages, self.body_pages) = self._undo
        self.tier_free.restore()
        self.body_free.restore()
        self._undo, self._attended, self.plan_steps = None, {None}, []
        self.seen -= self._undo_q

    def _step(self, start: np.ndarray, n: np.ndarray, q: int, decode: bool) -> Step:
        p, pad = self.page, self.pad
        before = self.tier_tokens.copy()
        used = self.tier_used_pages()
        after = before + n
        need = self.tier_used_pages(after)
        self.tier_pages = self._widen(self.tier_pages, int(need.max(initial=0)))
        grow = need - used
        total = int(grow.sum())
        if total:
            ids = self.tier_free.alloc(total)
            rows = np.repeat(np.arange(self.rows), grow)
            offs = np.arange(total) - np.repeat(np.cumsum(grow) - grow, grow)
            self.tier_pages[rows, np.repeat(used, grow) + offs] = ids
        # the new tokens' slots
        rows = np.repeat(np.arange(self.rows), n)
        j = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        tpos = pad + before[rows] + j
        slots = self.tier_pages[rows, tpos // p] * p + tpos % p
        self.tier_tokens = after
        cmax = int(n.max(initial=0))
        qpos = np.minimum(start[:, None] + np.arange(max(cmax, 1))[None, :], q - 1)  # past a row's end: unused
        # the tables as they are (no copy): the flush replaces the tier's and writes the body's past each
        # row's count, which the step does not read
        step = Step(rows, start[rows] + j, slots, qpos, n.copy(), self.tier_pages, after.copy(), before,
                    self.body_pages, self.body_count.copy(), self._flush(), decode)
        return step

    def _prefill_step(self, start: np.ndarray, n: np.ndarray, q: int) -> Step:
        """A prefill step of ``n[b]`` new tokens per row (call positions ``start[b] + j``).

        Planned with the flush folded in: the tokens that leave the window at the end of the step
        go from where they are (the stored tier, or the call) straight to the body, and only the
        new tokens that stay (sink, the new window) get tier slots. So the tier pool needs room for
        sink + window + one page per row, not for the chunk: the chunk is held once, by the layer
        that runs, in the call's own key and value tensors.
        """
        p, pad, sink, rows = self.page, self.pad, self.sink, self.rows
        before = self.tier_tokens.copy()
        old_pages, body_pages, body_count = self.tier_pages.copy(), self.body_pages.copy(), self.body_count.copy()
        after = before + n
        if self.quantized:
            win = after - np.minimum(after, sink)
            w = self.windows(self.body_count * p + after)
            k = np.where(win >= w + p, (win - w) // p, 0)
        else:
            k = np.zeros(rows, dtype=np.int64)
        # the flush: body pages for tokens sink .. sink + k*P - 1 of every row
        total = int(k.sum())
        flush = Flush(_EMPTY, _EMPTY, _EMPTY, direct=True)
        if total:
            dst = self.body_free.alloc(total)
            frow = np.repeat(np.arange(rows), k)
            foff = np.arange(total) - np.repeat(np.cumsum(k) - k, k)
            self.body_pages = self._widen(self.body_pages, int((self.body_count + k).max()))
            self.body_pages[frow, self.body_count[frow] + foff] = dst
            self.body_count = self.body_count + k
            kt = k * p
            trow = np.repeat(np.arange(rows), kt)
            t = sink + np.arange(total * p) - np.repeat(np.cumsum(kt) - kt, kt)  # tier index of each leaving token
            at = np.arange(total * p)
            old = t < before[trow]
            tpos = pad + t[old]
            flush = Flush(frow, _EMPTY, dst, old_pages[trow[old], tpos // p] * p + tpos % p, at[old],
                          trow[~old], start[trow[~old]] + t[~old] - before[trow[~old]], at[~old], direct=True,
                          index=body_count[frow] + foff)
        # the tier after the step: sink pages, the stored window pages that stay (moved up by the
        # flushed ones, which are freed), new pages for the rest
        used_old = self.tier_used_pages(before)
        old_window = np.maximum(used_old - self.sink_pages, 0)
        gone = np.minimum(k, old_window)
        grow = np.repeat(np.arange(rows), gone)
        self.tier_free.free(old_pages[grow, self.sink_pages + np.arange(int(gone.sum())) - np.repeat(np.cumsum(gone) - gone, gone)])
        final = after - k * p
        need = self.tier_used_pages(final)
        width = max(int(need.max(initial=0)), 1)
        col = np.arange(width)[None, :]
        src_col = np.where(col < self.sink_pages, col, col + k[:, None])
        keep = (src_col < used_old[:, None]) & (col < need[:, None])
        fresh = ~keep & (col < need[:, None])
        pages = np.zeros((rows, max(width, self.tier_pages.shape[1])), dtype=np.int64)
        wide = self._widen(old_pages, int(src_col.max(initial=0)) + 1)
        pages[:, :width] = np.where(keep, np.take_along_axis(wide, src_col, 1), 0)
        nfresh = int(fresh.sum())
        if nfresh:
            r, c = np.nonzero(fresh)
            pages[r, c] = self.tier_free.alloc(nfresh)
        self.tier_pages, self.tier_tokens = pages, final
        # the new tokens that stay: slots at their place after the flush
        wrow = np.repeat(np.arange(rows), n)
        j = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        t = before[wrow] + j
        stay = (t < sink) | (t >= sink + k[wrow] * p)
        wrow, j, t = wrow[stay], j[stay], t[stay]
        tpos = pad + np.where(t < sink, t, t - k[wrow] * p)
        slots = pages[wrow, tpos // p] * p + tpos % p
        cmax = int(n.max(initial=0))
        qpos = np.minimum(start[:, None] + np.arange(max(cmax, 1))[None, :], q - 1)  # past a row's end: unused
        return Step(wrow, start[wrow] + j, slots, qpos, n.copy(), old_pages, before, before, body_pages, body_count,
                    flush, decode=False, direct=True)

    def _flush(self) -> Flush:
        """Whole window pages beyond ``window + page - 1`` tokens leave for the body."""
        empty = np.zeros(0, dtype=np.int64)
        if not self.quantized:
            return Flush(empty, empty, empty)
        p = self.page
        win = self.tier_tokens - np.minimum(self.tier_tokens, self.sink)
        w = self.windows(self.body_count * p + self.tier_tokens)
        k = np.where(win >= w + p, (win - w) // p, 0)
        total = int(k.sum())
        if not total:
            return Flush(empty, empty, empty)
        rows = np.repeat(np.arange(self.rows), k)
        offs = np.arange(total) - np.repeat(np.cumsum(k) - k, k)
        src = self.tier_pages[rows, self.sink_pages + offs]
        dst = self.body_free.alloc(total)
        self.body_pages = self._widen(self.body_pages, int((self.body_count + k).max()))
        index = np.repeat(self.body_count, k) + offs
        self.body_pages[rows, index] = dst
        self.body_count = self.body_count + k
        # the rows' remaining tier pages move up by k places
        width = self.tier_pages.shape[1]
        col = np.arange(width)[None, :]
        keep = col < self.sink_pages
        srcc = np.where(keep, col, col + k[:, None])
        self.tier_pages = np.take_along_axis(self.tier_pages, np.minimum(srcc, width - 1), 1)
        self.tier_tokens = self.tier_tokens - k * p
        # a flushed page is free for the next step's tokens: every layer runs a step's flush (which
        # reads the page) before the next step's write, so a long prefill needs only one chunk of tier
        self.tier_free.free(src)
        return Flush(rows, src, dst, index=index)

    # ---- continuous batching: a row's pages freed, another state's row taken in --------------------
    def release(self, rows) -> None:
        """Free every page of ``rows`` and empty them (0 tokens); the batch keeps its size, so a
        captured decode step still covers them. The next call writes such a row's first token."""
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        if len(rows) and (rows.min() < 0 or rows.max() >= self.rows):
            raise ValueError(f"row index out of range for a batch of {self.rows}: {rows.tolist()}")
        self._undo = None  # the last call is done: nothing to roll back across an edit of the rows
        used_t = self.tier_used_pages()
        for r in rows:
            self.tier_free.free(self.tier_pages[r, : int(used_t[r])])
            self.body_free.free(self.body_pages[r, : int(self.body_count[r])])
        self.tier_tokens[rows] = 0
        self.body_count[rows] = 0
        self.tier_pages[rows] = 0
        self.body_pages[rows] = 0

    def busy_rows(self, rows) -> list[int]:
        """Those of ``rows`` that hold tokens (a row takes a request only when empty)."""
        return [r for r in rows if self.tier_tokens[r] or self.body_count[r]]

    def adopt(self, row: int, src: "PageState", src_row: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Make the empty ``row`` hold ``src``'s row ``src_row`` (a request prefilled in a cache of its
        own, same sink, window and page size): pages from this state's free lists, the same token
        counts. Returns ``(tier_src, tier_dst, body_src, body_dst)``: the page ids each layer copies
        from ``src``'s pools into this state's (:meth:`rotkv.cache.pools.LayerPools.copy_from`)."""
        if (src.sink, src.window, src.page, src.quantized) != (self.sink, self.window, self.page, self.quantized):
            raise ValueError("adopt needs a state of the same sink, window, page size and quantization")
        if self.busy_rows([row]):
            raise ValueError(f"row {row} holds tokens: release it first")
        self._undo = None
        nt = int(src.tier_used_pages()[src_row])
        nb = int(src.body_count[src_row])
        tier_src, body_src = src.tier_pages[src_row, :nt].copy(), src.body_pages[src_row, :nb].copy()
        tier_dst, body_dst = self.tier_free.alloc(nt), self.body_free.alloc(nb)
        self.tier_pages = self._widen(self.tier_pages, nt)
        self.body_pages = self._widen(self.body_pages, nb)
        self.tier_pages[row, :nt], self.body_pages[row, :nb] = tier_dst, body_dst
        self.tier_tokens[row], self.body_count[row] = src.tier_tokens[src_row], nb
        return tier_src, tier_dst, body_src, body_dst

    # ---- batch edits (beam search, row removal) ---------------------------------------------------
    def select_rows(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Keep rows ``index`` (in that order; a row may repeat). Returns the page copies the pools
        must make, ``(tier_src, tier_dst, body_src, body_dst)``: a repeated row gets its own copies, so
        rows never share pages. Pages of dropped rows go back to the free lists."""
        index = np.asarray(index, dtype=np.int64)
        if len(index) and (index.min() < 0 or index.max() >= self.rows):
            raise ValueError(f"row index out of range for a batch of {self.rows}: {index.tolist()}")
        seen = np.zeros(self.rows, dtype=bool)
        tier_cp, body_cp = ([], []), ([], [])
        tiers, bodies = self.tier_pages.copy(), self.body_pages.copy()
        new_tier = np.zeros((len(index), tiers.shape[1]), dtype=np.int64)
        new_body = np.zeros((len(index), bodies.shape[1]), dtype=np.int64)
        used_t, used_b = self.tier_used_pages(), self.body_count
        for out, i in enumerate(index):
            nt, nb = int(used_t[i]), int(used_b[i])
            if seen[i]:
                t_new, b_new = self.tier_free.alloc(nt), self.body_free.alloc(nb)
                tier_cp[0].append(tiers[i, :nt]), tier_cp[1].append(t_new)
                body_cp[0].append(bodies[i, :nb]), body_cp[1].append(b_new)
                new_tier[out, :nt], new_body[out, :nb] = t_new, b_new
            else:
                new_tier[out], new_body[out] = tiers[i], bodies[i]
            seen[i] = True
        for i in np.nonzero(~seen)[0]:
            self.tier_free.free(tiers[i, : int(used_t[i])])
            self.body_free.free(bodies[i, : int(used_b[i])])
        self.tier_tokens, self.body_count = self.tier_tokens[index], self.body_count[index]
        self.tier_pages, self.body_pages, self.rows = new_tier, new_body, len(index)
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)  # noqa: E731
        return cat(tier_cp[0]), cat(tier_cp[1]), cat(body_cp[0]), cat(body_cp[1])


def page_table_host(pages: np.ndarray, counts: np.ndarray, last: np.ndarray) -> tuple[np.ndarray, ...]:
    """``kv_indptr [B+1]``, ``kv_indices``, ``kv_last_page_len [B]`` (int32 numpy) of the first
    ``counts[b]`` pages of every row of ``pages [B, N]``."""
    width = pages.shape[1]
    indptr = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=indptr[1:])
    if width <= 64:  # a mask over the table
        indices = pages[np.arange(width)[None, :] < counts[:, None]].astype(np.int32)
    else:  # long rows (a large batch's body): one slice copy per row, no pass over the whole table
        indices = np.empty(int(indptr[-1]), dtype=np.int32)
        for row, (a, b) in enumerate(zip(indptr[:-1].tolist(), indptr[1:].tolist())):
            indices[a:b] = pages[row, : b - a]
    if not len(indices):
        indices = np.zeros(1, dtype=np.int32)
    return indptr, indices, np.ascontiguousarray(last, dtype=np.int32)


def page_table(pages: np.ndarray, counts: np.ndarray, last: np.ndarray, device) -> tuple[torch.Tensor, ...]:
    """:func:`page_table_host` on ``device``."""
    return tuple(torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)
                 for a in page_table_host(pages, counts, last))
