"""The CUDA quantize-on-write kernel (``cuda/quant_write.cu``): build, launch (what it covers:
``rotkv.kernels.plan``).

Same contract as the Triton kernel (:func:`rotkv.kernels.write.quant_write`, which dispatches
here): ``x [T, H, D]`` -> optional ``(x - mean) R`` -> per-row clip -> per-group INT2/INT4 with
fp16 (or e4m3) scale and lo -> planar pack -> the pool rows at ``slots``. Without rotation its bytes equal
the quantizer's run on the CPU. With rotation the product is a bf16 MMA (``x`` must be bf16, so
it is exact) against R as one bf16 matrix (``rot_precision="bf16"``) or as the sum of two
(``"bf16x2"``, the default: error about 2^-16 of the value, near the fp32 reference).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from rotkv import switches
from rotkv.kernels import nvcc as nvcc_build
from rotkv.kernels.body import TokenPart

SOURCE = Path(__file__).parent / "cuda" / "quant_write.cu"
PRECISIONS = {"bf16": 1, "bf16x2": 2}
DTYPES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
SMEM_LIMIT = 227 * 1024  # opt-in shared memory per block on sm_90 (the rotation keeps R there)


def smem(d: int, split: int, warps: int) -> int:
    return split * d * (d + 8) * 2 + warps * 16 * (d + 4) * 4


def default_warps(d: int, rot_precision: str, rotate: bool) -> int:
    """Warps per block of the rotating kernel: 4 with R as two bf16 parts, 8 with one, where R and the
    product tiles fit in shared memory (docs/kernel-notes.md)."""
    if rotate and rot_precision == "bf16" and smem(d, 1, 8) <= SMEM_LIMIT:
        return 8
    return 4


def _setup(lib: ctypes.CDLL) -> None:
    fn = lib.rotkv_quant_write
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_int] * 7 + [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong]
                   + [ctypes.c_void_p] * 6 + [ctypes.c_int] * 5 + [ctypes.c_void_p])


def variant_macros(d: int, g: int, bits: int, split: int, warps: int, meta8: bool = False) -> dict[str, int]:
    """The macros of one variant, in the loader's order (``rotkv.kernels.prebuild`` names the same)."""
    return {"ROTKV_D": d, "ROTKV_G": g, "ROTKV_BITS": bits, "ROTKV_SPLIT": split, "ROTKV_NW": warps,
            "ROTKV_META8": int(meta8)}


def build(device: torch.device, d: int, g: int, bits: int, split: int, warps: int, meta8: bool = False) -> ctypes.CDLL:
    """The library of one variant; ``meta8``: scale and lo stored as e4m3 bytes (``ROTKV_META8``)."""
    macros = variant_macros(d, g, bits, split, warps, meta8)
    sw = switches.get()  # build variants that benchmarks/bench_write.py compares (ROTKV_TUNING write_redux, ...)
    for name, value in (("REDUX", sw.write_redux), ("FASTDIV", sw.write_fastdiv)):
        if value is not None:
            macros[f"ROTKV_{name}"] = int(value)
    # no -use_fast_math: the clip, the fp16 rounding and the code division are IEEE, as the reference
    return nvcc_build.load(SOURCE, "quant_write", macros, device, False, _setup)


def launch(x: torch.Tensor, slots: torch.Tensor, part: TokenPart, rot: torch.Tensor | None, mean: torch.Tensor | None,
           clip_r: int, rot_precision: str = "bf16x2", num_warps: int = 4, blocks_per_head: int = 0) -> None:
    """Run the kernel (the write plan chose it: ``rotkv.kernels.plan.plan_write``). ``rot [H, D, D]``,
    ``mean [H, D]``."""
    t, h, d = x.shape
    bits, g = part.bits, part.group_size
    codes, scale, lo = part.tensors
    split = PRECISIONS[rot_precision] if rot is not None else 1
    meta8 = part.meta == torch.float8_e4m3fn
    lib = build(x.device, d, g, bits, split, num_warps, meta8)
    mu = None
    if rot is not None:
        rot = rot.to(device=x.device, dtype=torch.float32).contiguous()
        if mean is not None:  # (x - mu) R = x R - mu R: x stays bf16 (exact in the MMA)
            mu = torch.einsum("hd,hde->he", mean.to(device=x.device, dtype=torch.float32), rot).contiguous()
    elif mean is not None:
        mu = mean.to(device=x.device, dtype=torch.float32).contiguous()
    slots = slots.to(device=x.device, dtype=torch.int64).contiguous()
    stream = torch.cuda.current_stream(x.device).cuda_stream
    rc = lib.rotkv_quant_write(d, g, bits, split, num_warps, int(meta8), DTYPES[x.dtype], x.data_ptr(), x.stride(0),
                               x.stride(1), None if rot is None else rot.data_ptr(),
                               None if mu is None else mu.data_ptr(), slots.data_ptr(), codes.data_ptr(),
                               scale.data_ptr(), lo.data_ptr(), t, h, codes.shape[2], clip_r, blocks_per_head, stream)
    if rc != 0:
        raise RuntimeError(f"rotkv_quant_write failed with code {rc}")
