"""The page pools of one layer: the cache's only storage.

- tier: ``tier_k, tier_v [pages, kv_heads, P, D]`` in the tier dtype (sink and recent window);
- body: the codec's parts with a leading page dimension, for keys and values. For the token
  codec (keys and values each): ``codes [pages, H, P, D*bits/8]`` uint8 (planar packed) and
  ``scale, lo [pages, H, P, D/G]``; ``paged`` holds them typed, as the kernels read them
  (:class:`rotkv.kernels.body.PagedBody`, built when the pools are made or grow; None for
  codecs the kernels do not read);
- no dequantized copy: the PyTorch reader (the CPU path) decodes the body pages it reads per
  chunk of :data:`READ_PAGES` pages (:meth:`LayerPools.body_chunks`), so what the pools hold is what
  the process holds for the cache;
- tiers: storage features over the body pages (``rotkv.cache.tiers``), each its own; the pools call
  their hooks and name none.

Pools grow (by at least 25%, copying once) when the cache's free lists grow; they never shrink.
"""

from __future__ import annotations

import copy

import numpy as np
import torch

from rotkv.cache.codecs import ChannelCodec, TokenCodec
from rotkv.cache.plan import to_device
from rotkv.cache.tiers import published
from rotkv.kernels import plan
from rotkv.kernels.body import ChannelPart, PagedBody, TokenPart


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
                 value_codec, tiers: tuple = (), predict=None):
        self.kv_heads, self.head_dim, self.page, self.device = kv_heads, head_dim, page, device
        # the layer's inter-layer key prediction (rotkv.cache.predict.KeyPredictor) or None: its body keys are
        # residuals against a prediction from the previous layer, read and written by the PyTorch code only
        self.predict = predict
        self.codecs = (key_codec, value_codec)
        self.tiers = tuple(tiers)  # rotkv.cache.tiers.build_tiers: what rides on the body pages
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
        if predict is not None:  # the kernels read and write one layer's pages: predicted keys take the codec's code
            self.part_kernels, self.dequant_kernel = (False, self.part_kernels[1]), False
        # per side, a device flag set where a kernel write stored e4m3 metadata out of range (None: no
        # such write yet); the reference encoder raises at once instead
        self.range_flags: list[torch.Tensor | None] = [None, None]

    def __getattr__(self, name: str):
        """A name a tier publishes (``rotkv.cache.tiers.published``); AttributeError for any other."""
        return published(self.__dict__.get("tiers", ()), name)

    def decode_plan(self, q: torch.Tensor, cfg) -> plan.DecodePlan | None:
        """The decode plan of a step with rotated queries ``q [B, Hq, D]`` (``rotkv.kernels.plan``),
        or None where no kernel runs it (``rotkv.kernels.plan.plan_step``: kernels off, a body the kernels
        do not read, or a tier whose kernel is off, or predicted keys); the plan is made for the tiers (their
        ``plan_args``)."""
        if self.predict is not None:
            return None
        return plan.plan_step(q, self.paged, cfg, readable=self.codecs[0] is None or self.paged is not None,
                              **self.tier_args("plan_args"))

    def tier_args(self, hook: str) -> dict:
        """The keyword arguments every tier gives by ``hook`` (``plan_args``: the decode plan's,
        ``kernel_args``: the decode kernel's), merged."""
        out = {}
        for tier in self.tiers:
            out.update(getattr(tier, hook)())
        return out

    def _type_body(self) -> None:
        """(Re)build ``paged`` over the current body tensors (token codecs, and KIVI's channel keys beside
        token values)."""
        kc, vc = self.codecs
        if not (isinstance(kc, (TokenCodec, ChannelCodec)) and isinstance(vc, TokenCodec)):
            return
        k, v = self.body
        key = (ChannelPart(k["codes"], k["scale"], k["lo"], kc.bits, self.head_dim) if isinstance(kc, ChannelCodec)
               else TokenPart(k["codes"], k["scale"], k["lo"], kc.bits, kc.group_size, self.head_dim))
        self.paged = PagedBody(key, TokenPart(v["codes"], v["scale"], v["lo"], vc.bits, vc.group_size, self.head_dim))

    # ---- capacity ------------------------------------------------------------------------------
    def fit(self, tier_pages: int, body_pages: int, rows: int | None = None) -> None:
        """Make room for page ids below ``tier_pages`` and ``body_pages`` (and the tiers of ``rows`` rows)."""
        if rows is not None:
            for tier in self.tiers:
                tier.fit(rows)
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
        tiers = sum(t.nbytes() for t in self.tiers)
        return _nbytes(self.tier_k) * 2 + sum(_nbytes(t) for parts in self.body for t in parts.values()) + tiers

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
                   out: tuple[torch.Tensor, torch.Tensor] | None = None, counts=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized ``[B, H, N * P, D]`` keys and values of the body pages ``pages [B, N]``
        (trailing entries of short rows are read but masked by the caller): by the Triton
        dequantizer over ``table`` (which leaves a short row's trailing entries untouched), or by
        the codec's decoder, :data:`READ_PAGES` pages at a time (:meth:`decode_pages`). ``out``:
        ``(k, v)`` contiguous ``[B, H, >= N * P, D]`` buffers of ``dtype`` whose first ``N * P``
        positions are written; returned as they are. ``counts``: as :meth:`decode_pages`."""
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
                o[:, :, c0 * p:c1 * p].view(b, h, c1 - c0, p, d).copy_(
                    self.decode_pages(pages[:, c0:c1], side, None, start=c0, counts=counts))
        return out

    def decode_pages(self, pages: torch.Tensor, side: int, dtype, start: int = 0, counts=None) -> torch.Tensor:
        """The codec's float32 decoding of body pages ``pages [B, n]`` of one side (0 keys, 1 values):
        ``[B, H, n, P, D]`` (a permuted view; ``dtype`` given: ``[B, H, n * P, D]`` of that dtype). ``pages[:, c]``
        is every row's body page ``start + c``; ``counts [B]`` (host), the body pages of each row (the entries past
        them are read but masked by the caller; None: every entry is a page of its row). Predicted keys
        (``predict``) need them: their positions, and which pages' keys the next layer reads."""
        b, n = pages.shape
        parts, codec = self.body[side], self.codecs[side]
        x = codec.decode({k: t[pages.reshape(-1)] for k, t in parts.items()})  # [B * n, H, P, D]
        if side == 0 and self.predict is not None:
            index = torch.arange(start, start + n, device=x.device).repeat(b)
            valid = None
            if counts is not None and (np.asarray(counts) < start + n).any():
                valid = torch.from_numpy((np.arange(start, start + n)[None, :] < np.asarray(counts)[:, None])
                                         .reshape(-1)).to(x.device)
            x = self.predict.read(x, pages.reshape(-1), index, valid, self.body_capacity)
        x = x.view(b, n, *x.shape[1:]).permute(0, 2, 1, 3, 4)
        return x if dtype is None else x.reshape(b, self.kv_heads, n * self.page, self.head_dim).to(dtype)

    def flush(self, src: torch.Tensor, dst: torch.Tensor, pages=None) -> None:
        """Quantize tier pages ``src`` into body pages ``dst`` (keys and values); ``pages`` as :meth:`flush_tokens`."""
        n, h, p, d = len(src), self.kv_heads, self.page, self.head_dim
        self.flush_tokens(*(t[src].transpose(1, 2).reshape(n * p, h, d) for t in (self.tier_k, self.tier_v)), dst,
                          pages)

    def flush_tokens(self, xk: torch.Tensor, xv: torch.Tensor, dst: torch.Tensor, pages=None) -> None:
        """Quantize the tokens ``xk, xv [n * P, H, D]`` (page ``i`` of ``dst``: tokens ``i*P .. i*P+P-1``)
        into body pages ``dst``: on CUDA one call of the fused write kernel each (INT2/INT4 token
        codec), else the codec's reference encoder; then every tier writes its part of them. ``pages``,
        which rows' pages these are, for the tiers (a tier may require it): the layer's
        :class:`~rotkv.cache.plan.Step`, or ``(rows, index)`` device tensors, the batch row and index in its
        body of each page (``Tier.flush_target``)."""
        n, h, p, d = len(dst), self.kv_heads, self.page, self.head_dim
        targets = [tier.flush_target(pages, self.device) for tier in self.tiers]
        for x, parts, codec, i in zip((xk, xv), self.body, self.codecs, (0, 1)):
            x_pages = x.reshape(n, p, h, d).transpose(1, 2)  # [n, H, P, D]
            stored = None  # the pages' parts, where this flush encoded them here
            predicted = None
            if i == 0 and self.predict is not None:  # the residual against the prediction is what is stored
                x_pages, predicted = self.predict.residual(x_pages, dst, self._flush_index(pages, dst.device))
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
                stored = codec.encode(x_pages.float())
                for name, t in stored.items():
                    parts[name][dst] = t
                if predicted is not None:  # the next layer predicts from what these pages read (no refine bits)
                    self.predict.wrote(dst, codec.decode(stored), predicted, self.body_capacity)
            for tier, target in zip(self.tiers, targets):
                tier.write(i, x_pages, dst, stored, parts, codec, target)

    @property
    def body_capacity(self) -> int:
        """Body pages the pools hold (free ones included)."""
        first = next(iter(self.body[0].values()), None)
        return 0 if first is None else first.shape[0]

    @staticmethod
    def _flush_index(pages, device) -> torch.Tensor:
        """The body index (in its row) of each page a flush writes: ``pages`` as :meth:`flush_tokens`."""
        if pages is None:
            raise ValueError("a flush of predicted keys needs the pages' rows and body indices")
        if isinstance(pages, tuple):
            return pages[1].to(device)
        return to_device(pages.flush.index, device)

    # ---- tiers: every hook over every tier (rotkv.cache.tiers) -------------------------------------
    def tier_bytes(self, counts) -> int:
        """Bytes the tiers add to rows of ``counts`` body pages now."""
        return sum(tier.stored_bytes(counts) for tier in self.tiers)

    def observe_tiers(self, query: torch.Tensor, keys: torch.Tensor, real, scaling: float, rotation) -> None:
        """Show the tiers a call's queries and rotated keys before its steps (``Tier.observe``)."""
        for tier in self.tiers:
            tier.observe(query, keys, real, scaling, rotation)

    def grow_tiers(self, counts, upto: int) -> None:
        """Make the tiers hold a row of ``upto`` body pages (rows of ``counts`` pages now)."""
        for tier in self.tiers:
            tier.grow(counts, upto)

    def select_tiers(self, index: torch.Tensor) -> None:
        """The tiers' rows become ``index`` (the body's pages are copied apart: :meth:`copy_pages`)."""
        for tier in self.tiers:
            tier.select(index)

    def adopt_tiers(self, src: "LayerPools", moves) -> None:
        """Give rows what ``src``'s tiers hold for its rows: ``moves``, in order, are ``(row, src_row, counts,
        body_pages)``: ``row`` here (rows of ``counts`` body pages before it) takes ``src_row``, a row of
        ``body_pages`` body pages."""
        for mine, theirs in zip(self.tiers, src.tiers):
            mine.adopt(theirs, moves)

    def read_tiers(self, k: torch.Tensor | None, v: torch.Tensor | None, nb: int, counts, pages, r0: int = 0,
                   start: int = 0, memo=None) -> None:
        """Add the tiers to dequantized body keys and values ``[b, H, >= nb * P, D]`` in place (None: that side
        is not read), which hold body pages ``start .. start + nb - 1`` of rows ``r0 .. r0 + b - 1``: ``counts
        [b]`` body pages each, their ids ``pages [b, N]`` (host). ``memo``: a per-step store (``Step.cached``)."""
        for tier in self.tiers:
            tier.read(k, v, nb, counts, pages, r0, self.body, start, memo)

    def copy_from(self, src: "LayerPools", tier_src, tier_dst, body_src, body_dst) -> None:
        """Copy pages of another layer's pools (same layout) into these: tier pages ``tier_src`` of
        ``src`` to ``tier_dst`` here, body pages (every part) likewise; ids are
        ``[n]`` int64 tensors on this device. The tiers are copied apart (:meth:`adopt_tiers`)."""
        if len(tier_src):
            self.tier_k[tier_dst] = src.tier_k[tier_src]
            self.tier_v[tier_dst] = src.tier_v[tier_src]
        if len(body_src):
            for mine, theirs in zip(self.body, src.body):
                for name, t in mine.items():
                    t[body_dst] = theirs[name][body_src]

    def copy_pages(self, tier_src, tier_dst, body_src, body_dst) -> None:
        """Copy pages (a row repeated by beam search gets its own pages)."""
        if len(tier_src):
            self.tier_k[tier_dst] = self.tier_k[tier_src]
            self.tier_v[tier_dst] = self.tier_v[tier_src]
        if len(body_src):
            for parts in self.body:
                for t in parts.values():
                    t[body_dst] = t[body_src]
