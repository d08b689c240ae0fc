"""The refine tier: 2 more bits for the keys of every row's newest body pages (``CacheSpec.refine_tokens``).

Why. The INT2 error of long contexts concentrates in the keys of the recent body, the tokens just out
of the bf16 window (docs/results/diagnosis_length.md); a 4-bit grid there does most of what a wider
bf16 window does, at a fraction of its bytes.

Format. A 2-bit key element of the body reads ``lo + s * h`` (``h`` its code 0..3, ``s`` and ``lo`` its
group's scale and minimum). For the ``K = ceil(refine_tokens / P)`` newest body pages of a row, the
refine tier stores 2 more bits ``j`` per key element, and the element reads
``lo + s * (h + (j - 1.5) / 4)``: the four points that split ``h``'s bucket ``[h - 1/2, h + 1/2]`` in
quarters, a 4-bit grid of step ``s / 4`` nested in the 2-bit one. ``j`` is chosen from the exact key
when its page is written; a clipped element moves at most ``3/8 s`` towards its value. The body's
codes and metadata are not touched, so when a page is no longer among its row's K newest it reads as
the 2-bit page it always was: nothing is re-quantized and nothing moves.

Storage: ``uint8 [rows, K, H, P, D / 4]`` per layer, a ring per row: the row's ``i``-th body page
(0-based) keeps its bits in slot ``i % K``, which the page ``K`` places later overwrites. No metadata
of its own: 2 bits per key element of the refined pages, counted in the cache's measured bits. ``K``
grows with the rows, up to ``ceil(refine_tokens / P)``: it is the most refined pages any row reads
(:meth:`RefineRing.grow`, before each flush), so the ring holds what is counted, not the cap.

Size rule (``CacheSpec.refine_every``): a row of ``n`` body pages reads its ``min(K, ceil(n / every))``
newest pages refined, so that at short contexts the tier is a share of the body (its cost in bits per
element constant) and at long ones ``K`` pages. Every page is refined when it is written (it is one of
its row's K newest then), so a row whose share grows finds its older pages' bits in the ring.

With ``CacheSpec.refine_values`` the values get a ring of their own, the same way. Read by the PyTorch
paths (dense decode, prefill history, :meth:`HybridLayer.read`) and by the Triton v1 decode kernel
(``rotkv.kernels.decode``: a second key, or value, of scale ``s / 4`` and minimum ``-3/8 s`` for the refined
pages; on by default, ``ROTKV_TUNING=refine_kernel=0`` turns it off); the CUDA-graph decoder captures a refined
cache too (its flush graph writes the ring).

The tier seam (:mod:`rotkv.cache.tiers`): :class:`RefineRings` is one layer's tier, the hooks the pools, the
layer, the cache and its CUDA graph call on every tier; everything they need of the refine tier is here. Its
kernel parts sit beside the kernels: the ring as the kernels read it (``rotkv.kernels.body.RefineTier``), the
decode kernel's read, its PyTorch reference (``rotkv.kernels.reference.refine_dense``) and the split of a call
(``rotkv.kernels.refine_split``); the arithmetic of the nested grid is ``rotkv.quant.refine``.
"""

from __future__ import annotations

import numpy as np
import torch

from rotkv.cache.codecs import TokenCodec
from rotkv.cache.plan import to_device
from rotkv.kernels.body import RefineTier
from rotkv.quant.packing import pack, unpack
from rotkv.quant.refine import refine_codes, refine_delta, refined_pages


