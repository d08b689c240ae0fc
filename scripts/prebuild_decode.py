"""Compile, in parallel, every CUDA decode kernel build that the GPU tests and ``bench_decode.py`` use.

Each build is one ``nvcc`` run of ~15 s; the kernel grid test alone needs a few dozen, which run one
after another on first use. On a fresh GPU machine, run this first so that they are in the cache
(``$ROTKV_CACHE_DIR``) before the tests start::

    python scripts/prebuild_decode.py [--jobs 16] [--configs default cuda-bf16v] [--shapes 128/2 64/1]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "tests", "kernels"))  # test_kernels imports its fixture module by name

from bench_decode import CONFIGS  # noqa: E402

from rotkv.kernels import cuda_decode  # noqa: E402
from rotkv.kernels import nvcc as nvcc_build  # noqa: E402
from rotkv.kernels import prebuild  # noqa: E402
from rotkv.kernels.plan import DecodeConfig  # noqa: E402
from rotkv.kernels.plan import cuda_variant as _cuda_variant  # noqa: E402
from tests.kernels.test_kernels import CUDA_KERNEL_CASES, CUDA_KERNEL_VARIANTS, cuda_kernel_config  # noqa: E402


def variants(configs: list[str], shapes: list[tuple[int, int]]) -> set[tuple]:
    """The kernel grid test's builds, and the default and the named bench configs at ``shapes``
    ((head_dim, groups) pairs)."""
    out = {_cuda_variant(cuda_kernel_config(*v), d, d // g)
           for v in CUDA_KERNEL_VARIANTS for *_, d, g, _p in CUDA_KERNEL_CASES}
    for cfg in [DecodeConfig()] + [CONFIGS[c] for c in configs]:
        if cfg.backend != "triton":
            out |= {_cuda_variant(cfg, d, ng) for d, ng in shapes}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--configs", nargs="*", default=[], help=f"bench_decode configs, of {list(CONFIGS)}")
    ap.add_argument("--shapes", nargs="*", default=["128/2", "64/1", "256/4"], help="head_dim/groups pairs")
    ap.add_argument("--arch", default=None, help="e.g. 90 (default: the visible GPU's)")
    args = ap.parse_args(argv)
    todo = sorted(variants(args.configs, [tuple(int(x) for x in s.split("/")) for s in args.shapes]))
    arch = args.arch or nvcc_build.arch(torch.device("cuda", torch.cuda.current_device()))
    t0 = time.time()
    builds = [prebuild.Build(cuda_decode.SOURCE, "int2_decode", tuple(cuda_decode._macros(v).items()), True, str(v))
              for v in todo]
    prebuild.build(builds, arch, jobs=args.jobs)
    print(f"{len(todo)} decode builds ready in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
