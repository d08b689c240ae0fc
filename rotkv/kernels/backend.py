"""When the cache uses the GPU kernels, and with which settings (the kernels never see the cache).

- :func:`enabled`: kernels for tensors on this device (CUDA, triton installed, ``ROTKV_KERNELS``
  not "0"); otherwise the cache runs its PyTorch reference code.
- :func:`token_encode`: ``TokenCodec.encode`` of a page batch ``[nb, H, P, D]`` (already
  rotated) by the fused write kernel; same bytes as ``rotkv.quant.quantizer.quantize``.
- :func:`decode_config`: the cache's ``DecodeConfig`` (``ROTKV_DECODE_BACKEND``).
"""

from __future__ import annotations

import functools
import os

import torch

from rotkv.kernels.plan import part_reason

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # the kernels extra is not installed
    HAVE_TRITON = False


def enabled(t: torch.Tensor) -> bool:
    """Use the kernels for tensors on ``t``'s device?"""
    return HAVE_TRITON and t.is_cuda and os.environ.get("ROTKV_KERNELS", "1") != "0"


def token_encode(x: torch.Tensor, bits: int, group_size: int, clip: float) -> dict[str, torch.Tensor] | None:
    """``x [nb, H, P, D]`` float -> {codes [nb, H, P, D*bits/8], scale, lo [nb, H, P, D/G]} or None
    (a width the kernels read, ``rotkv.quant.widths.KERNEL_WIDTHS``)."""
    if not enabled(x) or part_reason(bits, torch.float16) or x.dim() != 4 or x.shape[-1] % group_size:
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


def decode_config(score: str | None = None):
    """DecodeConfig for the cache's decode steps; ``ROTKV_DECODE_BACKEND`` = auto | cuda | triton;
    ``score`` (else ``ROTKV_DECODE_SCORE``) = auto | bf16 | int8; ``ROTKV_DECODE_CONFIG``: other fields
    of :class:`~rotkv.kernels.plan.DecodeConfig` as ``name=value,...`` (tuning, e.g.
    ``wide_target_programs=4096,wide_num_warps=2``)."""
    return _decode_config_for(os.environ.get("ROTKV_DECODE_BACKEND", "auto"),
                              score or os.environ.get("ROTKV_DECODE_SCORE", "auto"),
                              os.environ.get("ROTKV_DECODE_CONFIG", ""))


def parse_config_overrides(text: str) -> dict:
    """``"name=value,..."`` -> DecodeConfig fields, each value parsed as its field's type (int, bool:
    0/1/true/false, str; ``none`` for an optional field). ValueError names an unknown field or a bad value."""
    import dataclasses

    from rotkv.kernels.plan import DecodeConfig

    fields = {f.name: f for f in dataclasses.fields(DecodeConfig)}
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, eq, raw = item.partition("=")
        name, raw = name.strip(), raw.strip()
        if not eq or name not in fields or name in ("backend", "score"):
            raise ValueError(f"ROTKV_DECODE_CONFIG: {item!r} is not name=value with a DecodeConfig field "
                             f"(backend and score have their own variables); fields: "
                             f"{sorted(n for n in fields if n not in ('backend', 'score'))}")
        default = fields[name].default
        try:
            if raw.lower() == "none" and (default is None or name == "cuda_min_blocks"):
                out[name] = None
            elif isinstance(default, bool) or (default is None and name == "use_asm"):
                if raw.lower() not in ("0", "1", "true", "false"):
                    raise ValueError(raw)
                out[name] = raw.lower() in ("1", "true")
            elif isinstance(default, str):
                out[name] = raw
            else:
                out[name] = int(raw)
        except ValueError:
            raise ValueError(f"ROTKV_DECODE_CONFIG: bad value {raw!r} for {name}") from None
    return out


@functools.lru_cache(maxsize=None)
def _decode_config_for(backend: str, score: str = "auto", overrides: str = ""):
    # one config per (backend, score, overrides): decode steps (every layer, every token) do not rebuild
    # and revalidate it
    from rotkv.kernels.plan import DecodeConfig

    if backend not in ("auto", "cuda", "triton"):
        raise ValueError(f"ROTKV_DECODE_BACKEND must be auto, cuda or triton, got {backend!r}")
    if score not in ("auto", "bf16", "int8"):
        raise ValueError(f"the decode score must be auto, bf16 or int8, got {score!r}")
    return DecodeConfig(backend=backend, score=score, **parse_config_overrides(overrides))
