"""Salient pages: the refine tier's 2 more bits for the body pages a prompt's end reads most (``CacheSpec.refine_salient``).

Why. The refine tier (:mod:`rotkv.cache.refine`) refines each row's newest body pages, where the error of long
contexts grows. A question at the end of a long prompt reads old tokens instead: the needle of a retrieval task,
the passage a summary quotes. Those pages keep their 2-bit keys, and a retrieval that bf16 makes can fail.

What. When a prefill call arrives, each layer keeps its last :data:`OBSERVE` queries (the observation window of
SnapKV and ZipCache, which choose tokens to keep the same way) and, per query, the log-sum-exp of its scores over
the call's tokens. Every body page the call flushes is scored per KV head by the attention mass those queries give
its tokens (summed over the queries and the query heads of the group), and each (row, KV head) keeps the
``refine_salient`` pages of largest mass seen in the call: for them it stores the refine tier's 2 more bits per
element (:func:`rotkv.quant.refine.refine_codes`), for the keys, and for the values where the refine tier refines
them. A page the refine tier holds as one of its row's newest is read with the ring's bits, not twice. Pages
flushed outside a prefill (a decode step's) are not candidates; a later prefill call of a row (a chunked prompt)
chooses among its own pages by its own last queries, against the pages held.

Cost: ``P * D / 4`` bytes per side per chosen page and KV head, and 4 bytes for its index, counted in the cache's
measured bits. The decode kernels do not read these pages: a cache with them decodes on the PyTorch path
(``rotkv.kernels.plan.plan_step``), and a CUDA-graph decode refuses it (``check_graph``).

Storage per layer: ``codes[side] uint8 [rows, H, S, P, D / 4]``, ``index int64 [rows, H, S]`` (the body index in
its row; -1: empty) and ``mass float32 [rows, H, S]`` (the choice's scores).
"""

from __future__ import annotations

import numpy as np
import torch

from rotkv.cache.codecs import TokenCodec
from rotkv.cache.plan import to_device
from rotkv.quant.packing import pack, unpack
from rotkv.quant.refine import refine_codes, refine_delta, refined_pages

OBSERVE = 16  # the queries at the end of a prefill call that choose the pages
SCORE_PAGES = 2048  # flushed pages scored at once (a bound on the scores' scratch)


