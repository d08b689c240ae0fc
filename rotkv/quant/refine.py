"""The refinement of a 2-bit code by 2 more bits: a 4-bit grid nested in the 2-bit one.

A 2-bit element reads ``lo + s * h``. Its refinement ``j`` (0..3) places it at
``lo + s * (h + (j - 1.5) / 4)``, the nearest of the four points that split ``h``'s bucket in quarters
(clamped: an element outside the bucket, a clipped one, moves at most ``3/8 s``). The storage that keeps
``j`` for the newest body pages is :mod:`rotkv.cache.refine`; the decode kernel reads it as a second key of
scale ``s / 4`` and minimum ``-3/8 s``.
"""

from __future__ import annotations

import numpy as np
import torch


def refined_pages(counts, pages: int, every: int = 0):
    """How many of a row's newest body pages the refine tier covers, for rows of ``counts`` body pages:
    ``min(pages, counts)``, or with a size rule (``every`` > 0) ``min(pages, ceil(counts / every))``, one
    refined page per ``every`` body pages. An int for an int, else an int64 array. The decode kernel
    computes the same in integers (``rotkv.kernels.decode``)."""
    c = np.asarray(counts, dtype=np.int64)
    out = np.minimum(pages, -(-c // every) if every else c)
    return int(out) if c.ndim == 0 else out


def refine_codes(x: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """The refinement ``j`` (uint8, 0..3, unpacked) of exact values ``x [..., D]`` whose 2-bit reading is
    ``base [..., D]``, with group scales ``scale [..., D / G]``."""
    s = scale.float().repeat_interleave(group_size, -1)
    safe = torch.where(s > 0, s, torch.ones_like(s))  # a constant group reads exactly: any j adds 0
    return torch.round((x.float() - base.float()) / safe * 4 + 1.5).clamp_(0, 3).to(torch.uint8)


def refine_delta(j: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """What the refinement ``j [..., D]`` (unpacked) adds to the 2-bit reading: ``(j - 1.5) / 4 * s``, float32."""
    return (j.float() - 1.5) * 0.25 * scale.float().repeat_interleave(group_size, -1)
