"""Bit packing of quantization codes into bytes.

Layout is *planar*: with ``per = 8 // bits`` codes per byte, a row of ``N`` codes is split
into ``per`` contiguous planes of ``N / per`` codes, and byte ``j`` holds code
``j + i * N / per`` in bits ``[i * bits, (i + 1) * bits)``. For INT2 and a head of D dims,
byte j holds dims j, j + D/4, j + D/2 and j + 3D/4, so a decode kernel can split the query
into four quarters and dot each against one 2-bit field without reshuffling.

These are the reference implementations: the Triton kernels must produce the same bytes.
"""

from __future__ import annotations

import torch

PACKABLE_BITS = (2, 4, 8)


def codes_per_byte(bits: int) -> int:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"`bits` has to be one of {list(PACKABLE_BITS)} but got {bits}")
    return 8 // bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., N]`` (values in ``[0, 2**bits)``) into uint8 ``[..., N * bits / 8]``."""
    per = codes_per_byte(bits)
    n = codes.shape[-1]
    if n % per:
        raise ValueError(f"the last dimension ({n}) must be a multiple of {per} to pack {bits}-bit codes")
    codes = codes.to(torch.uint8)
    if per == 1:
        return codes.contiguous()
    planes = codes.reshape(*codes.shape[:-1], per, n // per)
    out = planes[..., 0, :].clone()
    for i in range(1, per):
        out |= planes[..., i, :] << (bits * i)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack`: uint8 ``[..., M]`` -> uint8 codes ``[..., M * 8 / bits]``."""
    per = codes_per_byte(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    if per == 1:
        return packed
    mask = (1 << bits) - 1
    planes = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.cat(planes, dim=-1)
