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
import functools
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "cuda" / "int2_decode.cu"
_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}
_FAILED: dict[str, str] = {}


@functools.lru_cache(maxsize=None)
def _source() -> bytes:
    return SOURCE.read_bytes()


@functools.lru_cache(maxsize=None)
def _nvcc() -> str | None:
    """ROTKV_NVCC, else nvcc on PATH, else $CUDA_HOME/bin/nvcc (looked up once per process)."""
    for cand in (os.environ.get("ROTKV_NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.exists(cand):
            return cand
    return None


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def cache_dir() -> Path:
    return Path(os.environ.get("ROTKV_CACHE_DIR", Path.home() / ".cache" / "rotkv"))


def build(device: torch.device | None = None, variant: tuple = (128, 2, 2, 4)) -> ctypes.CDLL:
    """Compile (once per source, architecture and variant) and load one kernel instantiation.

    variant = (head_dim, groups per head, tiles per softmax step, min blocks per SM).
    """
    device = device or torch.device("cuda", torch.cuda.current_device())
    arch = _arch(device)
    src = _source()  # read once: build() runs on every decode call that may use the kernel
    tag = "-".join(str(v) for v in variant)
    key = hashlib.sha256(src + arch.encode() + tag.encode()).hexdigest()[:16]
    with _LOCK:
        if key in _LIBS:
            return _LIBS[key]
        if key in _FAILED:
            raise RuntimeError(_FAILED[key])
        nvcc = _nvcc()
        if nvcc is None:
            _FAILED[key] = "nvcc not found (set ROTKV_NVCC or CUDA_HOME)"
            raise RuntimeError(_FAILED[key])
        try:
            lib = _compile_and_load(nvcc, arch, tag, key, variant)
        except (OSError, subprocess.SubprocessError) as e:  # unwritable cache, bad library, ...
            _FAILED[key] = f"building the CUDA kernel failed: {type(e).__name__}: {e}"
            raise RuntimeError(_FAILED[key]) from e
        except RuntimeError as e:
            _FAILED[key] = str(e)
            raise
        _LIBS[key] = lib
        return lib


def _compile_and_load(nvcc: str, arch: str, tag: str, key: str, variant: tuple) -> ctypes.CDLL:
    """nvcc the source into the cache (atomically: a temp file renamed) unless it is there; load it."""
    out = cache_dir() / f"int2_decode-{tag}-{key}-sm{arch}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        macros = [f"-DROTKV_{n}={v}" for n, v in zip(("D", "NG", "TILES", "MINB"), variant)]
        cmd = [nvcc, "-O3", "-std=c++17", "-use_fast_math", "-shared", "-Xcompiler", "-fPIC", *macros,
               f"-gencode=arch=compute_{arch},code=sm_{arch}", "-o", str(tmp), str(SOURCE)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
        os.replace(tmp, out)
    lib = ctypes.CDLL(str(out))
    fn = lib.rotkv_int2_decode
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_int] * 4 + [ctypes.c_void_p] * 13 + [ctypes.c_int] * 7
                   + [ctypes.c_float, ctypes.c_void_p])
    return lib


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
