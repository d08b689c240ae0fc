"""Asymmetric per-token group quantization (METHODS section 1), the reference implementation.

A *row* is one token's head vector ``[D]``. It is optionally clipped at a per-row quantile of
``|x|``, then split into ``D / G`` groups of ``G`` consecutive dims; each group gets
``lo = min`` and ``scale = (max - lo) / (2**bits - 1)``, stored as fp16 (2 and 4 bits) or
fp32 (8 bits). The metadata is rounded to its storage dtype *before* the codes are computed
(``lo`` down, ``scale`` up, so ``[lo, lo + (2**bits - 1) * scale]`` still covers the group),
so that what is tested is exactly what is stored.

Shapes: ``x [..., D]`` -> ``QuantizedRows(codes [..., D * bits / 8] uint8 (planar packed),
scale [..., D / G], lo [..., D / G])``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rotkv.quant.packing import pack, unpack
from rotkv.quant.widths import BY_BITS, QUANT_WIDTHS

SUPPORTED_BITS = QUANT_WIDTHS


META_DTYPES = {"float16": torch.float16, "float8": torch.float8_e4m3fn, "float32": torch.float32}


def meta_dtype(bits: int, meta: str | None = None) -> torch.dtype:
    """The metadata dtype: ``meta`` by name, else fp16 for 2 and 4 bits and fp32 for 8 (fp16 ``lo``
    alone moves INT8 values by many steps). ``float8`` is e4m3: 8 bits each for scale and lo."""
    if meta is not None:
        if meta not in META_DTYPES:
            raise ValueError(f"`meta` has to be one of {list(META_DTYPES)} but got {meta!r}")
        return META_DTYPES[meta]
    return META_DTYPES[BY_BITS[bits].meta] if bits in BY_BITS else (torch.float16 if bits <= 4 else torch.float32)


def _step(t: torch.Tensor, up: bool) -> torch.Tensor:
    """The next representable value of ``t``'s dtype towards +inf (``up``) or -inf."""
    if t.dtype != torch.float8_e4m3fn:
        return torch.nextafter(t, torch.full_like(t, float("inf") if up else float("-inf")))
    b = t.view(torch.uint8).to(torch.int16)
    neg, mag = b >= 128, b & 127
    # away from zero on the side we move to, towards zero on the other; +-0 steps to the smallest subnormal
    away = (neg & ~torch.tensor(up)) | (~neg & torch.tensor(up))
    mag2 = torch.where(away, mag + 1, mag - 1)
    sign = torch.where(mag == 0, torch.full_like(b, 0 if up else 128), b & 128)
    mag2 = torch.where(mag == 0, torch.ones_like(mag), mag2)
    return (sign | mag2).to(torch.uint8).view(torch.float8_e4m3fn)


def _round_dir(x: torch.Tensor, dt: torch.dtype, up: bool) -> torch.Tensor:
    """``x`` (float32) in ``dt``, rounded towards +inf (``up``) or -inf."""
    y = x.to(dt)
    wrong = y.float() < x if up else y.float() > x
    if wrong.any():
        y = torch.where(wrong, _step(y, up), y)
    return y


def check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"`bits` has to be one of {list(SUPPORTED_BITS)} but got {bits}")


def check_group(group_size: int, head_dim: int) -> None:
    if group_size <= 0 or head_dim % group_size:
        raise ValueError(
            f"`group_size` ({group_size}) must be a positive divisor of head_dim ({head_dim}); "
            f"allowed: {[g for g in range(1, head_dim + 1) if head_dim % g == 0]}"
        )


def clip_rows(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Clamp each row to ``[-t, t]`` with ``t = sorted(|x|)[int(ratio * D)]`` (0-based).

    ``ratio >= 1`` means no clipping. At D = 64, ratio 0.96 gives index 61: the 2 largest
    magnitudes of the row are clipped.
    """
    if ratio >= 1.0:
        return x
    if not 0.0 < ratio:
        raise ValueError(f"clip ratio must be in (0, 1], got {ratio}")
    d = x.shape[-1]
    k = int(ratio * d)  # 0-based index into the ascending sort
    t = torch.kthvalue(x.abs(), k + 1, dim=-1, keepdim=True).values
    return torch.minimum(torch.maximum(x, -t), t)


def _round_meta(lo: torch.Tensor, hi: torch.Tensor, bits: int, meta: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round lo down and scale up to the metadata dtype; returns (scale, lo) in that dtype."""
    dt = meta_dtype(bits, meta)
    levels = (1 << bits) - 1
    lo_s = _round_dir(lo, dt, up=False)
    scale_s = _round_dir((hi - lo_s.float()) / levels, dt, up=True)
    if not (torch.isfinite(lo_s.float()).all() and torch.isfinite(scale_s.float()).all()):
        raise ValueError(
            f"values exceed the range of the {dt} quantization metadata (|x| up to "
            f"{max(lo.abs().max().item(), hi.abs().max().item()):.3g}); use bits=8 (fp32 metadata)"
        )
    return scale_s, lo_s


@dataclass
class QuantizedRows:
    """Packed codes and metadata of quantized rows; see the module docstring for shapes."""

    codes: torch.Tensor
    scale: torch.Tensor
    lo: torch.Tensor
    bits: int
    group_size: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.lo))


def quantize(x: torch.Tensor, bits: int, group_size: int, clip: float = 1.0, meta: str | None = None) -> QuantizedRows:
    """Quantize rows ``x [..., D]`` per group of ``group_size`` dims; see the module docstring.
    ``meta``: the metadata dtype by name (``float16``, ``float8``, ``float32``); None: by ``bits``."""
    check_bits(bits)
    d = x.shape[-1]
    check_group(group_size, d)
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantize NaN or Inf: the key/value states contain non-finite values")
    xf = clip_rows(x.float(), clip)
    g = xf.reshape(*xf.shape[:-1], d // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale, lo_s = _round_meta(lo, hi, bits, meta)
    sf, lf = scale.float().unsqueeze(-1), lo_s.float().unsqueeze(-1)
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))  # constant group: every code is 0, x_hat = lo
    codes = torch.round((g - lf) / safe).clamp_(0, (1 << bits) - 1).to(torch.uint8)
    return QuantizedRows(pack(codes.reshape(xf.shape), bits), scale, lo_s, bits, group_size)


def dequantize(q: QuantizedRows, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``QuantizedRows`` -> ``x_hat [..., D]`` with ``x_hat = code * scale + lo`` (in fp32, then ``dtype``)."""
    codes = unpack(q.codes, q.bits).float()
    d = codes.shape[-1]
    g = codes.reshape(*codes.shape[:-1], d // q.group_size, q.group_size)
    x = g * q.scale.float().unsqueeze(-1) + q.lo.float().unsqueeze(-1)
    return x.reshape(codes.shape).to(dtype)


def fake_quantize(x: torch.Tensor, bits: int, group_size: int, clip: float = 1.0, meta: str | None = None) -> torch.Tensor:
    """Quantize then dequantize, in ``x``'s dtype (for calibration and error studies)."""
    return dequantize(quantize(x, bits, group_size, clip, meta), x.dtype)


def body_bits_per_element(bits: int, group_size: int, meta: str | None = None) -> float:
    """Nominal bits per element of the quantized body: codes plus scale and lo per group."""
    meta_bits = 2 * torch.finfo(meta_dtype(bits, meta)).bits
    return bits + meta_bits / group_size
