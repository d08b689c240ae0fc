"""Progressive precision (PM-KVQ, METHODS section 4): quantize once at 16 (or 8) bits, then shrink.

A body starts as affine integer codes at ``start`` bits (16: uint16 codes) and later drops one
step at a time, 16 -> 8 -> 4 -> 2, by a right shift on the integer codes alone: the original
values are gone by then.

**Equivalent right shift** (the default). From 2c to c bits, ``new = round(code / (2^c + 1))``,
computed as ``(code + 2^(c-1)) // (2^c + 1)`` (2^c + 1 is odd: no ties). Because
``(2^(2c) - 1) / (2^c + 1) = 2^c - 1``, every c-bit level is an old level, and the result equals
direct c-bit quantization of the same data over the same ``[lo, hi]``. ``scale * (2^c + 1)`` is
not exact in fp16, so ``lo`` and ``scale`` are never touched: an integer multiplier ``M``
(1, 257, 257*17, 257*17*5) grows instead, and ``x_hat = lo + (code * M) * scale / div``.

Where the scale lives (``anchor``):
- ``"start"`` (the spec's layout): ``scale`` is the start width's step, fp32 like ``lo``
  (fp16 metadata cannot hold a 16-bit grid); ``div = 1``. Metadata costs 64 bits per group
  at every width: 3.0 bits per element at 2 bits and G = 64.
- ``"final"``: the layer's final width F is known up front (it is allocated offline), so
  ``scale`` is the F-bit step ``S_F``, stored as direct F-bit quantization stores it (fp16 for
  2 and 4 bits, lo down, scale up) and the start grid is ``S_F / div`` with the integer
  ``div = (2^start - 1) / (2^F - 1)`` (21845 for 16 -> 2). The grid at F is then exactly the one
  fixed F-bit quantization uses, and so is its metadata cost (2.5 bits per element at 2 bits,
  G = 64). Both anchors shrink by the same integer shift.

The ``"plain"`` (``code >> c``) and ``"rounded"`` (``(code + 2^(c-1)) >> c``, saturated) shifts
are kept for the ablation: both multiply the step by ``2^c`` instead of ``2^c + 1``, so their
grids leave the top of ``[lo, hi]`` uncovered and the plain one is biased down.

Shapes: ``x [..., D]`` -> ``ProgressiveRows(codes, scale [..., D/G], lo [..., D/G])`` with
``codes [..., D]`` uint16 at 16 bits and planar packed uint8 ``[..., D * bits / 8]`` below.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from rotkv.quant.packing import pack, unpack
from rotkv.quant.quantizer import check_group, clip_rows, meta_dtype
from rotkv.quant.widths import WIDTHS

WIDTHS = (16, 8, 4, 2)
START_WIDTHS = (16, 8)
FINAL_WIDTHS = WIDTHS
SHIFTS = ("equivalent", "rounded", "plain")
ANCHORS = ("final", "start")


def levels(bits: int) -> int:
    return (1 << bits) - 1


def check_widths(start: int, final: int) -> None:
    if start not in START_WIDTHS:
        raise ValueError(f"`start_bits` has to be one of {list(START_WIDTHS)} but got {start}")
    if final not in FINAL_WIDTHS or final > start:
        raise ValueError(f"`final_bits` has to be one of {[b for b in FINAL_WIDTHS if b <= start]} but got {final}")


def step_factor(c: int, shift: str) -> int:
    """How many old steps one new step spans when going from 2c to c bits."""
    if shift not in SHIFTS:
        raise ValueError(f"`shift` has to be one of {list(SHIFTS)} but got {shift!r}")
    return (1 << c) + 1 if shift == "equivalent" else 1 << c


def shift_codes(codes: torch.Tensor, c: int, shift: str = "equivalent") -> torch.Tensor:
    """Integer codes at 2c bits -> codes at c bits, integer ops only. ``codes``: any int dtype."""
    x = codes.to(torch.int32)
    if shift == "equivalent":
        return (x + (1 << (c - 1))) // ((1 << c) + 1)
    if shift == "rounded":
        return torch.clamp((x + (1 << (c - 1))) >> c, max=levels(c))
    if shift == "plain":
        return x >> c
    raise ValueError(f"`shift` has to be one of {list(SHIFTS)} but got {shift!r}")


def store_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes ``[..., D]`` -> their storage: uint16 at 16 bits, packed uint8 otherwise."""
    if bits == 16:  # through int16 bit patterns: uint16 has few kernels (CUDA least of all)
        return codes.to(torch.int32).to(torch.int16).view(torch.uint16)
    return pack(codes, bits)


