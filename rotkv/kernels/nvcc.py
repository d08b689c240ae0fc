"""Building rotkv's CUDA sources with ``nvcc`` into small shared libraries loaded by ``ctypes``.

One library per (source, GPU architecture, variant macros), cached in ``$ROTKV_CACHE_DIR``
(default ``~/.cache/rotkv``) under a name keyed by the source's hash, and written atomically (a
temp file renamed), so concurrent processes and a changed source or GPU never load a stale build.
No PyTorch extension build and no headers beyond CUDA's are involved.
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
from typing import Callable

import torch

from rotkv import switches


@functools.lru_cache(maxsize=None)
def nvcc_path() -> str | None:
    """ROTKV_NVCC, else nvcc on PATH, else $CUDA_HOME/bin/nvcc (looked up once per process;
    ``rotkv.switches`` refuses a ROTKV_NVCC that is not an executable file)."""
    sw = switches.get()
    if sw.nvcc:
        return sw.nvcc
    for cand in (shutil.which("nvcc"), os.path.join(sw.cuda_home, "bin", "nvcc")):
        if cand and os.path.exists(cand):
            return cand
    return None


def arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}"


def cache_dir() -> Path:
    return Path(switches.get().cache_dir or Path.home() / ".cache" / "rotkv")


def build_key(source: bytes, arch_: str, tag: str) -> str:
    return hashlib.sha256(source + arch_.encode() + tag.encode()).hexdigest()[:16]


def compile_library(nvcc: str, source: Path, stem: str, macros: dict[str, int], arch_: str, key: str,
                    fast_math: bool) -> Path:
    """nvcc ``source`` with ``-D<name>=<value>`` macros into the cache unless it is there; its path.

    Raises RuntimeError with nvcc's message when the compiler fails."""
    tag = "-".join(str(v) for v in macros.values())
    out = cache_dir() / f"{stem}-{tag}-{key}-sm{arch_}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd = [nvcc, "-O3", "-std=c++17", *(["-use_fast_math"] if fast_math else []), "-shared", "-Xcompiler", "-fPIC",
           *(f"-D{n}={v}" for n, v in macros.items()), f"-gencode=arch=compute_{arch_},code=sm_{arch_}",
           "-o", str(tmp), str(source)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
    os.replace(tmp, out)
    return out


_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}  # by build key (source hash, architecture, macros)
_FAILED: dict[str, str] = {}
# by (source path, stem, macros, fast math, device): what a repeated call looks up, without reading
# or hashing the source
_LOADED: dict[tuple, ctypes.CDLL] = {}


def load(source: Path, stem: str, macros: dict[str, int], device: torch.device, fast_math: bool,
         setup: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL:
    """The library of one variant, built and loaded once per process (a failure is remembered and
    raised again as RuntimeError). ``setup`` declares the entry points' argument types. A repeated
    call is one dict lookup (the source is hashed once, on the first)."""
    fast = (source, stem, tuple(macros.items()), fast_math, device)
    lib = _LOADED.get(fast)
    if lib is not None:
        return lib
    lib = _load(source, stem, macros, device, fast_math, setup)
    _LOADED[fast] = lib
    return lib


def _load(source: Path, stem: str, macros: dict[str, int], device: torch.device, fast_math: bool,
          setup: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL:
    arch_ = arch(device)
    src = _read(source)
    tag = "-".join(str(v) for v in macros.values())
    key = build_key(src, arch_, tag)
    with _LOCK:
        if key in _LIBS:
            return _LIBS[key]
        if key in _FAILED:
            raise RuntimeError(_FAILED[key])
        nvcc = nvcc_path()
        if nvcc is None:
            _FAILED[key] = "nvcc not found (set ROTKV_NVCC or CUDA_HOME)"
            raise RuntimeError(_FAILED[key])
        try:
            lib = ctypes.CDLL(str(compile_library(nvcc, source, stem, macros, arch_, key, fast_math)))
            setup(lib)
        except (OSError, subprocess.SubprocessError) as e:  # unwritable cache, bad library, ...
            _FAILED[key] = f"building the CUDA kernel {stem} failed: {type(e).__name__}: {e}"
            raise RuntimeError(_FAILED[key]) from e
        except RuntimeError as e:
            _FAILED[key] = str(e)
            raise
        _LIBS[key] = lib
        return lib


@functools.lru_cache(maxsize=None)
def _read(source: Path) -> bytes:
    return source.read_bytes()  # read once: loads run on every call that may use a kernel