def page_mass(queries: torch.Tensor, lse: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The attention mass ``[n, H]`` that observation queries ``[n, H, M, D]`` (scaled; ``M`` = the group's query
    heads x the observed queries), whose scores over all keys have log-sum-exp ``lse [n, H, M]``, give the keys of
    pages ``x [n, H, P, D]``."""
    out = []
    for i in range(0, len(x), SCORE_PAGES):
        s = queries[i:i + SCORE_PAGES] @ x[i:i + SCORE_PAGES].float().transpose(-1, -2)  # [n, H, M, P]
        out.append((s - lse[i:i + SCORE_PAGES, ..., None]).exp().sum((-1, -2)))
    return torch.cat(out) if out else x.new_zeros(0, x.shape[1], dtype=torch.float32)


class SalientPages:
    """One layer's salient pages (a tier of :mod:`rotkv.cache.tiers`); see the module docstring."""

    label = "the salient pages (`refine_salient`)"
    PUBLISHED: dict = {}

    def __init__(self, pages: int, sides: tuple[bool, bool], kv_heads: int, page: int, head_dim: int,
                 group_size: int, refine_cap: int, refine_every: int, device):
        if pages < 1:
            raise ValueError(f"salient pages need >= 1 page per row and KV head but got {pages}")
        self.pages, self.sides, self.group_size = pages, sides, group_size
        self.refine_cap, self.refine_every = refine_cap, refine_every  # the ring's newest pages: read with its bits
        self.h, self.p, self.d = kv_heads, page, head_dim
        self.device = device
        self.obs: tuple[torch.Tensor, torch.Tensor] | None = None  # the observation of the current call
        self._choice: list | None = None  # the key side's choice in a flush, for the value side
        self.fit(0)

    @classmethod
    def build(cls, spec, codecs, kv_heads: int, page: int, head_dim: int, device) -> "SalientPages | None":
        """The tier of a layer of ``spec`` whose (key, value) codecs are ``codecs``, or None: no ``refine_salient``,
        or no side the refine tier refines (2-bit token codecs: keys, and values with ``refine_values``)."""
        if not spec.refine_salient:
            return None
        two = lambda c: isinstance(c, TokenCodec) and c.bits == 2  # noqa: E731
        kc, vc = codecs
        sides = (two(kc), bool(spec.refine_values) and two(vc))
        if not any(sides):
            return None
        group = (kc if sides[0] else vc).group_size
        return cls(spec.refine_salient, sides, kv_heads, page, head_dim, group, -(-spec.refine_tokens // page),
                   spec.refine_every, device)

    @staticmethod
    def graph_flags(spec) -> dict:
        return {"salient": bool(spec.refine_salient)}

    # ---- rows ------------------------------------------------------------------------------------
    def fit(self, rows: int) -> None:
        """Hold ``rows`` rows (a new batch: nothing is chosen yet)."""
        if getattr(self, "index", None) is not None and self.index.shape[0] == rows:
            return
        s, dev = self.pages, self.device
        self.index = torch.full((rows, self.h, s), -1, dtype=torch.int64, device=dev)
        self.mass = torch.full((rows, self.h, s), -torch.inf, dtype=torch.float32, device=dev)
        self.codes = [torch.zeros(rows, self.h, s, self.p, self.d // 4, dtype=torch.uint8, device=dev) if on else None
                      for on in self.sides]

    def _tensors(self) -> list[torch.Tensor]:
        return [self.index, self.mass] + [c for c in self.codes if c is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors())

    def stored_bytes(self, counts: np.ndarray) -> int:
        """Bytes of the chosen pages of the rows of ``counts``: their codes and a 4-byte index each."""
        held = int((self.index[: len(counts)] >= 0).sum())
        return held * (4 + sum(self.p * self.d // 4 for on in self.sides if on))

    def grow(self, counts, upto: int) -> None:
        """Nothing to grow: a row holds ``refine_salient`` pages per KV head at any length."""

    def select(self, index: torch.Tensor) -> None:
        index = index.to(self.device)
        self.index, self.mass = self.index[index], self.mass[index]
        self.codes = [c[index] if c is not None else None for c in self.codes]

    def adopt(self, src: "SalientPages", moves) -> None:
        """Give rows ``src``'s chosen pages of its rows: ``moves`` are ``(row, src_row, counts, body_pages)``."""
        for row, src_row, _, _ in moves:
            self.index[row] = src.index[src_row].to(self.device)
            self.mass[row] = src.mass[src_row].to(self.device)
            for mine, theirs in zip(self.codes, src.codes):
                if mine is not None:
                    mine[row] = theirs[src_row].to(self.device)

    # ---- the observation -------------------------------------------------------------------------
    def observe(self, query: torch.Tensor, keys: torch.Tensor, real: torch.Tensor | None, scaling: float,
                rotation) -> None:
        """A call's queries ``[B, Hq, q, D]`` (the model's basis) and rotated keys ``[B, H, q, D]``: a prefill call
        (q > 1) keeps its last :data:`OBSERVE` queries, scaled and rotated as the attention reads them, and their
        log-sum-exp over the call's keys (causal; ``real [B, q]`` False at padding); a decode call clears it."""
        b, hq, q, d = query.shape
        if q < 2:
            self.obs = None
            return
        n, h = min(OBSERVE, q), keys.shape[1]
        qo = rotation.queries(query[:, :, q - n:], torch.float32).reshape(b, h, (hq // h) * n, d) * scaling
        s = qo @ keys.float().transpose(-1, -2)  # [B, H, g * n, q]
        pos = torch.arange(q - n, q, device=query.device).repeat(hq // h)
        hide = torch.arange(q, device=query.device)[None, :] > pos[:, None]  # [g * n, q]: causal
        hide = hide[None, None] if real is None else hide[None, None] | ~real.to(query.device)[:, None, None, :]
        self.obs = (qo, s.masked_fill(hide, -torch.inf).logsumexp(-1))

    # ---- write -----------------------------------------------------------------------------------
    def flush_target(self, pages, device):
        """``(rows, index, fresh)`` of a flush: the batch row and body index of every page it writes, and the rows
        whose first body page it writes (a new sequence: what they held is dropped); None for the CUDA-graph
        decoder's ``(rows, index)`` (a cache with this tier refuses the graph: ``check_graph``)."""
        if pages is None or isinstance(pages, tuple):
            return None
        f = pages.flush
        return pages.cached(("salient_at", device), lambda: (to_device(f.rows, device), to_device(f.index, device),
                                                            np.unique(f.rows[f.index == 0]).tolist()))

    def write(self, side: int, x: torch.Tensor, dst: torch.Tensor, stored: dict | None, parts: dict, codec,
              target) -> None:
        """The key side (0) scores the flushed pages ``x [n, H, P, D]`` and chooses each (row, KV head)'s pages
        among those held and these; each refined side stores the chosen new pages' codes."""
        if target is None:
            return
        rows, index, fresh = target
        if side == 0:
            for r in fresh:
                self.index[r], self.mass[r] = -1, -torch.inf
            self._choice = None
            if self.obs is None:  # not a prefill call's flush: its pages are not candidates
                return
            qo, lse = self.obs
            mass = page_mass(qo[rows], lse[rows], x)  # [n, H]
            self._choice = []
            for r in torch.unique(rows).tolist():
                at = torch.nonzero(rows == r).flatten()
                cand = torch.cat([self.mass[r], mass[at].T], 1)  # [H, S + n_r]
                top = cand.topk(self.pages, dim=1).indices  # [H, S]
                self.mass[r] = cand.gather(1, top)
                self.index[r] = torch.cat([self.index[r], index[at][None].expand(self.h, -1)], 1).gather(1, top)
                self._choice.append((r, at, top))
        codes = self.codes[side]
        if codes is None or not self._choice:
            return
        if stored is None:
            stored = {name: t[dst] for name, t in parts.items()}
        new = pack(refine_codes(x, codec.decode(stored), stored["scale"], self.group_size), 2)  # [n, H, P, D/4]
        for r, at, top in self._choice:
            cand = torch.cat([codes[r], new[at].transpose(0, 1)], 1)  # [H, S + n_r, P, D/4]
            codes[r] = cand.gather(1, top[..., None, None].expand(-1, -1, *cand.shape[2:]))

    # ---- read ------------------------------------------------------------------------------------
    def read(self, k: torch.Tensor | None, v: torch.Tensor | None, nb: int, counts: np.ndarray, pages: np.ndarray,
             r0: int, body: tuple, start: int = 0, memo=None) -> None:
        """Add the chosen pages' refinements to dequantized body keys and values ``[b, H, >= nb * P, D]`` (in place),
        which hold body pages ``start .. start + nb - 1`` of rows ``r0 ..``; not to a page the refine tier holds as
        one of its row's newest (the ring's bits are read there)."""
        b = len(counts)
        if not b:
            return
        idx = self.index[r0:r0 + b]  # [b, H, S]
        dev = idx.device

        def make():  # each row's pages below the refine tier's newest, and the page ids: once a step for every layer
            c = np.asarray(counts, dtype=np.int64)
            return to_device(c - refined_pages(c, self.refine_cap, self.refine_every), dev), to_device(pages, dev)
        key = ("salient_read", dev, r0, b, self.refine_cap, self.refine_every)
        below, pages_t = memo(key, make) if memo is not None else make()
        ok = (idx >= start) & (idx < start + nb) & (idx < below[:, None, None])
        local, head, slot = torch.nonzero(ok, as_tuple=True)
        if not len(local):
            return
        at = idx[local, head, slot]
        ids = pages_t[local, at]
        for t, codes, parts in zip((k, v), self.codes, body):
            if t is None or codes is None:
                continue
            scale = parts["scale"][ids, head]  # [n, P, D / G]
            delta = refine_delta(unpack(codes[r0 + local, head, slot], 2), scale, self.group_size)  # [n, P, D]
            view = t[:, :, : nb * self.p].view(b, t.shape[1], nb, self.p, t.shape[-1])
            view[local, head, at - start] += delta.to(t.dtype)

    # ---- the kernels -----------------------------------------------------------------------------
    def plan_args(self) -> dict:
        """No decode kernel reads the chosen pages: the plan leaves a cache with them to the PyTorch reader."""
        return {"salient": True}

    def kernel_args(self) -> dict:
        return {}
