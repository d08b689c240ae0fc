"""Hadamard ("QuaRot-INT2", METHODS 3.2): ``R = H``, data-oblivious.

As a data-free rotation (``CacheSpec.rotation="hadamard"``) it needs no artifact; as a calibration
method (``rotkv calibrate --method hadamard``) the artifact adds the key means and searched clip ratios.
"""

from __future__ import annotations

import torch


def hadamard_matrix(n: int) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of size n (a power of two), float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(
            f"a Hadamard rotation needs head_dim to be a power of two, got {n}; "
            "use rotation='random' or a calibrated artifact instead"
        )
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def build(head_dim: int, layer: int, seed: int) -> torch.Tensor:
    """The data-free rotation of one layer: ``H`` ``[D, D]``."""
    return hadamard_matrix(head_dim)


def fit(st, opts) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(R_K, R_V ``[H, D, D]``, no extra tensors): ``H`` for every KV head, whatever the statistics."""
    h, d = st.cq.shape[0], opts.head_dim
    r = hadamard_matrix(d).expand(h, d, d).contiguous()
    return r, r, {}
