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
import re
import subprocess
import tempfile
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


@dataclasses.dataclass(frozen=True)
class Resources:
    """What ``ptxas -v`` reports for one build, the largest over its kernels: registers per thread, stack frame
    and spill bytes per thread, static shared memory per block."""

    registers: int
    stack: int
    spill_stores: int
    spill_loads: int
    smem: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def parse_ptxas(log: str) -> Resources:
    """:class:`Resources` from ``nvcc -Xptxas -v``'s report (the largest value of each field over the kernels);
    ValueError where the log reports no kernel."""
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    if not regs:
        raise ValueError(f"no 'Used N registers' line in ptxas's report: {log[-500:]!r}")
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    smem = [int(x) for x in re.findall(r"(\d+) bytes smem", log)]
    return Resources(max(regs), max((int(f[0]) for f in frames), default=0), max((int(f[1]) for f in frames), default=0),
                     max((int(f[2]) for f in frames), default=0), max(smem, default=0))


def resources(b: Build, arch: str) -> Resources:
    """Compile ``b`` to a cubin for ``arch`` with ``-Xptxas -v`` (into a temporary folder; the kernel cache is not
    touched) and return what ptxas reports. RuntimeError without ``nvcc`` or with its message when it fails."""
    nvcc = nvcc_build.nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set ROTKV_NVCC or CUDA_HOME, or put it on PATH)")
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-O3", "-std=c++17", *(["-use_fast_math"] if b.fast_math else []), "-cubin",
               f"-gencode=arch=compute_{arch},code=sm_{arch}", "-Xptxas", "-v",
               *(f"-D{n}={v}" for n, v in b.macros), "-o", str(Path(tmp) / "k.cubin"), str(b.source)]
        res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{res.stderr[-2000:]}")
    return parse_ptxas(res.stderr + res.stdout)
