"""The page pools of one layer: the cache's only storage.

- tier: ``tier_k, tier_v [pages, kv_heads, P, D]`` in the tier dtype (sink and recent window);
- body: the codec's parts with a leading page dimension, for keys and values. For the token
  codec (keys and values each): ``codes [pages, H, P, D*bits/8]`` uint8 (planar packed) and
  ``scale, lo [pages, H, P, D/G]``; ``paged`` holds them typed, as the kernels read them
  (:class:`rotkv.kernels.body.PagedBody`, built when the pools are made or grow; None for
  codecs the kernels do not read);
- no dequantized copy: the PyTorch reader (the CPU path) decodes the body pages it reads per
  chunk of :data:`READ_PAGES` pages (:meth:`LayerPools.body_chunks`), so what the pools hold is what
  the process holds for the cache.

Pools grow (by at least 25%, copying once) when the cache's free lists grow; they never shrink.
"""

from __future__ import annotations

import copy

import torch

from rotkv.cache.codecs import TokenCodec
from rotkv.cache.refine import RefineRing
from rotkv.kernels import plan
from rotkv.kernels.body import PagedBody, TokenPart


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def fp8_meta_out_of_range(part, dst: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool on the device: did the write kernel mark e4m3 metadata of pages ``dst`` out of range
    (it stores NaN there, ``rotkv.kernels.write._fp8_round``)? No host sync: the pools OR it into
    their flag, which ``RotkvCache.check_metadata_range`` reads once per model call."""
    nan = lambda t: ((t[dst].view(torch.uint8) & 0x7F) == 0x7F).any()  # e4m3fn's NaN: S.1111.111
    return nan(part.scale) | nan(part.lo)


def _grow(t: torch.Tensor, pages: int) -> torch.Tensor:
    if t.shape[0] >= pages:
        return t
    out = torch.zeros(pages, *t.shape[1:], dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


READ_PAGES = 64  # body pages the PyTorch reader decodes at a time (its float32 scratch: one such chunk)


class LayerPools:
    def __init__(self, kv_heads: int, head_dim: int, page: int, tier_dtype: torch.dtype, device, key_codec,
                 value_codec, refine_pages: int = 0, refine_values: bool = False, refine_every: int = 0):
        self.kv_heads, self.head_dim, self.page, self.device = kv_heads, head_dim, page, device
        self.codecs = (key_codec, value_codec)
        # the refine tier (rotkv.cache.refine): 2 more bits for the keys (and with refine_values the values)
        # of each row's newest body pages, 2-bit token-codec sides only (4-bit keys have none)
        two = lambda c: isinstance(c, TokenCodec) and c.bits == 2  # noqa: E731
        self.refine = (RefineRing(refine_pages, kv_heads, page, head_dim, key_codec.group_size, device, refine_every)
                       if refine_pages > 0 and two(key_codec) else None)
        self.refine_v = (RefineRing(refine_pages, kv_heads, page, head_dim, value_codec.group_size, device, refine_every)
                         if refine_pages > 0 and refine_values and two(value_codec) else None)
        shape = (0, kv_heads, page, head_dim)
        self.tier_k = torch.zeros(shape, dtype=tier_dtype, device=device)
        self.tier_v = torch.zeros(shape, dtype=tier_dtype, device=device)
        self.body: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
        if key_codec is not None:
            for parts, codec in zip(self.body, self.codecs):
                if isinstance(codec, TokenCodec):  # known shapes: no probe, whose reference encoder (e4m3
                    # metadata) would sync several times per layer inside the first prefill call
                    parts.update(codec.empty_parts(kv_heads, page, head_dim, device))
                    continue
                # other codecs: the shapes of an encoded probe page; a shallow copy encodes it, so a
                # stateful codec (a position counter) is not advanced
                probe = torch.zeros(1, kv_heads, page, head_dim, device=device)
                for name, t in copy.copy(codec).encode(probe).items():
                    parts[name] = torch.zeros(0, *t.shape[1:], dtype=t.dtype, device=device)
        self.body_page_bytes = sum(int(torch.tensor(t.shape[1:]).prod()) * t.element_size()
                                   for parts in self.body for t in parts.values())
        self.paged: PagedBody | None = None
        self._type_body()
        # which parts the write and dequant kernels store and read (rotkv.kernels.plan.plan_pools; what
        # decode runs is asked per step: decode_plan)
        kernels = plan.plan_pools(self.tier_k, self.paged)
        self.part_kernels, self.dequant_kernel = kernels.write, kernels.dequant
        # per side, a device flag set where a kernel write stored e4m3 metadata out of range (None: no
        # such write yet); the reference encoder raises at once instead
        self.range_flags: list[torch.Tensor | None] = [None, None]

    def decode_plan(self, q: torch.Tensor, cfg) -> plan.DecodePlan | None:
        """The decode plan of a step with rotated queries ``q [B, Hq, D]`` (``rotkv.kernels.plan``),
        or None where no kernel runs it (``rotkv.kernels.plan.plan_step``: kernels off, a body the kernels
        do not read, or a refine tier whose kernel is off)."""
        return plan.plan_step(q, self.paged, cfg, readable=self.codecs[0] is None or self.paged is not None,
                              refine=(self.refine is not None, self.refine_v is not None))

    def _type_body(self) -> None:
        """(Re)build ``paged`` over the current body tensors (token codecs only)."""
        if not all(isinstance(c, TokenCodec) for c in self.codecs):
            return
        self.paged = PagedBody(*(TokenPart(parts["codes"], parts["scale"], parts["lo"], c.bits, c.group_size,
                                           self.head_dim) for parts, c in zip(self.body, self.codecs)))

    # ---- capacity ------------------------------------------------------------------------------
    def fit(self, tier_pages: int, body_pages: int, rows: int | None = None) -> None:
        """Make room for page ids below ``tier_pages`` and ``body_pages`` (and the refine rings of ``rows`` rows)."""
        if rows is not None:
            for ring in self.refine_rings:
                ring.fit(rows)
        if self.tier_k.shape[0] < tier_pages:
            self.tier_k, self.tier_v = _grow(self.tier_k, tier_pages), _grow(self.tier_v, tier_pages)
        first = next(iter(self.body[0].values()), None)  # any codec's parts: [pages, ...]
        if first is not None and first.shape[0] < body_pages:
            for parts in self.body:
                for name, t in parts.items():
                    parts[name] = _grow(t, body_pages)
            self._type_body()

    def nbytes(self) -> int:
        """Bytes the pools hold (capacity, free pages included)."""
        ring = sum(_nbytes(r.data) for r in self.refine_rings)
        return _nbytes(self.tier_k) * 2 + sum(_nbytes(t) for parts in self.body for t in parts.values()) + ring

    # ---- tier ------------------------------------------------------------------------------------
    def write_tier(self, slots: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None,
                   at: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        """Store ``k, v [T, H, D]`` at tier ``slots [T]`` (page * P + offset), or at ``at`` = (pages,
        offsets) ``[T]`` already split (the graph decoder splits them once per step for every layer)."""
        page, off = at if at is not None else (slots // self.page, slots % self.page)
        if k is not None:  # None: that side is written already (LayerRotation.rotate_into)
            self.tier_k[page, :, off] = k
        if v is not None:
            self.tier_v[page, :, off] = v

    def tier_dense(self, pg: torch.Tensor, off: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather ``[B, H, L, D]`` from (page, offset) indices ``[B, L]``."""
        return tuple(t[pg, :, off].permute(0, 2, 1, 3).to(dtype) for t in (self.tier_k, self.tier_v))

    # ---- body ------------------------------------------------------------------------------------
    def body_dense(self, pages: torch.Tensor, dtype, table: tuple | None = None,
                   out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized ``[B, H, N * P, D]`` keys and values of the body pages ``pages [B, N]``
        (trailing entries of short rows are read but masked by the caller): by the Triton
        dequantizer over ``table`` (which leaves a short row's trailing entries untouched), or by
        the codec's decoder, :data:`READ_PAGES` pages at a time (:meth:`decode_pages`). ``out``:
        ``(k, v)`` contiguous ``[B, H, >= N * P, D]`` buffers of ``dtype`` whose first ``N * P``
        positions are written; returned as they are."""
        b, n = pages.shape
        h, p, d = self.kv_heads, self.page, self.head_dim
        if n == 0 or self.codecs[0] is None:
            empty = torch.zeros(b, h, 0, d, dtype=dtype, device=self.device)
            return out if out is not None else (empty, empty)
        if out is None:
            out = tuple(torch.empty(b, h, n * p, d, dtype=dtype, device=self.device) for _ in range(2))
        if table is not None:
            from rotkv.kernels.dequant import dequant_dense

            for part, o in zip(self.paged.parts, out):
                dequant_dense(part, *table, n * p, o)
            return out
        for side, o in enumerate(out):
            for c0 in range(0, n, READ_PAGES):
                c1 = min(c0 + READ_PAGES, n)
                o[:, :, c0 * p:c1 * p].view(b, h, c1 - c0, p, d).copy_(self.decode_pages(pages[:, c0:c1], side, None))
        return out

    def decode_pages(self, pages: torch.Tensor, side: int, dtype) -> torch.Tensor:
        """The codec's float32 decoding of body pages ``pages [B, n]`` of one side (0 keys, 1 values):
        ``[B, H, n, P, D]`` (a permuted view; ``dtype`` given: ``[B, H, n * P, D]`` of that dtype)."""
        b, n = pages.shape
        parts, codec = self.body[side], self.codecs[side]
        x = codec.decode({k: t[pages.reshape(-1)] for k, t in parts.items()})  # [B * n, H, P, D]
        x = x.view(b, n, *x.shape[1:]).permute(0, 2, 1, 3, 4)
        return x if dtype is None else x.reshape(b, self.kv_heads, n * self.page, self.head_dim).to(dtype)

    def flush(self, src: torch.Tensor, dst: torch.Tensor, refine_at: tuple | None = None) -> None:
        """Quantize tier pages ``src`` into body pages ``dst`` (keys and values)."""
        n, h, p, d = len(src), self.kv_heads, self.page, self.head_dim
        self.flush_tokens(*(t[src].transpose(1, 2).reshape(n * p, h, d) for t in (self.tier_k, self.tier_v)), dst,
                          refine_at)

    def flush_tokens(self, xk: torch.Tensor, xv: torch.Tensor, dst: torch.Tensor,
                     refine_at: tuple | None = None) -> None:
        """Quantize the tokens ``xk, xv [n * P, H, D]`` (page ``i`` of ``dst``: tokens ``i*P .. i*P+P-1``)
        into body pages ``dst``: on CUDA one call of the fused write kernel each (INT2/INT4 token
        codec), else the codec's reference encoder. ``refine_at``, for the refine tier (required when
        the pools have one): ``(rows, index, sel)``, the batch row and body index of the pages the rings
        keep, the positions ``sel`` of those pages in ``dst`` (None: all of them, in order;
        :func:`rotkv.cache.refine.ring_writes`)."""
        n, h, p, d = len(dst), self.kv_heads, self.page, self.head_dim
        if self.refine_rings and refine_at is None:
            raise ValueError("a flush into pools with a refine tier needs the pages' rows and body indices")
        for x, parts, codec, i, ring in zip((xk, xv), self.body, self.codecs, (0, 1), (self.refine, self.refine_v)):
            pages = x.reshape(n, p, h, d).transpose(1, 2)  # [n, H, P, D]
            stored = base = None  # the pages' parts and their 2-bit reading, where this flush has them
            if self.part_kernels[i]:
                from rotkv.kernels.write import quant_write

                slots = (dst[:, None] * p + torch.arange(p, device=dst.device)[None]).reshape(-1)
                part = self.paged.parts[i]
                quant_write(x, slots, part, clip=codec.clip)
                if part.meta == torch.float8_e4m3fn:  # the kernel marks out-of-range metadata NaN
                    if self.range_flags[i] is None:
                        self.range_flags[i] = torch.zeros((), dtype=torch.bool, device=x.device)
                    # in place: a CUDA graph that captured this flush accumulates into the same flag
                    self.range_flags[i].logical_or_(fp8_meta_out_of_range(part, dst))
            else:
                stored = codec.encode(pages.float())
                for name, t in stored.items():
                    parts[name][dst] = t
                if ring is not None:
                    base = codec.decode(stored)
            if ring is not None:  # the refine tier: from the exact pages and their stored 2-bit reading
                rows, index, sel = refine_at
                if sel is not None:
                    pages = pages[sel]
                if stored is None:  # written by the kernel: read back
                    stored = {name: t[dst if sel is None else dst[sel]] for name, t in parts.items()}
                    base = codec.decode(stored)
                elif sel is not None:
                    stored, base = {name: t[sel] for name, t in stored.items()}, base[sel]
                ring.write(pages, base, stored["scale"], rows, index)

    @property
    def refine_rings(self) -> list[RefineRing]:
        """The refine tier's rings (keys, then values), those the layer has."""
        return [r for r in (self.refine, self.refine_v) if r is not None]

    @property
    def refine_pages(self) -> int:
        """Slots per row of the refine rings now, the most refined pages any row reads (0: no tier)."""
        return self.refine_rings[0].pages if self.refine_rings else 0

    def grow_refine(self, counts, upto: int) -> None:
        """Grow the refine rings to hold a row of ``upto`` body pages (rows of ``counts`` pages now;
        :meth:`rotkv.cache.refine.RefineRing.grow`)."""
        for ring in self.refine_rings:
            ring.grow(counts, upto)

    @property
    def refine_every(self) -> int:
        """The refine tier's size rule: one refined page per this many body pages (0: ``refine_pages``)."""
        return self.refine_rings[0].every if self.refine_rings else 0

    def add_refinement(self, k: torch.Tensor | None, v: torch.Tensor | None, nb: int, rows: torch.Tensor,
                       local: torch.Tensor, index: torch.Tensor, pages: torch.Tensor, start: int = 0) -> None:
        """Add the refine tier to dequantized body keys and values ``[b, H, >= nb * P, D]`` in place (None:
        that side is not read): the ``index[i]``-th body page (id ``pages[i]``) of local row ``local[i]``,
        batch row ``rows[i]``; ``k, v`` hold the body pages from index ``start`` on."""
        for t, parts, ring in zip((k, v), self.body, (self.refine, self.refine_v)):
            if ring is not None and t is not None:
                ring.add(t, nb, rows, local, index, parts["scale"][pages], start)

    def copy_from(self, src: "LayerPools", tier_src, tier_dst, body_src, body_dst) -> None:
        """Copy pages of another layer's pools (same layout) into these: tier pages ``tier_src`` of
        ``src`` to ``tier_dst`` here, body pages (every part) likewise; ids are
        ``[n]`` int64 tensors on this device. The refine rings are copied apart (:meth:`copy_rings_from`)."""
        if len(tier_src):
            self.tier_k[tier_dst] = src.tier_k[tier_src]
            self.tier_v[tier_dst] = src.tier_v[tier_src]
        if len(body_src):
            for mine, theirs in zip(self.body, src.body):
                for name, t in mine.items():
                    t[body_dst] = theirs[name][body_src]

    def copy_rings_from(self, src: "LayerPools", row: int, src_row: int, body_pages: int) -> None:
        """Give row ``row`` the refinements of ``src``'s row ``src_row``, a row of ``body_pages`` body
        pages: the pages its ring holds (its newest, up to the ring's slots), each from its slot there
        to its slot here (``index % K``); the rings here must be grown for the row already."""
        for mine, theirs in zip(self.refine_rings, src.refine_rings):
            held = min(body_pages, theirs.pages)
            if not held:
                continue
            if mine.pages < held:
                raise ValueError(f"the refine ring holds {mine.pages} pages per row, the adopted row {held}")
            idx = torch.arange(body_pages - held, body_pages, device=mine.data.device)
            mine.data[row, idx % mine.pages] = theirs.data[src_row, idx.to(theirs.data.device) % theirs.pages]

    def copy_pages(self, tier_src, tier_dst, body_src, body_dst) -> None:
        """Copy pages (a row repeated by beam search gets its own pages)."""
        if len(tier_src):
            self.tier_k[tier_dst] = self.tier_k[tier_src]
            self.tier_v[tier_dst] = self.tier_v[tier_src]
        if len(body_src):
            for parts in self.body:
                for t in parts.values():
                    t[body_dst] = t[body_src]
