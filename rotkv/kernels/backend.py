"""The codec's kernel path, and the kernel settings for callers outside the cache.

- :func:`token_encode`: ``TokenCodec.encode`` of a page batch ``[nb, H, P, D]`` (already
  rotated) by the fused write kernel; same bytes as ``rotkv.quant.quantizer.quantize``. Whether it
  runs is :func:`rotkv.kernels.plan.plan_encode`'s decision.
- :func:`enabled`, :func:`decode_config`: :func:`rotkv.kernels.plan.kernels_enabled` and
  :func:`rotkv.kernels.plan.decode_config` (the decisions live in plan.py).
"""

from __future__ import annotations

import torch

from rotkv.kernels.plan import decode_config  # noqa: F401 (for callers outside the cache)
from rotkv.kernels.plan import kernels_enabled as enabled  # noqa: F401 (for callers outside the cache)
from rotkv.kernels.plan import plan_encode


def token_encode(x: torch.Tensor, bits: int, group_size: int, clip: float) -> dict[str, torch.Tensor] | None:
    """``x [nb, H, P, D]`` float -> {codes [nb, H, P, D*bits/8], scale, lo [nb, H, P, D/G]}, or None
    where the write kernel does not take it (:func:`rotkv.kernels.plan.plan_encode`)."""
    if not plan_encode(x, bits, group_size):
        return None
    from rotkv.kernels.body import TokenPart
    from rotkv.kernels.write import quant_write

    nb, h, p, d = x.shape
    scale = torch.empty(nb, h, p, d // group_size, dtype=torch.float16, device=x.device)
    part = TokenPart(torch.empty(nb, h, p, d * bits // 8, dtype=torch.uint8, device=x.device), scale,
                     torch.empty_like(scale), bits, group_size, d)
    rows = x.float().transpose(1, 2).reshape(nb * p, h, d)  # token-major [nb*P, H, D]
    slots = torch.arange(nb * p, device=x.device)
    quant_write(rows, slots, part, clip=clip)
    return {"codes": part.codes, "scale": part.scale, "lo": part.lo}
