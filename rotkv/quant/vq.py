"""Product quantization of key rows with calibrated codebooks (OSCAR's PQ keys, CommVQ's spirit).

A row ``x [D]`` (one token's stored key, centred and rotated) is divided by a per-(layer, KV head)
coordinate scale ``sigma [D]`` (calibrated) and by its own RMS ``s`` (stored, fp16); the normalized row is cut
into ``D / m`` sub-vectors of ``m`` dims, each replaced by the index of its nearest centroid in a per-(layer,
KV head) codebook ``C [2^c, m]`` (c bits per sub-vector, shared by the sub-vector positions). Decoding is
``x_hat = s * sigma * concat(C[code_j])``. With m = 4 and c = 8: 2 bits per element for the codes plus 16/D
for the scale (2.25 at D = 64, against INT2's 2.5 with fp16 scale and lo per 64). The codebooks and sigma are
the only other storage (``(2^c * m + D) * 2`` bytes per layer and head).

:func:`kmeans` fits a codebook; this is the reference (CPU) implementation.
"""

from __future__ import annotations

import torch


def _check(codebook: torch.Tensor, sigma: torch.Tensor, d: int) -> tuple[int, int]:
    k, m = codebook.shape[-2:]
    if d % m:
        raise ValueError(f"the sub-vector size ({m}) has to divide head_dim ({d})")
    if k > 256:
        raise ValueError(f"codebooks of at most 256 centroids (uint8 codes), got {k}")
    if sigma.shape[-1] != d:
        raise ValueError(f"`sigma` has {sigma.shape[-1]} entries, head_dim is {d}")
    return k, m


def normalize(x: torch.Tensor, sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., H, T, D]``, ``sigma [H, D]`` -> (normalized rows, the stored fp16 row scale ``[..., H, T]``)."""
    y = x.float() / sigma.float()[:, None, :]
    s = y.pow(2).mean(-1).sqrt().to(torch.float16)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return y / s.float().unsqueeze(-1), s


def encode_pq(x: torch.Tensor, codebook: torch.Tensor, sigma: torch.Tensor) -> dict[str, torch.Tensor]:
    """``x [..., H, T, D]``, ``codebook [H, K, m]``, ``sigma [H, D]`` -> ``{"codes" [..., H, T, D/m] uint8, "scale" [..., H, T] fp16}``."""
    d = x.shape[-1]
    _, m = _check(codebook, sigma, d)
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantize NaN or Inf: the key/value states contain non-finite values")
    y, s = normalize(x, sigma)
    sub = y.reshape(*y.shape[:-1], d // m, m)  # [..., H, T, S, m]
    cb = codebook.float()
    h = cb.shape[0]
    moved = sub.movedim(-4, 0)  # [H, ..., T, S, m]
    flat = moved.reshape(h, -1, m)
    dist = flat.pow(2).sum(-1, keepdim=True) - 2 * flat @ cb.transpose(-1, -2) + cb.pow(2).sum(-1)[:, None, :]
    codes = dist.argmin(-1).to(torch.uint8).reshape(moved.shape[:-1]).movedim(0, -3)  # [..., H, T, S]
    return {"codes": codes, "scale": s}


def decode_pq(parts: dict[str, torch.Tensor], codebook: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_pq`: float32 ``[..., H, T, D]``."""
    codes = parts["codes"].long()  # [..., H, T, S]
    h, k, m = codebook.shape
    head = (torch.arange(h, device=codes.device) * k).reshape(h, 1, 1)
    sub = codebook.float().reshape(h * k, m)[codes + head]  # [..., H, T, S, m]
    y = sub.reshape(*codes.shape[:-1], codes.shape[-1] * m)
    return y * parts["scale"].float().unsqueeze(-1) * sigma.float()[:, None, :]


def kmeans(points: torch.Tensor, k: int, iters: int = 25, seed: int = 0) -> torch.Tensor:
    """Lloyd's k-means of ``points [n, m]`` (float32), initialized from ``k`` random points; ``[k, m]``."""
    g = torch.Generator().manual_seed(seed)
    pts = points.float()
    if pts.shape[0] < k:
        raise ValueError(f"k-means needs at least {k} points, got {pts.shape[0]}")
    c = pts[torch.randperm(pts.shape[0], generator=g)[:k]].clone()
    for _ in range(iters):
        a = (pts.pow(2).sum(-1, keepdim=True) - 2 * pts @ c.T + c.pow(2).sum(-1)).argmin(-1)
        num = torch.zeros_like(c).index_add_(0, a, pts)
        cnt = torch.zeros(k).index_add_(0, a, torch.ones_like(a, dtype=torch.float32))
        empty = cnt == 0
        c = torch.where(empty[:, None], pts[torch.randint(pts.shape[0], (k,), generator=g)], num / cnt.clamp_min(1)[:, None])
    return c


def fit_pq(x: torch.Tensor, sub_dim: int = 4, bits: int = 8, iters: int = 15, max_points: int = 16384,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(codebook ``[H, 2^bits, sub_dim]``, sigma ``[H, D]``) from calibration rows ``x [H, T, D]``."""
    h, t, d = x.shape
    sigma = x.float().pow(2).mean(1).sqrt().clamp_min(1e-6)  # [H, D]
    y, _ = normalize(x, sigma)
    g = torch.Generator().manual_seed(seed)
    books = []
    for i in range(h):
        pts = y[i].reshape(-1, sub_dim)
        if pts.shape[0] > max_points:
            pts = pts[torch.randperm(pts.shape[0], generator=g)[:max_points]]
        books.append(kmeans(pts, 1 << bits, iters, seed + i))
    return torch.stack(books), sigma
