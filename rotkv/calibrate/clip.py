"""Clip-ratio search: per layer, c_K and c_V on a grid, against held-out attention-output error after W_O.

Key and value errors add (nearly) independently, so c_K is searched with values unquantized and
c_V with keys unquantized: 2 x len(grid) evaluations per layer instead of len(grid)^2.
"""

from __future__ import annotations

from rotkv.calibrate.error import output_error
from rotkv.rotations.base import LayerRotation

GRID = (1.0, 0.98, 0.96, 0.94, 0.92, 0.90, 0.875, 0.85)


def search_layer(samples, rot: LayerRotation, w_o, bits: int, group: int, sink: int, scaling: float,
                 grid=GRID) -> tuple[float, float]:
    """The (c_K, c_V) of ``grid`` with the lowest held-out error for one layer."""
    best = []
    for which in ("k", "v"):
        errs = {c: output_error(samples, rot, w_o, bits, group, clip_k=c if which == "k" else 1.0,
                                clip_v=c if which == "v" else 1.0, sink=sink, scaling=scaling,
                                quant_k=which == "k", quant_v=which == "v") for c in grid}
        best.append(min(errs, key=errs.get))
    return best[0], best[1]
