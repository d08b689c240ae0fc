"""Means and 95% confidence intervals."""

from __future__ import annotations

import math


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of the normal-approximation 95% interval); the half-width is 0 for n < 2."""
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    m = sum(xs) / n
    if n < 2:
        return m, 0.0
    var = sum((x - m) ** 2 for x in xs) / (n - 1)
    return m, 1.96 * math.sqrt(var / n)


def wilson(k: float, n: int) -> tuple[float, float]:
    """(accuracy, half-width of the Wilson 95% interval) for k successes out of n (k may be fractional)."""
    if n == 0:
        return float("nan"), float("nan")
    z = 1.96
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    lo, hi = centre - half, centre + half
    return p, max(p - lo, hi - p)