def load_codes(stored: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`store_codes`, as int32 ``[..., D]``."""
    if bits == 16:
        return stored.view(torch.int16).to(torch.int32) & 0xFFFF
    return unpack(stored, bits).to(torch.int32)


@dataclass
class ProgressiveRows:
    """Codes at the current width and the metadata that never changes; see the module docstring."""

    codes: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor
    bits: int
    mult: int
    div: int
    group_size: int
    shift: str = "equivalent"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.lo))


def anchor_div(start: int, final: int, anchor: str) -> int:
    """``div``: 1 when the start step is stored, ``levels(start) / levels(final)`` when the final one is."""
    if anchor not in ANCHORS:
        raise ValueError(f"`anchor` has to be one of {list(ANCHORS)} but got {anchor!r}")
    return levels(start) // levels(final) if anchor == "final" else 1


def anchor_dtype(start: int, final: int, anchor: str) -> torch.dtype:
    """fp16 metadata only for a 2- or 4-bit final anchor; fp32 otherwise (a 16-bit grid needs it)."""
    return meta_dtype(final if anchor == "final" else start)


def grid_meta(lo: torch.Tensor, hi: torch.Tensor, steps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, lo) in ``dtype``, ``lo`` rounded down and ``scale`` up so that ``steps`` scales from
    lo cover hi; with ``steps = levels(bits)`` this is exactly the fixed quantizer's metadata."""
    try:
        lo_s = lo.to(dtype)
        lo_s = torch.where(lo_s.float() > lo, torch.nextafter(lo_s, torch.full_like(lo_s, float("-inf"))), lo_s)
        scale = (hi - lo_s.float()) / steps
        scale_s = scale.to(dtype)
        scale_s = torch.where(scale_s.float() < scale, torch.nextafter(scale_s, torch.full_like(scale_s, float("inf"))), scale_s)
    except (RuntimeError, NotImplementedError):  # a device without nextafter for dtype: the metadata is small
        if lo.device.type == "cpu":
            raise
        scale_s, lo_s = grid_meta(lo.cpu(), hi.cpu(), steps, dtype)
        return scale_s.to(lo.device), lo_s.to(lo.device)
    if not (torch.isfinite(lo_s).all() and torch.isfinite(scale_s).all()):
        raise ValueError(f"values exceed the range of the {dtype} quantization metadata; use a final width of 8 bits")
    return scale_s, lo_s


def round_half_up(u: torch.Tensor, bits: int) -> torch.Tensor:
    # half up, not half to even: exact ties then map the same way through every shift
    return torch.floor(u + 0.5).clamp_(0, levels(bits)).to(torch.int32)


def quantize_progressive(
    x: torch.Tensor,
    start_bits: int = 16,
    final_bits: int = 2,
    group_size: int = 64,
    clip: float = 1.0,
    anchor: str = "final",
    shift: str = "equivalent",
) -> ProgressiveRows:
    """Quantize rows ``x [..., D]`` at ``start_bits`` on a grid that shrinks exactly to ``final_bits``."""
    check_widths(start_bits, final_bits)
    step_factor(2, shift)  # validates `shift`
    if anchor == "final" and shift != "equivalent":
        raise ValueError(f"anchor='final' needs shift='equivalent' (the {shift} shift leaves the final grid); use anchor='start'")
    div = anchor_div(start_bits, final_bits, anchor)
    return quantize_at(x, start_bits, 1, div, anchor_dtype(start_bits, final_bits, anchor), group_size, clip, shift)


def quantize_at(x: torch.Tensor, bits: int, mult: int, div: int, dtype: torch.dtype, group_size: int,
                clip: float = 1.0, shift: str = "equivalent") -> ProgressiveRows:
    """Rows ``x [..., D]`` straight at ``bits`` on a body's grid ``lo + (code * mult) * scale / div``.

    This is how tokens written after a shrink join the body: the same ``mult`` and ``div`` as
    the shifted tokens, their own ``lo`` and ``scale``, a grid that covers their range.
    """
    d = x.shape[-1]
    check_group(group_size, d)
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantize NaN or Inf: the key/value states contain non-finite values")
    g = clip_rows(x.float(), clip).reshape(*x.shape[:-1], d // group_size, group_size)
    scale, lo = grid_meta(g.amin(-1), g.amax(-1), levels(bits) * mult / div, dtype)
    codes = codes_on_grid(g, scale, lo, mult, div, bits).reshape(x.shape)
    return ProgressiveRows(store_codes(codes, bits), scale, lo, bits, mult, div, group_size, shift)


def codes_on_grid(g: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, mult: int, div: int, bits: int) -> torch.Tensor:
    """Codes of groups ``g [..., n, G]`` on the grid ``lo + k * mult * scale / div``, in float64, half up.

    ``scale * mult`` is exact in float64 (24-bit mantissa times a 15-bit integer)."""
    s = scale.double().unsqueeze(-1) * mult
    safe = torch.where(s > 0, s, torch.ones_like(s))  # constant group: every code is 0
    return round_half_up((g.double() - lo.double().unsqueeze(-1)) * div / safe, bits)


def shrink_stored(codes: torch.Tensor, bits: int, shift: str = "equivalent") -> torch.Tensor:
    """Stored codes at ``bits`` -> stored codes at ``bits / 2``: unpack, integer shift, pack."""
    c = bits // 2
    return store_codes(shift_codes(load_codes(codes, bits), c, shift), c)


def shrink(q: ProgressiveRows, final_bits: int = 2) -> ProgressiveRows:
    """One step down (16 -> 8 -> 4 -> 2) by ``q.shift``; refuses to go below ``final_bits``."""
    c = q.bits // 2
    if c < final_bits or c < 2:
        raise ValueError(f"cannot shrink a {q.bits}-bit body below its final width {final_bits}")
    return replace(q, codes=shrink_stored(q.codes, q.bits, q.shift), bits=c, mult=q.mult * step_factor(c, q.shift))


def dequantize_progressive(q: ProgressiveRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x_hat = lo + (code * M) * scale / div``; ``code * M`` is an exact integer, the rest fp32."""
    codes = load_codes(q.codes, q.bits)
    d = codes.shape[-1]
    k = (codes.to(torch.int64) * q.mult).float().reshape(*codes.shape[:-1], d // q.group_size, q.group_size)
    step = q.scale.float().unsqueeze(-1) / q.div
    return (k * step + q.lo.float().unsqueeze(-1)).reshape(codes.shape).to(dtype)


def body_bytes_per_row(head_dim: int, bits: int, group_size: int, meta_bits: int) -> int:
    """Resident bytes of one quantized row ``[D]``: codes plus ``lo`` and ``scale`` per group."""
    return head_dim * bits // 8 + 2 * (head_dim // group_size) * meta_bits // 8


def meta_bits(start_bits: int, final_bits: int, anchor: str) -> int:
    """Bits of each of ``lo`` and ``scale`` as stored under this anchor."""
    return torch.finfo(anchor_dtype(start_bits, final_bits, anchor)).bits
