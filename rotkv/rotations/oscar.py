"""OSCAR (METHODS 3.3): ``R = U H P_br`` from the eigenvectors of a covariance, in float64.

``U`` comes from ``torch.linalg.eigh`` (ascending, as the reference); ``P_br`` follows the reference
convention: ``order = argsort(E, descending)``, ``perm[bitrev(i)] = order[i]``, ``P = I[:, perm]``.
After the Hadamard every coordinate carries the same energy ``tr(C)/D``; P_br only reorders the
Hadamard outputs (a no-op for the quantizer when G = D).
"""

from __future__ import annotations

import torch

from rotkv.rotations.base import pooled
from rotkv.rotations.hadamard import hadamard_matrix


def bitrev(i: int, nbits: int) -> int:
    return int(format(i, f"0{nbits}b")[::-1], 2)


def bitrev_permutation(eigvals: torch.Tensor) -> torch.Tensor:
    """``perm [D]`` with ``perm[bitrev(i)] = argsort(E, descending)[i]``."""
    d = eigvals.shape[-1]
    nbits = d.bit_length() - 1
    order = torch.argsort(eigvals, descending=True)
    perm = torch.empty(d, dtype=torch.long)
    for i in range(d):
        perm[bitrev(i, nbits)] = order[i]
    return perm


def oscar_rotation(cov: torch.Tensor) -> torch.Tensor:
    """``cov [..., D, D]`` (symmetric PSD) -> ``R [..., D, D]`` float32 orthogonal, ``R = U H P_br``."""
    cov = cov.double()
    cov = (cov + cov.transpose(-1, -2)) / 2
    e, u = torch.linalg.eigh(cov)
    h = hadamard_matrix(cov.shape[-1]).double()
    flat_e, flat_u = e.reshape(-1, e.shape[-1]), u.reshape(-1, *u.shape[-2:])
    out = []
    for ei, ui in zip(flat_e, flat_u):
        out.append((ui @ h)[:, bitrev_permutation(ei)])
    return torch.stack(out).reshape(cov.shape).float()


def fit(st, opts) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(R_K, R_V ``[H, D, D]``, no extra tensors) of one layer from its statistics ``st``
    (rotkv.calibrate.stats.LayerStats: ``C_Q`` for keys, the ``opts.cs`` form of ``C_S`` for values)."""
    return (oscar_rotation(pooled(st.cq, opts.granularity)),
            oscar_rotation(pooled(st.value_cov(opts.cs), opts.granularity)), {})
