"""A key scaling in the query eigenbasis, applied before OSCAR's rotation (an artifact's ``k_scale``).

A key is stored as ``(k - mu) S R_K`` and read by the query ``q S^-T R_K``; the scores do not change
(``S R_K (S^-T R_K)^T = I``). ``S = U diag(a) U^T`` with ``U, lambda`` the eigenvectors and eigenvalues of
the query covariance ``C_Q`` (the same ``U`` as OSCAR's ``R_K = U H P_br``) and ``kappa_i = u_i^T C_K u_i``
the variance of the mean-centred keys along ``u_i``.

Why: a per-token uniform quantizer after a Hadamard spreads its error evenly over the coordinates, with a
step set by the key's spread, ``sum_i a_i^2 kappa_i``; the score error ``q S^-T . e`` then weighs that step by
``sum_i lambda_i / a_i^2``. Their product is smallest (Cauchy-Schwarz) at ``a_i^2 ~ sqrt(lambda_i / kappa_i)``:
directions the queries read much get a finer share of the range, directions the keys fill but the queries
ignore a coarser one. OSCAR alone is ``a = 1``. ``alpha`` interpolates, ``a_i^2 ~ (lambda_i / kappa_i)^(alpha
/ 2)``: 0 is OSCAR, 1 the optimum of that model; the model ignores which tokens are attended, so the
exponent is chosen end to end (``rotkv calibrate --method oscar-mix-long --key-scale ALPHA``).
The scale of ``a`` is free (the quantizer is per token); it is fixed by ``mean(a^2) = 1``.
"""

from __future__ import annotations

import torch

FLOOR = 1e-8  # eigenvalues and variances below FLOOR * their largest are raised to it (a direction with none)


def key_scale(cq: torch.Tensor, ck: torch.Tensor, alpha: float) -> torch.Tensor:
    """``S [H, D, D]`` float32 from the query covariance ``cq [H, D, D]`` and the centred key covariance
    ``ck [H, D, D]`` (any positive scale; pooled as the rotation's are), for ``alpha`` in [0, 1]."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"`key_scale` (alpha) has to be in [0, 1] but got {alpha}")
    if cq.shape != ck.shape or cq.dim() != 3 or cq.shape[-1] != cq.shape[-2]:
        raise ValueError(f"key_scale: cq and ck have to be [H, D, D] alike but got {tuple(cq.shape)}, {tuple(ck.shape)}")
    cq, ck = cq.double(), ck.double()
    lam, u = torch.linalg.eigh((cq + cq.transpose(-1, -2)) / 2)
    kap = torch.einsum("hdi,hde,hei->hi", u, ck, u)
    lam = lam.clamp_min(FLOOR * lam.amax(-1, keepdim=True).clamp_min(1e-300))
    kap = kap.clamp_min(FLOOR * kap.amax(-1, keepdim=True).clamp_min(1e-300))
    a2 = (lam / kap) ** (alpha / 2)
    a2 = a2 / a2.mean(-1, keepdim=True)
    return torch.einsum("hdi,hi,hei->hde", u, a2.sqrt(), u).float().contiguous()


def scaled_pair(r_k: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the keys' matrix ``S R_K``, the queries' matrix ``S^-T R_K``), both ``[H, D, D]`` float32, from
    ``r_k [H, D, D]`` and ``s [H or 1, D, D]`` (computed in float64)."""
    r64, s64 = r_k.double(), s.double().expand_as(r_k)
    keys = s64 @ r64
    queries = torch.linalg.solve(s64.transpose(-1, -2), r64)  # S^-T R_K
    return keys.float().contiguous(), queries.float().contiguous()
