"""`rotkv build-kernels`: compile the CUDA kernels a model's cache runs, ahead of the first request."""

from __future__ import annotations

import os
import time

from rotkv.cli.common import cache_spec
from rotkv.cli.errors import UsageError
from rotkv.config import PRESETS, RECOMMENDED_PRESET


def register(sub) -> None:
    p = sub.add_parser("build-kernels", help="compile the CUDA decode and write kernels ahead of time (nvcc)",
                       description="Compile the CUDA kernels that the cache's default paths run for one "
                                   "attention shape into the kernel cache ($ROTKV_CACHE_DIR, default "
                                   "~/.cache/rotkv), so that no request waits for nvcc. Works without a GPU "
                                   "when --arch is given (e.g. while building an image).")
    p.add_argument("--model", default=None,
                   help="take head_dim from this model's config ('smollm2', a .gguf file or a Hugging Face "
                        "directory); or give --head-dim")
    p.add_argument("--head-dim", type=int, default=None)
    p.add_argument("--preset", default=RECOMMENDED_PRESET, choices=sorted(PRESETS),
                   help=f"cache preset (bits, group size; default {RECOMMENDED_PRESET})")
    p.add_argument("--group-size", type=int, default=None, help="quantization group size (overrides the preset)")
    p.add_argument("--arch", default=None,
                   help="compute capability without the dot, e.g. 90 for Hopper (default: the visible GPU's)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 4, help="nvcc runs at once")
    p.add_argument("--registers", action="store_true",
                   help="report what ptxas says of each build (registers, stack, spills, shared memory) instead of "
                        "building into the kernel cache")
    p.set_defaults(func=run)


def _head_dim(args) -> int:
    if (args.model is None) == (args.head_dim is None):
        raise UsageError("--model / --head-dim: give exactly one of them")
    if args.head_dim is not None:
        if args.head_dim <= 0:
            raise UsageError(f"--head-dim must be positive, got {args.head_dim}")
        return args.head_dim
    from rotkv.hf.models import peek_geometry

    geo = peek_geometry(args.model)
    if geo is None:
        raise UsageError(f"--model {args.model}: could not read head_dim from its config; give --head-dim")
    return geo[2]


def _arch(args) -> str:
    if args.arch is not None:
        if not (args.arch.isdigit() and len(args.arch) in (2, 3)):
            raise UsageError(f"--arch: a compute capability without the dot (e.g. 90), got {args.arch!r}")
        return args.arch
    import torch

    if not torch.cuda.is_available():
        raise UsageError("--arch: no CUDA GPU is visible; say which architecture to build for (e.g. --arch 90)")
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def _key_bits(spec) -> tuple[int, ...]:
    """The key widths of the preset's layers other than its bits: ``k_bits``'s, or for ``"artifact"`` the 4-bit
    keys that ``rotkv calibrate --method oscar-mix`` gives its most sensitive layers."""
    from rotkv.config import parse_layer_bits

    if spec.k_bits is None:
        return ()
    if spec.k_bits == "artifact":
        return (4,)
    return tuple(sorted(set(parse_layer_bits(spec.k_bits).values()) - {spec.bits}))


def run(args) -> int:
    from rotkv.kernels import nvcc as nvcc_build
    from rotkv.kernels import prebuild
    from rotkv.quant.quantizer import META_DTYPES

    if args.jobs < 1:
        raise UsageError(f"--jobs has to be >= 1 but got {args.jobs}")
    d = _head_dim(args)
    arch = _arch(args)
    spec = cache_spec(args.preset, {"group_size": args.group_size} if args.group_size else {})
    if spec.bits is None:
        raise UsageError(f"--preset {args.preset}: no quantized body, so no CUDA kernel to build")
    if spec.codec != "token":
        raise UsageError(f"--preset {args.preset}: the {spec.codec} codec runs Triton and PyTorch kernels only")
    if int(arch) < 80:
        raise UsageError(f"--arch {arch}: the CUDA kernels need compute capability 8.0 or newer")
    g = spec.resolved_group(d)
    try:
        builds, notes = prebuild.builds(d, g, spec.bits, rotate=spec.rotation != "identity",
                                        value_meta=META_DTYPES[spec.meta_v] if spec.meta_v else None,
                                        refine=bool(spec.refine_tokens), key_bits=_key_bits(spec))
    except ValueError as e:
        raise UsageError(f"--head-dim / --group-size: {e}") from None
    if spec.k_bits is not None:
        notes.append("per-layer key widths (k_bits) other than the preset's bits: their write builds are made at "
                     "first use")
    for n in notes:
        print(f"  {n}")
    if not builds:
        print("nothing to build")
        return 0
    if nvcc_build.nvcc_path() is None:
        raise UsageError("nvcc not found: set ROTKV_NVCC or CUDA_HOME, or put it on PATH")
    t0 = time.time()
    if args.registers:
        return _report_registers(builds, arch, args.jobs)
    done = prebuild.build(builds, arch, jobs=args.jobs)
    for b, path, fresh in done:
        print(f"  {'built ' if fresh else 'cached'} {b.why}: {path}")
    print(f"{sum(f for *_, f in done)} built, {sum(not f for *_, f in done)} already cached, sm_{arch}, "
          f"head_dim {d}, group {g}, {spec.bits}-bit, in {time.time() - t0:.0f} s")
    return 0


def _report_registers(builds, arch: str, jobs: int) -> int:
    """One line per build: ptxas's registers, stack frame, spill bytes and shared memory (sm_``arch``)."""
    from concurrent.futures import ThreadPoolExecutor

    from rotkv.kernels import prebuild

    with ThreadPoolExecutor(max(1, jobs)) as ex:
        found = list(ex.map(lambda b: prebuild.resources(b, arch), builds))
    print(f"  {'registers':>9} {'stack':>5} {'spill st/ld':>11} {'smem':>6}  build (sm_{arch}, ptxas -v)")
    for b, r in zip(builds, found):
        print(f"  {r.registers:>9} {r.stack:>5} {f'{r.spill_stores}/{r.spill_loads}':>11} {r.smem:>6}  {b.why}"
              f"{'  SPILLS' if r.spills else ''}")
    spilled = sum(r.spills for r in found)
    print(f"{len(found)} builds, {spilled} with spills")
    return 0
