"""Non-uniform b-bit grids per KV head, fitted at calibration (Lloyd-Max; KVQuant's nuq in spirit).

The metadata is the uniform quantizer's (per group ``lo`` and ``scale``, rounded to their storage dtype
so that ``[lo, lo + (2^b - 1) * scale]`` covers the group); only the levels move: code ``c`` decodes to
``lo + (2^b - 1) * scale * grid[c]`` with ``grid`` ``[2^b]`` increasing values in ``[0, 1]`` per KV head (the
uniform grid is ``c / (2^b - 1)``). Encoding picks the nearest level of the normalized value
``u = (x - lo) / ((2^b - 1) * scale)``. The codes are packed as the uniform quantizer's, so the bytes per
token are the same; the grids (``H x 2^b`` fp16 per layer and side) are the only extra storage.

:func:`lloyd_max` fits a grid to samples of ``u`` (optionally weighted), the 1-D k-means that minimizes
the expected squared error in normalized units.
"""

from __future__ import annotations

import torch

from rotkv.quant.packing import pack, unpack
from rotkv.quant.quantizer import _round_meta, check_bits, check_group, clip_rows


def uniform_grid(bits: int) -> torch.Tensor:
    n = 1 << bits
    return torch.arange(n, dtype=torch.float32) / (n - 1)


def check_grid(grid: torch.Tensor, bits: int) -> None:
    if grid.shape[-1] != 1 << bits:
        raise ValueError(f"a {bits}-bit grid has {1 << bits} levels but got {grid.shape[-1]}")
    g = grid.float()
    if (g < 0).any() or (g > 1).any() or (g[..., 1:] < g[..., :-1]).any():
        raise ValueError("grid levels have to be increasing and within [0, 1]")


def _heads_view(grid: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grid [H, n]`` (or ``[n]``) as levels against ``x [..., H, T, D / G, G, 1]``: ``[H, 1, 1, 1, n]``."""
    g = grid.float().to(x.device)
    return g.reshape(-1, 1, 1, 1, g.shape[-1]) if g.dim() == 2 else g


def quantize_grid(x: torch.Tensor, grid: torch.Tensor, bits: int, group_size: int, clip: float = 1.0,
                  meta: str | None = None) -> dict[str, torch.Tensor]:
    """``x [..., H, T, D]``, ``grid [H, 2^b]`` -> ``{"codes", "scale", "lo"}`` as :func:`rotkv.quant.quantizer.quantize`."""
    check_bits(bits)
    check_grid(grid, bits)
    d = x.shape[-1]
    check_group(group_size, d)
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantize NaN or Inf: the key/value states contain non-finite values")
    xf = clip_rows(x.float(), clip)
    g = xf.reshape(*xf.shape[:-1], d // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scale, lo_s = _round_meta(lo, hi, bits, meta)
    span = scale.float().unsqueeze(-1) * ((1 << bits) - 1)
    safe = torch.where(span > 0, span, torch.ones_like(span))
    u = (g - lo_s.float().unsqueeze(-1)) / safe  # [..., H, T, D/G, G]
    lv = _heads_view(grid, g)
    mids = (lv[..., 1:] + lv[..., :-1]) / 2  # decision thresholds between levels
    codes = (u.unsqueeze(-1) > mids).sum(-1).to(torch.uint8)
    return {"codes": pack(codes.reshape(xf.shape), bits), "scale": scale, "lo": lo_s}


def dequantize_grid(parts: dict[str, torch.Tensor], grid: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize_grid`: float32 ``[..., H, T, D]``."""
    codes = unpack(parts["codes"], bits).long()
    d = codes.shape[-1]
    c = codes.reshape(*codes.shape[:-1], d // group_size, group_size)
    g = grid.float().to(codes.device)
    if g.dim() == 2:  # per head: code c of head h reads level g[h, c]
        h, n = g.shape
        head = torch.arange(h, device=c.device).reshape(h, 1, 1, 1) * n
        lv = g.reshape(-1)[c + head]
    else:
        lv = g[c]
    span = parts["scale"].float().unsqueeze(-1) * ((1 << bits) - 1)
    return (parts["lo"].float().unsqueeze(-1) + span * lv).reshape(codes.shape)


def normalized_samples(x: torch.Tensor, bits: int, group_size: int, clip: float = 1.0, meta: str | None = None) -> torch.Tensor:
    """``u`` of every element of ``x [..., D]`` in its group's stored range (what :func:`lloyd_max` fits)."""
    d = x.shape[-1]
    xf = clip_rows(x.float(), clip)
    g = xf.reshape(*xf.shape[:-1], d // group_size, group_size)
    scale, lo_s = _round_meta(g.amin(-1), g.amax(-1), bits, meta)
    span = scale.float().unsqueeze(-1) * ((1 << bits) - 1)
    u = (g - lo_s.float().unsqueeze(-1)) / torch.where(span > 0, span, torch.ones_like(span))
    return u.reshape(xf.shape).clamp(0, 1)


def lloyd_max(u: torch.Tensor, bits: int, weights: torch.Tensor | None = None, iters: int = 50) -> torch.Tensor:
    """The ``2^b`` levels in [0, 1] minimizing ``E[w (u - level(u))^2]`` over samples ``u`` (flattened), from the
    uniform grid; float32 ``[2^b]``, increasing."""
    u = u.reshape(-1).double()
    w = torch.ones_like(u) if weights is None else weights.reshape(-1).double().expand_as(u)
    lv = uniform_grid(bits).double()
    for _ in range(iters):
        mids = (lv[1:] + lv[:-1]) / 2
        c = torch.bucketize(u, mids)
        num = torch.zeros_like(lv).scatter_add_(0, c, w * u)
        den = torch.zeros_like(lv).scatter_add_(0, c, w)
        new = torch.where(den > 0, num / den.clamp_min(1e-30), lv)
        if torch.allclose(new, lv, atol=1e-7):
            lv = new
            break
        lv = new
    return lv.clamp(0, 1).sort().values.float()
