"""The CUDA INT2 decode body kernel (``cuda/int2_decode.cu``): build, load, launch.

The kernel is compiled with ``nvcc`` on first use (about 15 s) into
``$ROTKV_CACHE_DIR`` (default ``~/.cache/rotkv``), keyed by the source's hash and the GPU's
architecture, and loaded with ``ctypes``: no PyTorch extension build, no headers beyond CUDA's.
Where there is no ``nvcc``, no GPU of compute capability 8.0 or newer, or a shape it does not
cover, :func:`supported` says why and :func:`rotkv.kernels.decode.decode_attention` uses the
Triton body kernel instead.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from rotkv.kernels import nvcc as nvcc_build

SOURCE = Path(__file__).parent / "cuda" / "int2_decode.cu"
_nvcc = nvcc_build.nvcc_path
_arch = nvcc_build.arch
cache_dir = nvcc_build.cache_dir


def build(device: torch.device | None = None, variant: tuple = (128, 2, 2, 4)) -> ctypes.CDLL:
    """Compile (once per source, architecture and variant) and load one kernel instantiation.

    variant = (head_dim, groups per head, tiles per softmax step, min blocks per SM).
    """
    device = device or torch.device("cuda", torch.cuda.current_device())
    macros = {f"ROTKV_{n}": v for n, v in zip(("D", "NG", "TILES", "MINB"), variant)}
    return nvcc_build.load(SOURCE, "int2_decode", macros, device, True, _setup)


def _compile_and_load(nvcc: str, arch: str, tag: str, key: str, variant: tuple) -> ctypes.CDLL:
    """nvcc the source into the cache unless it is there (rotkv.kernels.nvcc); load it (uncached in
    the process: build() is the entry point, this is the loader's own path for the tests)."""
    macros = {f"ROTKV_{n}": v for n, v in zip(("D", "NG", "TILES", "MINB"), variant)}
    out = nvcc_build.compile_library(nvcc, SOURCE, "int2_decode", macros, arch, key, fast_math=True)
    lib = ctypes.CDLL(str(out))
    _setup(lib)
    return lib


def _setup(lib: ctypes.CDLL) -> None:
    fn = lib.rotkv_int2_decode
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_int] * 4 + [ctypes.c_void_p] * 13 + [ctypes.c_int] * 7
                   + [ctypes.c_float, ctypes.c_void_p])


def supported(q: torch.Tensor, body: tuple, rep: int) -> str | None:
    """None if the CUDA body kernel covers this call, else the reason it does not."""
    if not q.is_cuda:
        return "not on CUDA"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "needs compute capability 8.0+ (mma.sync int8 m16n8k32, movmatrix)"
    d = q.shape[-1]
    codes, scale = body[0], body[1]
    ng = scale.shape[-1]
    if d not in (64, 128, 256):
        return f"head_dim {d} not in (64, 128, 256)"
    if d % ng or (d // ng) % 32:
        return f"group_size {d // max(ng, 1)} is not a multiple of 32"
    if codes.shape[2] % 16:
        return f"page size {codes.shape[2]} is not a multiple of 16"
    if rep > 8:
        return f"GQA group {rep} > 8"
    if codes.shape[0] * codes.shape[1] * codes.shape[2] >= 2**32:
        return "the pool has 2^32 or more token rows (the kernel indexes rows in 32 bits)"
    for t in body:
        if not t.is_contiguous() or t.data_ptr() % 16:
            return "body tensors must be contiguous and 16-byte aligned"
    if _nvcc() is None:
        return "nvcc not found"
    return None


def body_partials(q: torch.Tensor, body: tuple, table: tuple, o_part: torch.Tensor, m_part: torch.Tensor,
                  l_part: torch.Tensor, n_splits: int, tokens_per_split: int, qk_scale: float,
                  tiles: int = 2, min_blocks: int = 4) -> None:
    """Write partials ``[:, :, :n_splits]`` of ``o/m/l_part`` for the INT2 body.

    q ``[B, Hq, D]`` bf16 contiguous; ``tokens_per_split`` a multiple of ``16 * tiles``.
    """
    b_sz, hq, d = q.shape
    h, p, ng = body[0].shape[1], body[0].shape[2], body[1].shape[-1]
    lib = build(q.device, (d, ng, tiles, min_blocks))
    indptr, indices, last = (t.to(torch.int32).contiguous() for t in table)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    rc = lib.rotkv_int2_decode(d, ng, tiles, min_blocks, q.data_ptr(), *(t.data_ptr() for t in body),
                               indptr.data_ptr(), indices.data_ptr(), last.data_ptr(),
                               o_part.data_ptr(), m_part.data_ptr(), l_part.data_ptr(),
                               b_sz, h, hq, p, o_part.shape[2], n_splits, tokens_per_split, qk_scale, stream)
    if rc != 0:
        raise RuntimeError(f"rotkv_int2_decode failed with code {rc}")
