"""The code widths rotkv knows, in one table: who may store each, and which kernels read it.

Everything that lists widths (config validation, the codecs, the kernels and their plans, CLI
choices) reads the tuples derived here; nothing else spells a width list out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Width:
    bits: int
    body: bool  # a cache body may store it (`bits`, `layer_bits`, calibration)
    key: bool  # a per-layer key width (`k_bits`)
    kernels: bool  # the paged Triton kernels (write, decode, dequant) and the CUDA write kernel read it
    cuda_decode: bool  # the CUDA decode body kernel reads it (K and V)
    # the CUDA decode kernel reads it as keys beside INT2 values (4: its ROTKV_K4 build, behind the cuda_key4 switch)
    cuda_key: bool
    meta: str  # the default metadata dtype of scale and lo


TABLE = (
    Width(2, body=True, key=True, kernels=True, cuda_decode=True, cuda_key=True, meta="float16"),
    # bit-sliced (quant.packing)
    Width(3, body=False, key=True, kernels=False, cuda_decode=False, cuda_key=False, meta="float16"),
    Width(4, body=True, key=True, kernels=True, cuda_decode=False, cuda_key=True, meta="float16"),
    # fp16 `lo` alone would move INT8 values by many steps: fp32 metadata
    Width(8, body=True, key=True, kernels=False, cuda_decode=False, cuda_key=False, meta="float32"),
)
BY_BITS = {w.bits: w for w in TABLE}

QUANT_WIDTHS = tuple(BY_BITS)  # what the quantizer takes
WIDTHS = tuple(w.bits for w in TABLE if w.body)  # (2, 4, 8)
KEY_WIDTHS = tuple(w.bits for w in TABLE if w.key)  # (2, 3, 4, 8)
KERNEL_WIDTHS = tuple(w.bits for w in TABLE if w.kernels)  # (2, 4)
CUDA_DECODE_WIDTHS = tuple(w.bits for w in TABLE if w.cuda_decode)  # (2,)
CUDA_DECODE_KEY_WIDTHS = tuple(w.bits for w in TABLE if w.cuda_key)  # (2, 4)


def check_width(bits: int, name: str = "bits", allowed: tuple[int, ...] = WIDTHS) -> int:
    """``bits`` if it is in ``allowed``, else a ValueError naming the field and the allowed values."""
    if bits not in allowed:
        raise ValueError(f"`{name}` has to be one of {list(allowed)} but got {bits}")
    return bits