def newest_pages(counts: np.ndarray, k: int, every: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(row, body index) of the refined pages of every row ``b`` of ``counts[b]`` body pages, its
    ``refined_pages(counts[b], k, every)`` newest, flat."""
    m = refined_pages(np.asarray(counts, dtype=np.int64), k, every)
    rows = np.repeat(np.arange(len(m)), m)
    idx = np.repeat(np.asarray(counts, dtype=np.int64) - m, m) + (np.arange(int(m.sum())) - np.repeat(np.cumsum(m) - m, m))
    return rows, idx


def ring_writes(rows: np.ndarray, index: np.ndarray, k: int) -> np.ndarray | None:
    """The flushed pages (``rows[i]``'s ``index[i]``-th body page) that a K-slot ring keeps: each row's
    ``k`` newest of the flush, as positions into the flush, or None when that is all of them. A prefill
    flushes many pages of a row at once; the older ones would share slots with the newer and be
    overwritten in an undefined order."""
    rows, index = np.asarray(rows, dtype=np.int64), np.asarray(index, dtype=np.int64)
    if not len(rows):
        return None
    newest = np.full(int(rows.max()) + 1, -1, dtype=np.int64)
    np.maximum.at(newest, rows, index)
    keep = index > newest[rows] - k
    return None if keep.all() else np.flatnonzero(keep)


class RefineRing:
    """One layer's refine tier: ``data uint8 [rows, K, H, P, D / 4]``; see the module docstring."""

    def __init__(self, pages: int, kv_heads: int, page: int, head_dim: int, group_size: int, device, every: int = 0):
        if pages < 1:
            raise ValueError(f"a refine ring needs >= 1 page per row but got {pages}")
        if every < 0:
            raise ValueError(f"a refine ring's size rule needs every >= 0 but got {every}")
        # cap: the most refined pages of a row (refine_tokens / P); pages: the slots now (K), which grow to it
        self.cap, self.pages, self.group_size, self.every = pages, 1, group_size, every
        self.shape = (1, kv_heads, page, head_dim // 4)
        self.data = torch.zeros(0, *self.shape, dtype=torch.uint8, device=device)

    def grow(self, counts: np.ndarray, upto: int) -> None:
        """Make the slots hold the refined pages of a row of ``upto`` body pages: ``K`` grows to
        ``refined_pages(upto, cap, every)`` when that is more, and every row's refined pages (rows of
        ``counts`` body pages now) move to their new slots ``i % K``. Before a flush that takes a row to
        ``upto`` pages; a CUDA graph's rings are grown to its longest row before capture."""
        need = refined_pages(upto, self.cap, self.every)
        if need <= self.pages:
            return
        old, k_old = self.data, self.pages
        self.pages, self.shape = need, (need, *self.shape[1:])
        self.data = torch.zeros(old.shape[0], *self.shape, dtype=torch.uint8, device=old.device)
        rows, idx = newest_pages(np.asarray(counts, dtype=np.int64)[: old.shape[0]], k_old)
        if len(rows):
            r, i = to_device(rows, old.device), to_device(idx, old.device)
            self.data[r, i % need] = old[r, i % k_old]

    @property
    def page_bytes(self) -> int:
        """Bytes of one refined page (every KV head)."""
        return int(np.prod(self.shape[1:]))

    def fit(self, rows: int) -> None:
        """Hold ``rows`` rings (a new batch: the old contents are not read again, and the slots start at one)."""
        if self.data.shape[0] != rows:
            self.pages, self.shape = 1, (1, *self.shape[1:])
            self.data = torch.zeros(rows, *self.shape, dtype=torch.uint8, device=self.data.device)

    def select(self, index: torch.Tensor) -> None:
        """Rows become ``index`` (beam search, row removal): each row takes its source row's ring."""
        self.data = self.data[index.to(self.data.device)]

    def stored_bytes(self, counts: np.ndarray) -> int:
        """The bytes of the refinements read now: the refined pages of every row (:func:`newest_pages`)."""
        return int(refined_pages(np.asarray(counts, dtype=np.int64), self.pages, self.every).sum()) * self.page_bytes

    def write(self, x: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
              index: torch.Tensor) -> None:
        """Refine the body pages just written: exact keys ``x [n, H, P, D]``, their 2-bit reading ``base``
        and scales ``scale [n, H, P, D / G]``; page ``i`` is the ``index[i]``-th of row ``rows[i]``.
        No two pages may share a slot unless they are the same page (:func:`ring_writes` picks them):
        which of two writes to one element lands is undefined on the GPU."""
        j = refine_codes(x, base, scale, self.group_size)
        self.data[rows, index % self.pages] = pack(j, 2)

    def add(self, k: torch.Tensor, nb: int, rows: torch.Tensor, local: torch.Tensor, index: torch.Tensor,
            scale: torch.Tensor, start: int = 0) -> None:
        """Add the refinements to the dequantized keys of ``nb`` body pages per row, ``k [b, H, >= nb * P, D]``
        (in place), which hold the body pages from index ``start`` on: page ``index[i]`` of local row
        ``local[i]`` (batch row ``rows[i]``), whose scales are ``scale [n, H, P, D / G]``."""
        if not len(index):
            return
        b, h, _, d = k.shape
        p = self.shape[2]
        view = k[:, :, : nb * p].view(b, h, nb, p, d)
        delta = refine_delta(unpack(self.data[rows, index % self.pages], 2), scale, self.group_size)
        view[local, :, index - start] += delta.to(k.dtype)


class RefineRings:
    """One layer's refine tier (a tier of :mod:`rotkv.cache.tiers`): the ring of the keys, and with
    ``refine_values`` the ring of the values, of its 2-bit token-codec sides (4-bit keys have none)."""

    label = "the refine tier (`refine_tokens`)"
    # names the pools answer for the tier (rotkv.cache.tiers.published): its attribute, and the value of a
    # layer without the tier
    PUBLISHED = {"refine": ("keys", None), "refine_v": ("values", None), "refine_rings": ("rings", ()),
                 "refine_pages": ("pages", 0), "refine_every": ("every", 0)}

    def __init__(self, keys: RefineRing | None, values: RefineRing | None):
        self.keys, self.values = keys, values

    @classmethod
    def build(cls, spec, codecs, kv_heads: int, page: int, head_dim: int, device) -> "RefineRings | None":
        """The tier of a layer of ``spec`` whose (key, value) codecs are ``codecs``, or None: no
        ``refine_tokens``, or no 2-bit token-codec side to refine."""
        pages = -(-spec.refine_tokens // page)
        two = lambda c: isinstance(c, TokenCodec) and c.bits == 2  # noqa: E731
        kc, vc = codecs
        ring = lambda c: RefineRing(pages, kv_heads, page, head_dim, c.group_size, device, spec.refine_every)  # noqa: E731
        keys = ring(kc) if pages > 0 and two(kc) else None
        values = ring(vc) if pages > 0 and spec.refine_values and two(vc) else None
        return cls(keys, values) if keys is not None or values is not None else None

    @staticmethod
    def graph_flags(spec) -> dict:
        """What the kernel plan's CUDA-graph check needs to know (``rotkv.kernels.plan.check_graph``)."""
        return {"refine": bool(spec.refine_tokens)}

    # ---- pages and bytes -----------------------------------------------------------------------
    @property
    def rings(self) -> list[RefineRing]:
        """The rings the layer has (keys, then values)."""
        return [r for r in (self.keys, self.values) if r is not None]

    @property
    def pages(self) -> int:
        """Slots per row of the rings now, the most refined pages any row reads."""
        return self.rings[0].pages

    @property
    def every(self) -> int:
        """The size rule: one refined page per this many body pages (0: ``pages``)."""
        return self.rings[0].every

    def fit(self, rows: int) -> None:
        """Hold ``rows`` rows (a new batch)."""
        for ring in self.rings:
            ring.fit(rows)

    def nbytes(self) -> int:
        """Bytes the rings hold."""
        return sum(r.data.numel() * r.data.element_size() for r in self.rings)

    def stored_bytes(self, counts: np.ndarray) -> int:
        """Bytes of the refinements read now by rows of ``counts`` body pages."""
        return sum(r.stored_bytes(counts) for r in self.rings)

    def grow(self, counts, upto: int) -> None:
        """Make room for a row of ``upto`` body pages (rows of ``counts`` pages now; :meth:`RefineRing.grow`)."""
        for ring in self.rings:
            ring.grow(counts, upto)

    # ---- rows ------------------------------------------------------------------------------------
    def select(self, index: torch.Tensor) -> None:
        """Rows become ``index`` (beam search, row removal): each row takes its source row's rings."""
        for ring in self.rings:
            ring.select(index)

    def adopt(self, src: "RefineRings", moves) -> None:
        """Give rows the refinements of ``src``'s rows: ``moves``, in order, are ``(row, src_row, counts,
        body_pages)``, ``row`` (rows of ``counts`` body pages before it) taking ``src_row``, a row of
        ``body_pages`` body pages. The rings grow for each in turn; then each page ``src`` holds (its
        newest, up to what the size rule reads there) moves from its slot there to its slot here
        (``index % K``), every row's at once. Only those: ``src`` may hold more slots than such a row
        reads (its other rows longer)."""
        for _, _, counts, body_pages in moves:
            self.grow(counts, body_pages)
        for mine, theirs in zip(self.rings, src.rings):
            dst, got = [], []
            for row, src_row, _, body_pages in moves:
                held = refined_pages(body_pages, theirs.pages, theirs.every)
                if not held:
                    continue
                if mine.pages < held:
                    raise ValueError(f"the refine ring holds {mine.pages} pages per row, the adopted row {held}")
                idx = np.arange(body_pages - held, body_pages)
                dst.append(np.stack([np.full(held, row), idx % mine.pages]))
                got.append(np.stack([np.full(held, src_row), idx % theirs.pages]))
            if dst:
                d = to_device(np.concatenate(dst, 1), mine.data.device)
                g = to_device(np.concatenate(got, 1), theirs.data.device)
                mine.data[d[0], d[1]] = theirs.data[g[0], g[1]].to(mine.data.device)

    # ---- write -----------------------------------------------------------------------------------
    def observe(self, query, keys, real, scaling, rotation) -> None:
        """The newest pages need no look at the queries."""

    def flush_target(self, pages, device) -> tuple:
        """Where a flush's pages go in the rings: ``(rows, index, sel)``, the batch row and body index of the
        pages the rings keep and their positions ``sel`` in the flush (None: all, in order). ``pages``: the
        layer's :class:`~rotkv.cache.plan.Step` (the rings grow for its flush first, and what is derived from
        its flush is kept once per step for every layer: :func:`ring_writes`), or ``(rows, index)`` device
        tensors of a flush that writes at most one page per row (the CUDA-graph decoder's; grown before capture)."""
        if pages is None:
            raise ValueError("a flush into pools with a refine tier needs the pages' rows and body indices")
        if isinstance(pages, tuple):
            return (*pages, None)
        step = pages
        # the rings grow (before the write) to hold the refined pages of the longest row after the flush
        self.grow(step.body_count, int(step.flush.index.max()) + 1)
        k = self.pages

        def make():
            f = step.flush
            sel = ring_writes(f.rows, f.index, k)
            rows, index = (f.rows, f.index) if sel is None else (f.rows[sel], f.index[sel])
            return to_device(rows, device), to_device(index, device), None if sel is None else to_device(sel, device)
        return step.cached(("refine_at", device, k), make)

    def write(self, side: int, x: torch.Tensor, dst: torch.Tensor, stored: dict | None, parts: dict, codec,
              target: tuple) -> None:
        """Refine the body pages ``dst`` of side ``side`` (0 keys, 1 values) just written from the exact pages
        ``x [n, H, P, D]``: ``stored``, their encoded parts where the flush has them (None: written by a kernel,
        read back from the body's ``parts``); ``target`` from :meth:`flush_target`."""
        ring = (self.keys, self.values)[side]
        if ring is None:
            return
        rows, index, sel = target
        if sel is not None:
            x = x[sel]
        if stored is None:
            stored = {name: t[dst if sel is None else dst[sel]] for name, t in parts.items()}
        elif sel is not None:
            stored = {name: t[sel] for name, t in stored.items()}
        ring.write(x, codec.decode(stored), stored["scale"], rows, index)

    # ---- read ------------------------------------------------------------------------------------
    def read(self, k: torch.Tensor | None, v: torch.Tensor | None, nb: int, counts: np.ndarray, pages: np.ndarray,
             r0: int, body: tuple, start: int = 0, memo=None) -> None:
        """Add the refinements to dequantized body keys and values ``[b, H, >= nb * P, D]`` in place (None: that
        side is not read), which hold body pages ``start .. start + nb - 1`` of the rows ``r0 .. r0 + b - 1``
        (``counts [b]`` body pages each, their ids ``pages [b, N]`` on the host). ``body``: the pools' parts
        (keys, values), whose scales the refinement reads. ``memo(key, make)``: a per-step store shared by the
        layers (``Step.cached``) for the refined pages' indices; None computes them."""
        sides = [(t, ring, parts) for t, ring, parts in zip((k, v), (self.keys, self.values), body)
                 if t is not None and ring is not None]
        if not sides:
            return
        device = sides[0][0].device

        def make():
            rows, idx = newest_pages(counts, self.pages, self.every)
            return to_device(rows + r0, device), to_device(rows, device), to_device(idx, device), to_device(pages[rows, idx], device)
        key = ("refined", device, r0, r0 + len(counts), self.pages, self.every)
        rows, local, idx, ids = memo(key, make) if memo is not None else make()
        if start or nb < int(np.max(counts, initial=0)):  # the pages of this chunk only
            sel = (idx >= start) & (idx < start + nb)
            rows, local, idx, ids = rows[sel], local[sel], idx[sel], ids[sel]
        for t, ring, parts in sides:
            ring.add(t, nb, rows, local, idx, parts["scale"][ids], start)

    # ---- the kernels -----------------------------------------------------------------------------
    def plan_args(self) -> dict:
        """What the decode plan is made for (``rotkv.kernels.plan.plan_decode``): the refined sides."""
        return {"refine": (self.keys is not None, self.values is not None)}

    def kernel_args(self) -> dict:
        """The decode kernel's arguments for the rings (``rotkv.kernels.decode.decode_attention``)."""
        pick = lambda r: RefineTier(r.data, r.pages, r.every) if r is not None else None  # noqa: E731
        return {"refine": pick(self.keys), "refine_values": pick(self.values)}
