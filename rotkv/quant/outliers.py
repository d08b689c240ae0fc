"""Dense-and-sparse quantization (KVQuant): the largest-magnitude entries of a page in an fp16 side table.

A page is ``[..., P, D]`` (P tokens of one KV head, D dims). The ``count`` entries of the page with the
largest ``|x|`` are kept exactly in fp16 (``values [..., count]``) with their flat position in the page
(``index [..., count]`` int16, ``token * D + dim``); in the dense part they are replaced by 0 (the middle of
a centred, rotated row), so the rows' ranges shrink, and the dense part is quantized as usual. Decoding
dequantizes the dense part and writes the fp16 values back at their positions.

Side-table cost: ``count * (16 + 16)`` bits per page and head, i.e. ``32 * count / (P * D)`` bits per
element (0.31 at 1% of a 16 x 64 page). This is the reference (CPU) implementation.
"""

from __future__ import annotations

import torch


def outlier_count(fraction: float, page_tokens: int, head_dim: int) -> int:
    """Entries per page kept in the side table: ``round(fraction * P * D)``, at least 1."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"the outlier fraction has to be in (0, 1) but got {fraction}")
    return max(1, round(fraction * page_tokens * head_dim))


def split_outliers(x: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., P, D]`` -> (dense ``[..., P, D]`` float32 with the outliers zeroed, values ``[..., count]`` fp16,
    index ``[..., count]`` int16 flat positions in the page)."""
    p, d = x.shape[-2:]
    if not 1 <= count <= p * d:
        raise ValueError(f"`count` has to be in [1, {p * d}] (entries per page) but got {count}")
    if p * d > 32767:
        raise ValueError(f"a page of {p} x {d} entries does not fit int16 positions")
    flat = x.float().reshape(*x.shape[:-2], p * d)
    idx = flat.abs().topk(count, dim=-1).indices
    vals = flat.gather(-1, idx).to(torch.float16)
    dense = flat.scatter(-1, idx, torch.zeros_like(idx, dtype=flat.dtype))
    return dense.reshape(x.shape), vals, idx.to(torch.int16)


def merge_outliers(dense: torch.Tensor, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`split_outliers` on the decoded dense part: ``[..., P, D]`` float32."""
    p, d = dense.shape[-2:]
    flat = dense.float().reshape(*dense.shape[:-2], p * d)
    flat = flat.scatter(-1, index.long(), values.float())
    return flat.reshape(dense.shape)
