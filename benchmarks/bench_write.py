"""Quantize-on-write: a 32K-token prefill's K and V (8 KV heads, head_dim 128) into the INT2 pool.

Times ``quant_write`` for K (mean subtraction, rotation by R_K, clip 0.96) plus V (clip 0.92)
as the median of CUDA events with a cold L2, against a device-to-device copy measured in the same
run. Bytes: the bf16 input read plus codes, scales and lo written (R_K and the mean, 0.5 MB, are
left out). Writes ``benchmarks/results/write-<YYYYMMDD-HHMM>.json`` (``results_io.write_results``).

    PYTHONPATH=. python benchmarks/bench_write.py
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from triton.testing import do_bench

from benchmarks.bench_decode import git_commit
from benchmarks.results_io import write_results
from rotkv import switches as rotkv_switches
from rotkv.kernels.body import TokenPart
from rotkv.kernels.write import quant_write
from rotkv.rotations.identity import random_orthogonal


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, nargs="+", default=[128])
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--block-t", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--num-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--bits", type=int, nargs="+", default=[2])
    ap.add_argument("--rot-precision", nargs="+", default=["tf32x3"], help="Triton: tf32x3 | tf32")
    ap.add_argument("--backend", nargs="+", default=["triton", "cuda"])
    ap.add_argument("--cuda-warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--cuda-switches", nargs="+", default=[""],
                    help="CUDA build switches per run, e.g. REDUX=0,FASTDIV=1 (rotkv/kernels/cuda/quant_write.cu)")
    ap.add_argument("--cuda-precision", nargs="+", default=["bf16x2", "bf16"], help="bf16x2 | bf16")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev, gpu, commit = "cuda", torch.cuda.get_device_name(), git_commit()
    rows = []
    # copy ceiling: 1 GiB device-to-device, bytes read + written
    src = torch.randn(2**28, device=dev)
    dst = torch.empty_like(src)
    copy_ms = do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    copy_tbs = 2 * src.numel() * 4 / copy_ms / 1e9
    del src, dst
    print(f"copy: {copy_tbs:.2f} TB/s")
    t, h, g, p = args.tokens, args.kv_heads, args.group_size, args.page_size
    for d in args.head_dim:
        gen = torch.Generator(device=dev).manual_seed(d)
        k = torch.randn(t, h, d, device=dev, generator=gen).to(torch.bfloat16)
        v = torch.randn(t, h, d, device=dev, generator=gen).to(torch.bfloat16)
        rot = torch.stack([random_orthogonal(d, i) for i in range(h)]).to(dev)
        mean = torch.randn(h, d, device=dev, generator=gen) * 0.3
        np_ = -(-t // p)
        slots = torch.arange(t, device=dev)
        configs = []  # (backend, block_t, warps, rot_precision)
        if "triton" in args.backend:
            configs += [("triton", bt, nw, rp) for bt, nw, rp in
                        itertools.product(args.block_t, args.num_warps, args.rot_precision)]
        if "cuda" in args.backend:
            configs += [("cuda", sw, nw, rp) for sw, nw, rp in
                        itertools.product(args.cuda_switches, args.cuda_warps, args.cuda_precision)]
        for bits, (backend, bt, nw, rp) in itertools.product(args.bits, configs):
            switches = ""
            if backend == "cuda":  # bt holds the build switches here (<NAME>=<0|1>, comma-separated: REDUX, FASTDIV)
                switches, bt = bt, 0
                for item in filter(None, switches.split(",")):
                    name, _, val = item.partition("=")
                    rotkv_switches.configure(**{f"write_{name.lower()}": int(val)})  # kept for later configs
            pool = [TokenPart.zeros(np_, h, p, d, bits, g, torch.float16, dev) for _ in range(2)]
            nbytes = 2 * t * h * d * 2 + 2 * t * h * (d * bits // 8 + 2 * 2 * (d // g))
            variants = [("rotkv_write", True, True), ("rotkv_write_norot", False, True),
                        ("rotkv_write_noclip", True, False), ("rotkv_write_norot_noclip", False, False)]
            for impl, rotate, clip in variants:
                if rp not in ("tf32x3", "bf16x2") and not rotate:
                    continue  # the precision only matters to the rotation
                kw = dict(num_warps=nw, rot_precision=rp, backend=backend)
                if backend == "triton":
                    kw["block_t"] = bt

                def step():
                    quant_write(k, slots, pool[0], rot=rot if rotate else None, mean=mean if rotate else None,
                                clip=0.96 if clip else 1.0, **kw)
                    quant_write(v, slots, pool[1], clip=0.92 if clip else 1.0, **kw)
                try:
                    ms = do_bench(step, warmup=25, rep=100, return_mode="median")
                except Exception as e:
                    print(f"# {backend} block_t={bt} warps={nw} {rp} failed: {type(e).__name__}: {str(e)[:300]}")
                    continue
                r = dict(impl=impl, backend=backend, switches=switches, bits=bits, rot_precision=rp, tokens=t, kv_heads=h, head_dim=d,
                         group_size=g, page_size=p, block_t=bt, num_warps=nw, bytes=nbytes, ms=ms,
                         tb_per_s=nbytes / ms / 1e9, copy_tb_per_s=copy_tbs,
                         fraction_of_copy=nbytes / ms / 1e9 / copy_tbs, gpu=gpu, commit=commit)
                rows.append(r)
                print(json.dumps(r), flush=True)
    write_results("write", rows, out=args.out)
    print(f"\n{'impl':<24} {'backend':<6} {'switches':<18} {'b':>1} {'rot':<6} {'D':>4} {'bt':>3} {'w':>2} {'ms':>8} {'TB/s':>6} {'copy':>5}")
    for r in rows:
        print(f"{r['impl']:<24} {r['backend']:<6} {r['switches']:<18} {r['bits']:>1} {r['rot_precision']:<6} {r['head_dim']:>4} "
              f"{r['block_t']:>3} {r['num_warps']:>2} {r['ms']:8.4f} {r['tb_per_s']:6.2f} {r['fraction_of_copy']:5.2f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
