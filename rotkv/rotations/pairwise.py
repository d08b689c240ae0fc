"""RoPE-aligned pairwise rotations and block-Hadamard rotations (METHODS 3.5).

Pairwise: one SO(2) rotation per RoPE channel pair ``(i, i + D/2)`` (the rotate_half convention).
It commutes with RoPE, so it can be folded into W_Q and W_K (``rotkv.hf.folding``). The
angle (a choice, the "pooled-variance surrogate") equalizes the two channels' variance, which
minimizes the larger of the two: with pair covariance ``[[a, c], [c, b]]`` that is
``phi = atan2(a - b, 2c) / 2``.

Block-Hadamard of size b: ``kron(I_{D/b}, H_b)`` on consecutive channels; its mixing support is b.
A 2x2 Hadamard has determinant -1, so it does not commute with RoPE: it runs post-RoPE.
"""

from __future__ import annotations

import torch

from rotkv.rotations.base import pooled
from rotkv.rotations.hadamard import hadamard_matrix


def pair_angles(cov: torch.Tensor) -> torch.Tensor:
    """``cov [..., D, D]`` -> angles ``[..., D/2]`` equalizing each pair's two variances."""
    d = cov.shape[-1]
    i = torch.arange(d // 2)
    a, b, c = cov[..., i, i], cov[..., i + d // 2, i + d // 2], cov[..., i, i + d // 2]
    return (0.5 * torch.atan2(a - b, 2 * c)).float()


def pair_matrix(angles: torch.Tensor) -> torch.Tensor:
    """Angles ``[..., D/2]`` -> ``R [..., D, D]`` acting on row vectors (``x' = x R``):
    ``x'_i = x_i cos - x_j sin``, ``x'_j = x_i sin + x_j cos`` for ``j = i + D/2``."""
    half = angles.shape[-1]
    d = 2 * half
    c, s = torch.cos(angles.double()), torch.sin(angles.double())
    r = torch.zeros(*angles.shape[:-1], d, d, dtype=torch.float64)
    i = torch.arange(half)
    r[..., i, i] = c
    r[..., i + half, i + half] = c
    r[..., i + half, i] = -s
    r[..., i, i + half] = s
    return r.float()


def block_hadamard(d: int, block: int) -> torch.Tensor:
    """``kron(I_{d/block}, H_block)`` ``[d, d]``; block 1 is the identity, block d the full Hadamard."""
    if block < 1 or d % block:
        raise ValueError(f"`block` has to divide head_dim ({d}) but got {block}")
    return torch.block_diag(*[hadamard_matrix(block)] * (d // block))


def fit(st, opts) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(R_K, R_V ``[H, D, D]``, the angles) of one layer: pair angles from the plain second moments
    ``C_K`` and ``C_V``; the angles go into the artifact as ``pair_angles_k`` / ``pair_angles_v``."""
    ak = pair_angles(pooled(st.ck, opts.granularity))
    av = pair_angles(pooled(st.cv, opts.granularity))
    return pair_matrix(ak), pair_matrix(av), {"pair_angles_k": ak, "pair_angles_v": av}
