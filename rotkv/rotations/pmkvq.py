"""PM-KVQ allocation (METHODS section 4): per-layer final widths in {2, 4, 8} under a memory budget.

The method's math, from calibration statistics (the driver, rotkv.calibrate.pmkvq, runs the model and
collects each layer's post-RoPE keys, values and their gradients):

1. Sensitivity. In the basis the cache stores, ``K' = (K - mu) R_K`` with gradient ``G_K R_K`` (and
   ``V' = V R_V``, ``G_V R_V``), the first-order loss change of quantizing layer l at b bits is bounded
   by ``s[l, b] = |G'_K * (K' - Q_b(K'))|_1 + |G'_V * (V' - Q_b(V'))|_1``.
2. Allocation. Binary ``x[l, b]``, one width per layer, minimize ``sum s[l, b] x[l, b]`` subject to
   ``sum cost[b] x[l, b] <= L * budget`` with ``cost[b]`` the body's bits per element at b bits
   (codes and metadata): an integer program for ``scipy.optimize.milp``.
"""

from __future__ import annotations

import numpy as np

from rotkv.quant.quantizer import body_bits_per_element, fake_quantize
from rotkv.quant.widths import WIDTHS  # noqa: F401 (the widths a layer may get; re-exported)
from rotkv.rotations.base import LayerRotation


def _stored_basis(rot: LayerRotation, k, v, gk, gv):
    """(K', V', G'_K, G'_V) in the basis the cache quantizes; all ``[H, T, D]`` float32."""
    kr, vr = rot.keys(k), rot.values(v)
    gkr = gk if rot.R_K is None else gk @ rot.query_matrix  # dL/dK' = dL/dK R_Q (K = K' R_Q^T + mu; R_Q = R_K unless scaled)
    gvr = gv if rot.R_V is None else gv @ rot.R_V
    return kr, vr, gkr, gvr


def layer_sensitivity(rot: LayerRotation, k, v, gk, gv, group: int, clip_k: float, clip_v: float) -> list[float]:
    """``s[b]`` for b in WIDTHS from one layer's ``k, v, gk, gv [H, T, D]``."""
    kr, vr, gkr, gvr = _stored_basis(rot, k, v, gk, gv)
    out = []
    for b in WIDTHS:
        ek = kr - fake_quantize(kr, b, group, clip_k)
        ev = vr - fake_quantize(vr, b, group, clip_v)
        out.append(float((gkr * ek).abs().sum() + (gvr * ev).abs().sum()))
    return out


def width_cost(group: int) -> np.ndarray:
    """Body bits per element at each width (codes plus lo/scale as the fixed quantizer stores them)."""
    return np.array([body_bits_per_element(b, group) for b in WIDTHS])


def allocate(sens: np.ndarray, budget_bpe: float, group: int) -> np.ndarray:
    """Final widths ``[L]`` minimizing summed sensitivity with mean body bits per element <= budget_bpe."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    n_layers, n_w = sens.shape
    cost = width_cost(group)
    if budget_bpe < cost.min() - 1e-9:
        raise ValueError(f"`budget_bpe` {budget_bpe} is below the cheapest width's {cost.min()} bits per element")
    # scale the objective: raw sensitivities span many decades
    c = (sens / max(sens.max(), 1e-30)).reshape(-1)
    one_each = np.kron(np.eye(n_layers), np.ones(n_w))
    total = np.tile(cost, n_layers)[None]
    res = milp(c, integrality=np.ones_like(c), bounds=Bounds(0, 1),
               constraints=[LinearConstraint(one_each, 1, 1), LinearConstraint(total, -np.inf, n_layers * budget_bpe + 1e-9)])
    if not res.success:
        raise RuntimeError(f"milp failed: {res.message}")
    x = np.round(res.x).reshape(n_layers, n_w)
    return np.array(WIDTHS)[x.argmax(1)]
