"""The quantized paged body as the kernels read it: a typed part for keys and one for values.

A part holds the tensors of one storage format with a leading page dimension
``[pages, kv_heads, P, ...]`` and states its widths once; the kernels, their references and the
plans read ``bits`` and ``group_size`` from it and never derive them from byte counts. A new
storage format (a sparse side table, a codebook) is a new part type plus its kernels; the cache
hands the kernels a :class:`PagedBody` whatever its parts are.

- :class:`TokenPart`: per-token groups (``rotkv.quant.quantizer``): ``codes [pages, H, P,
  D*bits/8]`` uint8, planar packed (``rotkv.quant.packing``), and ``scale, lo [pages, H, P, D/G]``
  in the metadata dtype.
- :class:`ChannelPart`: KIVI's keys, one group per channel and page (``rotkv.cache.codecs.ChannelCodec``):
  ``codes [pages, H, D, P*bits/8]`` (each channel's P tokens planar packed) and ``scale, lo [pages, H,
  D, 1]``. The dequant kernel reads it; the write and decode kernels read token parts only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from rotkv.quant.widths import QUANT_WIDTHS, check_width


def _row_bytes(head_dim: int, bits: int) -> int:
    return head_dim * bits // 8  # INT3 is bit-sliced: 2 + 1 bits, 3 * D / 8 bytes as well


def _check_meta(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor) -> None:
    """A ValueError unless scale and lo share one float dtype and the three tensors one device."""
    if scale.dtype != lo.dtype or not scale.dtype.is_floating_point:
        raise ValueError(f"scale and lo must share one float dtype, got {scale.dtype} and {lo.dtype}")
    if not (codes.device == scale.device == lo.device):
        raise ValueError("codes, scale and lo must be on one device")


@dataclass(frozen=True, eq=False)
class TokenPart:
    """Keys or values in per-token groups of ``group_size`` dims at ``bits`` bits; see the module
    docstring for the shapes. Checked at construction."""

    codes: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor
    bits: int
    group_size: int
    head_dim: int

    format = "token"

    def __post_init__(self):
        check_width(self.bits, "bits", QUANT_WIDTHS)
        d, g = self.head_dim, self.group_size
        if g <= 0 or d <= 0 or d % g:
            raise ValueError(f"`group_size` ({g}) has to divide head_dim ({d})")
        if self.codes.dim() != 4 or self.codes.dtype != torch.uint8:
            raise ValueError(f"codes must be uint8 [pages, heads, page, bytes], got {self.codes.dtype} "
                             f"{tuple(self.codes.shape)}")
        if self.codes.shape[-1] != _row_bytes(d, self.bits):
            raise ValueError(f"codes rows of {self.codes.shape[-1]} bytes do not hold {d} dims at {self.bits} bits "
                             f"({_row_bytes(d, self.bits)} bytes)")
        want = (*self.codes.shape[:-1], d // g)
        if tuple(self.scale.shape) != want or tuple(self.lo.shape) != want:
            raise ValueError(f"scale and lo must be {want} (group size {g}), got {tuple(self.scale.shape)} and "
                             f"{tuple(self.lo.shape)}")
        _check_meta(self.codes, self.scale, self.lo)

    @classmethod
    def zeros(cls, pages: int, kv_heads: int, page_size: int, head_dim: int, bits: int, group_size: int,
              meta: torch.dtype = torch.float16, device: str | torch.device = "cpu") -> TokenPart:
        """An empty (zeroed) part of ``pages`` pages."""
        shape = (pages, kv_heads, page_size)
        return cls(torch.zeros(*shape, _row_bytes(head_dim, bits), dtype=torch.uint8, device=device),
                   torch.zeros(*shape, head_dim // group_size, dtype=meta, device=device),
                   torch.zeros(*shape, head_dim // group_size, dtype=meta, device=device), bits, group_size, head_dim)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.lo

    @property
    def page_size(self) -> int:
        return self.codes.shape[2]

    @property
    def groups(self) -> int:
        """Groups per head vector (``D / G``)."""
        return self.head_dim // self.group_size

    @property
    def meta(self) -> torch.dtype:
        return self.scale.dtype

    @property
    def row_bytes(self) -> int:
        """Bytes of one token of one head: codes plus scale and lo."""
        return self.codes.shape[-1] + 2 * self.groups * self.scale.element_size()


@dataclass(frozen=True, eq=False)
class ChannelPart:
    """KIVI keys: per channel over the ``P`` tokens of a page at ``bits`` bits; see the module docstring for
    the shapes. Checked at construction."""

    codes: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor
    bits: int
    head_dim: int

    format = "channel"

    def __post_init__(self):
        check_width(self.bits, "bits", QUANT_WIDTHS)
        if self.codes.dim() != 4 or self.codes.dtype != torch.uint8 or self.codes.shape[2] != self.head_dim:
            raise ValueError(f"codes must be uint8 [pages, heads, head_dim={self.head_dim}, bytes], got "
                             f"{self.codes.dtype} {tuple(self.codes.shape)}")
        want = (*self.codes.shape[:-1], 1)
        if tuple(self.scale.shape) != want or tuple(self.lo.shape) != want:
            raise ValueError(f"scale and lo must be {want} (one group per channel and page), got "
                             f"{tuple(self.scale.shape)} and {tuple(self.lo.shape)}")
        _check_meta(self.codes, self.scale, self.lo)

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.codes, self.scale, self.lo

    @property
    def page_size(self) -> int:
        return self.codes.shape[-1] * 8 // self.bits

    @property
    def group_size(self) -> int:
        """Tokens per group (a channel's page)."""
        return self.page_size

    @property
    def meta(self) -> torch.dtype:
        return self.scale.dtype


def part_shape(part: TokenPart | ChannelPart) -> tuple[int, int, int]:
    """``(pages, kv_heads, page_size)`` of a body part, whatever its format."""
    pages, heads = part.codes.shape[:2]
    return pages, heads, part.page_size


@dataclass(frozen=True)
class BodyLayout:
    """What a kernel plan reads of a body: shapes, widths, group sizes, metadata dtypes, and whether
    every tensor is contiguous and 16-byte aligned (the CUDA kernel's vector loads). No tensors:
    hashable, the key of ``rotkv.kernels.plan``'s cache."""

    head_dim: int
    kv_heads: int
    page_size: int
    num_pages: int
    bits: tuple[int, int]
    group_sizes: tuple[int, int]
    metas: tuple[torch.dtype, torch.dtype]
    formats: tuple[str, str]
    aligned: bool
    device_type: str


@dataclass(frozen=True, eq=False)
class PagedBody:
    """The quantized body of one layer's page pool: ``k`` and ``v`` parts over the same pages,
    heads, page size and head_dim (their widths and group sizes may differ; a kernel that needs
    them alike says so in its plan)."""

    k: TokenPart | ChannelPart
    v: TokenPart
    layout: BodyLayout = field(init=False, repr=False)

    def __post_init__(self):
        for name, part, types in (("k", self.k, (TokenPart, ChannelPart)), ("v", self.v, (TokenPart,))):
            if not isinstance(part, types):
                raise TypeError(f"`{name}` must be a body part ({', '.join(t.__name__ for t in types)}), "
                                f"got {type(part).__name__}")
        kc, vc = self.k.codes, self.v.codes
        ks, vs = part_shape(self.k), part_shape(self.v)
        if ks != vs or self.k.head_dim != self.v.head_dim:
            raise ValueError(f"K and V parts must share pages, heads, page size and head_dim, got "
                             f"{ks}/{self.k.head_dim} and {vs}/{self.v.head_dim}")
        if kc.device != vc.device:
            raise ValueError(f"K and V parts must be on one device, got {kc.device} and {vc.device}")
        aligned = all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in self.tensors())
        # the parts never change (a grown pool builds a new body): the layout is worked out once
        object.__setattr__(self, "layout", BodyLayout(
            self.k.head_dim, ks[1], ks[2], ks[0], (self.k.bits, self.v.bits),
            (self.k.group_size, self.v.group_size), (self.k.meta, self.v.meta), (self.k.format, self.v.format),
            aligned, kc.device.type))

    @classmethod
    def zeros(cls, pages: int, kv_heads: int, page_size: int, head_dim: int, bits: tuple[int, int],
              group_size: int, meta: torch.dtype = torch.float16, device: str | torch.device = "cpu") -> PagedBody:
        return cls(*(TokenPart.zeros(pages, kv_heads, page_size, head_dim, b, group_size, meta, device) for b in bits))

    @property
    def parts(self) -> tuple[TokenPart | ChannelPart, TokenPart]:
        return self.k, self.v

    @property
    def bits(self) -> tuple[int, int]:
        return self.k.bits, self.v.bits

    @property
    def group_size(self) -> int:
        """The group size of K and V; a ValueError where they differ."""
        if self.k.group_size != self.v.group_size:
            raise ValueError(f"K and V must share the group size (got {self.k.group_size} and {self.v.group_size})")
        return self.k.group_size

    @property
    def head_dim(self) -> int:
        return self.k.head_dim

    @property
    def num_pages(self) -> int:
        return self.k.codes.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.k.codes.shape[1]

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def device(self) -> torch.device:
        return self.k.codes.device

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(k_codes, k_scale, k_lo, v_codes, v_scale, v_lo)``: the kernels' pointer order."""
        return (*self.k.tensors, *self.v.tensors)


