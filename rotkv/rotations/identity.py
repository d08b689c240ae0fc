"""Data-free rotations that need no statistics: identity ("naive INT2", METHODS 3.1) and a seeded
Haar-random orthogonal matrix (a baseline that mixes like Hadamard but fits any head_dim)."""

from __future__ import annotations

import torch


def build(head_dim: int, layer: int, seed: int) -> None:
    """No rotation (None means identity everywhere a rotation is read)."""
    return None


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A Haar-random orthogonal matrix (QR of a Gaussian with sign fix), reproducible by seed."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def build_random(head_dim: int, layer: int, seed: int) -> torch.Tensor:
    """One reproducible random rotation per layer."""
    return random_orthogonal(head_dim, seed * 100003 + layer)
