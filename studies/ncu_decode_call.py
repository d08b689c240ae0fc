"""Four decode calls at the Qwen3-8B attention shape, for Nsight Compute to profile one of them
(the device scripts run ``ncu -k regex:int2_decode --launch-skip 2 --launch-count 1`` on it)::

    python studies/ncu_decode_call.py BATCH CONTEXT [CONFIG]   # CONFIG: a bench_decode.py config name
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))  # bench_decode.py
from bench_decode import CONFIGS, make_bf16_pages, make_int2  # noqa: E402

from rotkv.kernels.decode import decode_attention  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    b, length, cfg = int(argv[0]), int(argv[1]), CONFIGS[argv[2] if len(argv) > 2 else "default"]
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    body, table = make_int2(b, 8, length - 320, 128, 64, 16, "cuda", g)
    tier, ttab = make_bf16_pages(b, 8, 320, 128, 16, "cuda", g)
    for _ in range(4):
        decode_attention(q, body, table, length - 320, tier, ttab, 320, cfg=cfg)
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
