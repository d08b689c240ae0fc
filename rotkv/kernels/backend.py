"""The CUDA hook of the hybrid cache: Triton kernels in place of the PyTorch reference path.

``rotkv.cache`` calls two functions, each of which returns None when it does not apply (CPU
tensors, triton missing, ``ROTKV_KERNELS=0``, a layout the kernels do not cover), and the
caller then runs its reference code:

- :func:`token_encode`: ``TokenCodec.encode`` of a page batch ``[nb, H, P, D]`` (already
  rotated) by the fused write kernel; same bytes as ``rotkv.quant.quantizer.quantize``.
- :func:`attend_decode`: one decode token of one row against its stored tiers and INT2 pages,
  by the split-K decode kernel (the row's pages are read in place: its body tensors are the pool,
  its page list is ``arange``); the new token's own K/V join the bf16 tier.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # the kernels extra is not installed
    HAVE_TRITON = False


def enabled(t: torch.Tensor) -> bool:
    """Use the kernels for tensors on ``t``'s device?"""
    return HAVE_TRITON and t.is_cuda and os.environ.get("ROTKV_KERNELS", "1") != "0"


def token_encode(x: torch.Tensor, bits: int, group_size: int, clip: float) -> dict[str, torch.Tensor] | None:
    """``x [nb, H, P, D]`` float -> {codes [nb, H, P, D/4], scale, lo [nb, H, P, D/G]} or None."""
    if not enabled(x) or bits != 2 or x.dim() != 4 or x.shape[-1] % group_size:
        return None
    from rotkv.kernels.write import quant_write

    nb, h, p, d = x.shape
    codes = torch.empty(nb, h, p, d // 4, dtype=torch.uint8, device=x.device)
    scale = torch.empty(nb, h, p, d // group_size, dtype=torch.float16, device=x.device)
    lo = torch.empty_like(scale)
    rows = x.float().transpose(1, 2).reshape(nb * p, h, d)  # token-major [nb*P, H, D]
    slots = torch.arange(nb * p, device=x.device)
    quant_write(rows, slots, codes, scale, lo, clip=clip)
    return {"codes": codes, "scale": scale, "lo": lo}


def _tier_pages(parts: list[torch.Tensor], page: int) -> tuple[torch.Tensor, int]:
    """Concatenate ``[H, n_i, D]`` tensors into pages ``[npages, H, page, D]`` (zero padded)."""
    x = torch.cat(parts, 1)
    h, n, d = x.shape
    npg = max(1, -(-n // page))
    out = torch.zeros(h, npg * page, d, dtype=torch.bfloat16, device=x.device)
    out[:, :n] = x
    return out.reshape(h, npg, page, d).transpose(0, 1).contiguous(), n


def _decode_config():
    """DecodeConfig for the cache's decode steps; ``ROTKV_DECODE_BACKEND`` = auto | cuda | triton."""
    return _decode_config_for(os.environ.get("ROTKV_DECODE_BACKEND", "auto"))


@functools.lru_cache(maxsize=None)
def _decode_config_for(backend: str):
    # one config per backend: decode steps (every layer, every token) do not rebuild and revalidate it
    from rotkv.kernels.decode import DecodeConfig

    if backend not in ("auto", "cuda", "triton"):
        raise ValueError(f"ROTKV_DECODE_BACKEND must be auto, cuda or triton, got {backend!r}")
    return DecodeConfig(backend=backend)


def attend_decode(layer, row, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                  scaling: float) -> torch.Tensor | None:
    """One row's decode attention: ``q [Hq, 1, D]`` rotated, ``k_new, v_new [H, 1, D]`` rotated.

    ``layer`` is the ``rotkv.cache.layer.HybridLayer`` and ``row`` its ``RowStore``, whose body
    holds TokenCodec INT2 pages (``codes [nb, H, P, D/4]``, ``scale``/``lo [nb, H, P, D/G]``).
    Returns float32 ``[Hq, 1, D]``, or None when the kernel does not apply.
    """
    from rotkv.cache.codecs import TokenCodec

    d = q.shape[-1]
    if not enabled(q) or q.shape[1] != 1:
        return None
    codecs = (layer.key_codec, layer.value_codec)
    if layer.spec.quantized and not all(isinstance(c, TokenCodec) and c.bits == 2 and c.group_size >= d // 4
                                        for c in codecs):
        return None
    from rotkv.kernels.decode import decode_attention

    dev = q.device
    one = lambda *v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    # the bf16 tier: sink, window and the new token (which the reference attends at full precision)
    tk, n = _tier_pages([row.sink_k, row.win_k, k_new], 16)
    tv, _ = _tier_pages([row.sink_v, row.win_v, v_new], 16)
    tier_table = (one(0, tk.shape[0]), torch.arange(tk.shape[0], dtype=torch.int32, device=dev),
                  one(n - (tk.shape[0] - 1) * 16))
    body = table = None
    if row.body_tokens:
        bk, bv = row.body_k, row.body_v
        nb, _, p, _ = bk["codes"].shape
        body = (bk["codes"], bk["scale"], bk["lo"], bv["codes"], bv["scale"], bv["lo"])
        table = (one(0, nb), torch.arange(nb, dtype=torch.int32, device=dev), one(p))
    out = decode_attention(q.transpose(0, 1).float(), body, table, row.body_tokens, (tk, tv), tier_table, n,
                           sm_scale=scaling, cfg=_decode_config())
    return out.transpose(0, 1)  # [Hq, 1, D]
