"""Error of decode configs against the float32 reference, on the benchmark's random INT2 body.

For each (batch, context) and query scale (1 = nearly flat attention over the random body, larger =
peakier), runs every named config of ``bench_decode.CONFIGS`` (or ``--configs``) and reports the
relative Frobenius error and the largest absolute error of its output against
``rotkv.kernels.reference.decode_reference`` in float32. Used to check that a kernel variant (e.g.
the fp16 value product, ``cuda-vf16``) costs no accuracy against the one it replaces::

    python studies/decode_error.py --batch 8 --context 32768 --configs cuda-bf16v cuda-vf16
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))  # bench_decode.py
from bench_decode import CONFIGS, add_shape_args, make_bf16_pages, make_int2  # noqa: E402

from rotkv.kernels.decode import decode_attention  # noqa: E402
from rotkv.kernels.reference import decode_reference  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap, [8])
    ap.add_argument("--q-scale", type=float, nargs="+", default=[1.0, 30.0])
    ap.add_argument("--tier", type=int, default=320, help="bf16 tier tokens after the body")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev, rows = "cuda", []
    for b in args.batch:
        for length in args.context:
            gen = torch.Generator(device=dev).manual_seed(b * 7 + length)
            body_n, tier_n = length - args.tier, args.tier
            body, table = make_int2(b, args.kv_heads, body_n, args.head_dim, args.group_size, args.page_size, dev, gen)
            (tk, tv), ttab = make_bf16_pages(b, args.kv_heads, tier_n, args.head_dim, 16, dev, gen)
            q0 = torch.randn(b, args.q_heads, args.head_dim, device=dev, generator=gen)
            for qs in args.q_scale:
                q = (q0 * qs).to(torch.bfloat16)
                ref = decode_reference(q.float(), body, table, tk, tv, ttab)
                for name in args.configs:
                    out = decode_attention(q, body, table, body_n, (tk, tv), ttab, tier_n, cfg=CONFIGS[name]).float()
                    r = dict(batch=b, context=length, head_dim=args.head_dim, q_scale=qs, config=name,
                             rel_err=((out - ref).norm() / ref.norm()).item(), max_abs=(out - ref).abs().max().item())
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            del body, tk, tv
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
