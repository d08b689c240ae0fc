"""Ahead-of-time builds of the CUDA kernels a cache runs, so that no request waits for ``nvcc``.

The CUDA decode and write kernels are compiled on first use (a few seconds each) into
``$ROTKV_CACHE_DIR`` (default ``~/.cache/rotkv``). :func:`builds` lists the builds that the
default plans (``rotkv.kernels.plan``) run for one attention shape (the same variant functions
the kernels call, so the cache keys match), and :func:`build` compiles them in parallel for an
architecture: with ``arch`` given no GPU is needed (e.g. while building a container image), and
``rotkv build-kernels`` is the command line.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rotkv.kernels import nvcc as nvcc_build


@dataclasses.dataclass(frozen=True)
class Build:
    """One library: a kernel source, its variant macros, whether fast math, and what it is for."""

    source: Path
    stem: str
    macros: tuple  # ((name, value), ...) in the loader's order
    fast_math: bool
    why: str

    def key(self, arch: str) -> str:
        """The loader's cache key (rotkv.kernels.nvcc.load): source, architecture, macros."""
        return nvcc_build.build_key(nvcc_build._read(self.source), arch, "-".join(str(v) for _, v in self.macros))

    def path(self, arch: str) -> Path:
        """Where the loader looks for this build."""
        tag = "-".join(str(v) for _, v in self.macros)
        return nvcc_build.cache_dir() / f"{self.stem}-{tag}-{self.key(arch)}-sm{arch}.so"


def builds(head_dim: int, group_size: int, bits: int = 2, rotate: bool = True, value_meta=None,
           refine: bool = False, key_bits: tuple[int, ...] = ()) -> tuple[list[Build], list[str]]:
    """The CUDA builds that the default decode and write plans (``rotkv.kernels.plan``) run at this
    shape, and notes on the paths that take Triton kernels instead (Triton compiles on the GPU at
    first use; nothing to do here).

    ``bits``: the body's width; ``rotate``: whether the preset rotates keys or values (the write
    kernel then runs the rotating variant as well as the plain one, which flushes tiers that were
    rotated when they were written); ``value_meta``: the values' metadata dtype (None: float16;
    e4m3 has its own decode build); ``refine``: the preset keeps a refine tier (the decode build that
    reads it, where the plan has the CUDA kernel read it); ``key_bits``: the other key widths of the preset's
    layers (``k_bits``), whose decode builds are listed where the plan runs the CUDA kernel for them (INT4 keys:
    the ``cuda_key4`` switch)."""
    from rotkv.kernels import cuda_decode, cuda_write
    from rotkv.kernels.plan import decode_builds_for, write_builds_for

    if head_dim <= 0 or group_size <= 0 or head_dim % group_size:
        raise ValueError(f"group_size ({group_size}) has to divide head_dim ({head_dim})")
    out, notes = [], []
    for kb in [bits, *sorted(set(key_bits) - {bits})]:  # the body's width, then the other key widths' layers
        variant, note = decode_builds_for(head_dim, group_size, bits, value_meta=value_meta, refine=refine, key_bits=kb)
        keys = "" if kb == bits else f"INT{kb} keys, "
        if variant is not None:
            out.append(Build(cuda_decode.SOURCE, "int2_decode", tuple(cuda_decode._macros(variant).items()), True,
                             f"decode body, {keys}variant {variant}"))
        else:
            notes.append(note if kb == bits else f"{note} (the INT{kb}-key layers)")
    writes, note = write_builds_for(head_dim, group_size, rotate)
    if note:
        notes.append(note)
    for rot, prec, warps in writes:
        split = cuda_write.PRECISIONS[prec] if rot else 1
        macros = tuple(cuda_write.variant_macros(head_dim, group_size, bits, split, warps).items())
        out.append(Build(cuda_write.SOURCE, "quant_write", macros, False,
                         "write, rotating" if rot else "write, plain (tier flushes, clipping)"))
    return out, notes


def build(builds: list[Build], arch: str, jobs: int = 4, progress: bool = True) -> list[tuple[Build, Path, bool]]:
    """Compile the builds not in the cache yet, ``jobs`` at a time; (build, path, compiled now) each.
    Raises RuntimeError without ``nvcc`` or with nvcc's message when one fails."""
    nvcc = nvcc_build.nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set ROTKV_NVCC or CUDA_HOME, or put it on PATH)")

    def one(b: Build) -> tuple[Build, Path, bool]:
        fresh = not b.path(arch).exists()
        out = nvcc_build.compile_library(nvcc, b.source, b.stem, dict(b.macros), arch, b.key(arch), b.fast_math)
        return b, out, fresh

    from tqdm import tqdm

    with ThreadPoolExecutor(max(1, jobs)) as ex:
        it = ex.map(one, builds)
        return list(tqdm(it, total=len(builds), desc="nvcc", unit="build", disable=not progress))
