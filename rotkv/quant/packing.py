"""Bit packing of quantization codes into bytes.

Layout is *planar*: with ``per = 8 // bits`` codes per byte, a row of ``N`` codes is split
into ``per`` contiguous planes of ``N / per`` codes, and byte ``j`` holds code
``j + i * N / per`` in bits ``[i * bits, (i + 1) * bits)``. For INT2 and a head of D dims,
byte j holds dims j, j + D/4, j + D/2 and j + 3D/4, so a decode kernel can split the query
into four quarters and dot each against one 2-bit field without reshuffling.

INT3 is bit-sliced: the low two bits of every code as an INT2 row (``N / 4`` bytes, the INT2
layout above), then the high bit as a 1-bit planar row (``N / 8`` bytes), ``3N / 8`` bytes in all; a
kernel that reads INT2 reads the low part unchanged and adds ``4 * high bit``.

These are the reference implementations: the Triton kernels must produce the same bytes.
"""

from __future__ import annotations

import torch

PACKABLE_BITS = (1, 2, 3, 4, 8)


def codes_per_byte(bits: int) -> int:
    if bits not in PACKABLE_BITS or bits == 3:
        raise ValueError(f"`bits` has to be one of {[b for b in PACKABLE_BITS if b != 3]} but got {bits}")
    return 8 // bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., N]`` (values in ``[0, 2**bits)``) into uint8 ``[..., N * bits / 8]``."""
    if bits == 3:
        if codes.shape[-1] % 8:
            raise ValueError(f"the last dimension ({codes.shape[-1]}) must be a multiple of 8 to pack 3-bit codes")
        codes = codes.to(torch.uint8)
        return torch.cat([pack(codes & 3, 2), pack(codes >> 2, 1)], dim=-1)
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
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    if bits == 3:
        m = packed.shape[-1]
        if m % 3:
            raise ValueError(f"3-bit rows have a multiple of 3 bytes, got {m}")
        return unpack(packed[..., : 2 * m // 3], 2) | (unpack(packed[..., 2 * m // 3:], 1) << 2)
    per = codes_per_byte(bits)
    if per == 1:
        return packed
    mask = (1 << bits) - 1
    planes = [(packed >> (bits * i)) & mask for i in range(per)]
    return torch.cat(planes, dim=-1)