class RefineTier(NamedTuple):
    """One side (keys or values) of a body's refine tier (``rotkv.cache.refine``) as the kernels read it:
    ``ring uint8 [B, pages, H, P, D/4]``, the ``i``-th body page of request ``b`` in slot ``i % pages``;
    a request of ``n`` body pages has its ``refined_pages(n, pages, every)`` newest pages refined
    (``rotkv.quant.refine.refined_pages``: ``min(pages, n)``, or one per ``every`` body pages)."""

    ring: torch.Tensor
    pages: int
    every: int = 0

    @classmethod
    def of(cls, given) -> "RefineTier":
        """A RefineTier from itself or a ``(ring, pages[, every])`` tuple, checked."""
        t = cls(*given)
        if t.pages < 1 or t.every < 0:
            raise ValueError(f"a refine tier needs pages >= 1 and every >= 0, got pages={t.pages}, every={t.every}")
        return t


def check_refine_tiers(refine, refine_values, requests: int,
                       body: PagedBody) -> tuple[RefineTier | None, RefineTier | None]:
    """The key and value sides of a body's refine tier (each a :class:`RefineTier`, a ``(ring, pages[, every])``
    tuple or None) as RefineTiers, checked against ``requests`` rows of ``body``: a side refines INT2 only,
    its ring is ``uint8 [requests, pages, H, P, D/4]``, and the two sides cover the same pages."""
    tiers = tuple(RefineTier.of(t) if t is not None else None for t in (refine, refine_values))
    h, p, d = body.kv_heads, body.page_size, body.k.head_dim
    for side, t, width in (("keys", tiers[0], body.bits[0]), ("values", tiers[1], body.bits[1])):
        if t is None:
            continue
        if width != 2:
            raise ValueError(f"the refine tier refines INT2 {side}, not INT{width}")
        r = t.ring
        if r.dtype != torch.uint8 or r.shape[:2] != (requests, t.pages) or r.shape[2:] != (h, p, d // 4):
            raise ValueError(f"refine ring {tuple(r.shape)} {r.dtype} does not match {requests} requests x {t.pages} "
                             f"pages x ({h}, {p}, {d // 4}) uint8")
    if None not in tiers and tiers[0][1:] != tiers[1][1:]:
        raise ValueError(f"the key and value refine rings cover different pages (pages, every: {tiers[0][1:]}, "
                         f"{tiers[1][1:]})")
    return tiers
