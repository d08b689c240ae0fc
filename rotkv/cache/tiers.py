"""Storage tiers: features that ride on a layer's body pages, composed by the cache without naming them.

A tier (the refine tier, :class:`rotkv.cache.refine.RefineRings`, and the salient pages,
:class:`rotkv.cache.salient.SalientPages`) declares in its own
module everything about its storage: the pages it keeps beside the body's, its bytes, its write (when body
pages are flushed) and its read (added to dequantized body pages by the PyTorch paths; the decode kernels read
it through the arguments it gives them, and its kernel parts sit beside the kernels). The pools
(``rotkv.cache.pools``), the layer, the cache and its CUDA graph call the hooks of :class:`Tier` on every tier a
layer holds; :data:`KINDS` lists the tiers there are, and nothing else in the cache names one.

A tier kind (a class) also has ``build(spec, codecs, kv_heads, page, head_dim, device)``, the tier of one layer
or None (:func:`build_tiers`), ``graph_flags(spec)``, what the kernel plan's CUDA-graph check needs
(:func:`graph_flags`), and ``PUBLISHED``, the names the pools answer for it (:func:`published`: tests and
tools read a tier's state through them).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from rotkv.cache.refine import RefineRings
from rotkv.cache.salient import SalientPages


class Tier(Protocol):
    """The hooks a tier of one layer answers (see the module docstring)."""

    label: str  # names the tier and its spec field in messages

    def fit(self, rows: int) -> None:
        """Hold ``rows`` rows (a new batch)."""

    def nbytes(self) -> int:
        """Bytes the tier holds (capacity)."""

    def stored_bytes(self, counts: np.ndarray) -> int:
        """Bytes the tier adds to rows of ``counts`` body pages now (counted in the cache's measured bits)."""

    def grow(self, counts: np.ndarray, upto: int) -> None:
        """Make room for a row of ``upto`` body pages (rows of ``counts`` pages now); a CUDA graph grows its
        layers' tiers for its capacity before the capture."""

    def select(self, index: torch.Tensor) -> None:
        """Rows become ``index`` (beam search, row removal)."""

    def adopt(self, src: "Tier", moves) -> None:
        """Give rows what ``src`` (the same kind, another cache's layer) holds for its rows: ``moves``, in
        order, ``(row, src_row, counts, body_pages)`` (:meth:`rotkv.cache.pools.LayerPools.adopt_tiers`)."""

    def observe(self, query: torch.Tensor, keys: torch.Tensor, real: torch.Tensor | None, scaling: float,
                rotation) -> None:
        """See a call's queries ``[B, Hq, q, D]`` (the model's basis) and rotated keys ``[B, H, q, D]`` before its
        steps run (``real``: False at padding, or None)."""

    def flush_target(self, pages, device):
        """Where a flush writes: ``pages`` is the layer's Step, or ``(rows, index)`` device tensors."""

    def write(self, side: int, x: torch.Tensor, dst: torch.Tensor, stored: dict | None, parts: dict, codec,
              target) -> None:
        """Write the tier's part of body pages ``dst`` of one side, flushed from the exact pages ``x``."""

    def read(self, k: torch.Tensor | None, v: torch.Tensor | None, nb: int, counts: np.ndarray, pages: np.ndarray,
             r0: int, body: tuple, start: int = 0, memo=None) -> None:
        """Add the tier to dequantized body keys and values (in place)."""

    def plan_args(self) -> dict:
        """Keyword arguments of the decode plan (``rotkv.kernels.plan.plan_step``) for the tier."""

    def kernel_args(self) -> dict:
        """Keyword arguments of the decode kernel (``rotkv.kernels.decode.decode_attention``) for the tier."""


KINDS: tuple[type, ...] = (RefineRings, SalientPages)


def build_tiers(spec, codecs, kv_heads: int, page: int, head_dim: int, device) -> tuple[Tier, ...]:
    """The tiers of one layer of ``spec`` whose (key, value) codecs are ``codecs``."""
    made = (kind.build(spec, codecs, kv_heads, page, head_dim, device) for kind in KINDS)
    return tuple(t for t in made if t is not None)


def graph_flags(spec) -> dict:
    """Every tier kind's flags for the kernel plan's CUDA-graph check (``rotkv.kernels.plan.check_graph``)."""
    out = {}
    for kind in KINDS:
        out.update(kind.graph_flags(spec))
    return out


def published(tiers, name: str):
    """The value of a name a tier kind publishes (``PUBLISHED``): the attribute of that kind's tier among
    ``tiers``, or the kind's value for a layer without it. AttributeError for a name no kind publishes."""
    for kind in KINDS:
        if name in kind.PUBLISHED:
            attr, absent = kind.PUBLISHED[name]
            tier = next((t for t in tiers if isinstance(t, kind)), None)
            return absent if tier is None else getattr(tier, attr)
    raise AttributeError(name)
