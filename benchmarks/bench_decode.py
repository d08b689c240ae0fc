"""Decode attention: rotkv INT2 (paged body + bf16 tier) against bf16 baselines, on one GPU.

Shape: Qwen3-8B attention (32 query / 8 KV heads, head_dim 128) by default. For each batch B and
context L it times one CUDA-graph replay of each implementation, as the median of CUDA events
with the L2 flushed before every replay (``triton.testing.do_bench``):

- ``sdpa_bf16``: torch flash SDPA over dense bf16 K/V, GQA folded into the query length;
- ``triton_bf16``: the split-K kernel of rotkv on a paged bf16 cache (``decode_attention`` with
  only a tier);
- ``dequant_sdpa``: Triton dequant of the INT2 body into a dense bf16 buffer, then flash SDPA;
- ``rotkv_int2``: ``decode_attention`` over the INT2 body (L - sink - window tokens) and the
  bf16 tier (sink + window), best of a few configs (each one's time is in the JSON too).

Bytes count what each implementation must read: K/V codes, scales, lo, page indices and the bf16
tier for INT2 (plus q); dense K/V for bf16; for ``dequant_sdpa`` the INT2 read, the bf16 write
and the SDPA read. Writes ``benchmarks/results/decode-<YYYYMMDD-HHMM>.json``.

    PYTHONPATH=. python benchmarks/bench_decode.py --batch 1 8 32 --context 4096 32768 131072
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from rotkv.kernels.body import PagedBody, TokenPart
from rotkv.kernels.decode import DecodeConfig, decode_attention
from rotkv.kernels.dequant import dequant_dense

CONFIGS = {  # name -> DecodeConfig; the INT2 row reports the best, every one is logged
    # the default (backend "auto": CUDA body kernel with register prefetch, 16-token steps, block
    # pre-merge; Triton v2 for bodies under DecodeConfig.small_work)
    "default": DecodeConfig(),
    # the CUDA kernel as it was before the second round: 32-token steps, no prefetch, one partial per split
    "cuda-t2-none": DecodeConfig(backend="cuda", cuda_tiles=2, cuda_prefetch=False, cuda_fuse="none",
                                 cuda_value_f16=False, cuda_value_flush=0),
    # one lever at a time against the default
    "merge-c64": DecodeConfig(merge_chunk=64),
    "merge-c128-s16": DecodeConfig(merge_chunk=128, merge_slice=16),
    "merge-s16": DecodeConfig(merge_slice=16),
    "cuda-pf-t1-none": DecodeConfig(backend="cuda", cuda_fuse="none"),
    "cuda-pf-t1-all": DecodeConfig(backend="cuda", cuda_fuse="all"),
    "cuda-t1-block": DecodeConfig(backend="cuda", cuda_prefetch=False),
    "cuda-pf-t2-mb3": DecodeConfig(backend="cuda", cuda_tiles=2, cuda_min_blocks=3),
    "cuda-pf-t1-w4k": DecodeConfig(backend="cuda", cuda_target_warps=4096),
    # the tier's launch on a second stream beside the body kernel instead of before it
    "tier-beside": DecodeConfig(tier_stream=True),
    "tier-beside-w1792": DecodeConfig(tier_stream=True, cuda_target_warps=1792),
    "w1792": DecodeConfig(cuda_target_warps=1792),
    # with the tier beside the body, the merge is what is left on the critical path: its slice and chunk
    "tier-beside-s16": DecodeConfig(tier_stream=True, merge_slice=16),
    "tier-beside-s64": DecodeConfig(tier_stream=True, merge_slice=64),
    "tier-beside-c64": DecodeConfig(tier_stream=True, merge_chunk=64),
    # more bytes in flight per SM (the H200's higher bandwidth): more splits, or 32-token steps with more splits
    "cuda-pf-t1-w8k": DecodeConfig(backend="cuda", cuda_target_warps=8192),
    "cuda-pf-t2-w4k": DecodeConfig(backend="cuda", cuda_tiles=2, cuda_target_warps=4096),
    "cuda-vf16": DecodeConfig(backend="cuda", cuda_value_f16=True, cuda_value_flush=0),
    "cuda-bf16v": DecodeConfig(backend="cuda", cuda_value_f16=False, cuda_value_flush=0),  # default before 2026-12-02 pm
    "cuda-bf16v-f8": DecodeConfig(backend="cuda", cuda_value_f16=False, cuda_value_flush=8),
    "cuda-vf16-f4": DecodeConfig(backend="cuda", cuda_value_f16=True, cuda_value_flush=4),
    "cuda-vf16-f8": DecodeConfig(backend="cuda", cuda_value_f16=True, cuda_value_flush=8),
    "cuda-vf16-f16": DecodeConfig(backend="cuda", cuda_value_f16=True, cuda_value_flush=16),
    # score variants: the CUDA kernel with the fp16 query (both code-operand makers; the default at
    # head_dim 64) or the int8 query (the default above), and Triton with bf16 scores (the default at
    # head_dim 64 before the fp16-query build)
    "cuda-qf16-1": DecodeConfig(backend="cuda", score="bf16", cuda_score_f16=1),
    "cuda-qf16-2": DecodeConfig(backend="cuda", score="bf16", cuda_score_f16=2),
    "cuda-int8": DecodeConfig(backend="cuda", score="int8"),
    "cuda-qf16-block": DecodeConfig(backend="cuda", score="bf16", cuda_fuse="block"),
    "cuda-qf16-none": DecodeConfig(backend="cuda", score="bf16", cuda_fuse="none"),
    "triton-bf16": DecodeConfig(backend="triton", score="bf16"),
    # Triton body kernels: v1 (rows = query heads padded to 16, int8 scores), v2 (rows = plane x head)
    "i8dot-n64-w1": DecodeConfig(block_n=64, num_warps=1, qk_int8=True, v2=False, backend="triton"),
    "v2-n128-w4": DecodeConfig(block_n=128, num_warps=4, v2=True, backend="triton"),
}
BF16_CONFIGS = {
    "t64-w4": DecodeConfig(block_t=64, num_warps=4),
    "t32-w4": DecodeConfig(block_t=32, num_warps=4),
}


def git_commit() -> str:
    from rotkv import switches

    if switches.get().commit:
        return switches.get().commit
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def time_ms(fn) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (as a serving engine runs decode), L2 flushed
    before every replay; the graph takes the Python launch cost out of small shapes."""
    fn()  # compile / warm up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return do_bench(g.replay, warmup=25, rep=100, return_mode="median")


def make_int2(b, h, n, d, g, p, dev, gen):
    """Random INT2 body of n tokens per request on pages in shuffled order."""
    npr = -(-n // p)
    np_ = b * npr
    codes = torch.randint(0, 256, (2, np_, h, p, d // 4), dtype=torch.uint8, device=dev, generator=gen)
    scale = (torch.rand(2, np_, h, p, d // g, device=dev, generator=gen) * 0.1 + 0.01).half()
    lo = (-torch.rand(2, np_, h, p, d // g, device=dev, generator=gen) * 0.2).half()
    indices = torch.randperm(np_, device=dev, generator=gen).int()
    indptr = (torch.arange(b + 1, device=dev) * npr).int()
    last = torch.full((b,), n - (npr - 1) * p, dtype=torch.int32, device=dev)
    body = PagedBody(*(TokenPart(codes[i], scale[i], lo[i], 2, g, d) for i in (0, 1)))
    return body, (indptr, indices, last)


def make_bf16_pages(b, h, n, d, p, dev, gen):
    npr = -(-n // p)
    k = torch.randn(b * npr, h, p, d, device=dev, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(b * npr, h, p, d, device=dev, generator=gen, dtype=torch.bfloat16)
    indptr = (torch.arange(b + 1, device=dev) * npr).int()
    indices = torch.randperm(b * npr, device=dev, generator=gen).int()
    last = torch.full((b,), n - (npr - 1) * p, dtype=torch.int32, device=dev)
    return (k, v), (indptr, indices, last)


def run_shape(b, length, args, dev, gpu, commit, log):
    hq, h, d, g, p, pt = args.q_heads, args.kv_heads, args.head_dim, args.group_size, args.page_size, 16
    tier_n = min(args.sink + args.window, length)
    body_n = length - tier_n
    gen = torch.Generator(device=dev).manual_seed(b * 7 + length)
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
    rows, base = [], dict(batch=b, context=length, head_dim=d, group_size=g, page_size=p, gpu=gpu, commit=commit)
    bf16_bytes = 2 * b * h * length * d * 2 + 2 * q.numel() * 2

    def row(impl, ms, nbytes, **extra):
        r = dict(impl=impl, **base, bytes=int(nbytes), ms=ms, tb_per_s=nbytes / ms / 1e9, **extra)
        rows.append(r)
        log(json.dumps(r))
        return r

    # --- bf16 baselines
    kd = torch.randn(b, h, length, d, device=dev, dtype=torch.bfloat16, generator=gen)
    vd = torch.randn(b, h, length, d, device=dev, dtype=torch.bfloat16, generator=gen)
    q4 = q.view(b, h, hq // h, d)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        row("sdpa_bf16", time_ms(lambda: F.scaled_dot_product_attention(q4, kd, vd)), bf16_bytes)
    # --- unfused dequant + SDPA (the dense buffer is kd/vd: tier tokens sit after the body)
    body, table = make_int2(b, h, body_n, d, g, p, dev, gen)
    int2_bytes = 2 * b * h * body_n * (d // 4 + 2 * 2 * (d // g)) + table[1].numel() * 4

    def unfused():
        dequant_dense(body.k, *table, body_n, kd)
        dequant_dense(body.v, *table, body_n, vd)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q4, kd, vd)

    if body_n > 0:
        row("dequant_sdpa", time_ms(unfused), int2_bytes + 2 * b * h * body_n * d * 2 + bf16_bytes)
    del kd, vd
    # --- triton split-K bf16 on pages
    best_bf16 = rows[0]["ms"]
    (pk, pv), ptab = make_bf16_pages(b, h, length, d, 64, dev, gen)
    for name, cfg in BF16_CONFIGS.items():
        ms = time_ms(lambda: decode_attention(q, None, None, 0, (pk, pv), ptab, length, cfg=cfg))
        row("triton_bf16", ms, bf16_bytes + ptab[1].numel() * 4, config=name)
        best_bf16 = min(best_bf16, ms)
    del pk, pv
    # --- rotkv INT2
    tier, ttab = make_bf16_pages(b, h, tier_n, d, pt, dev, gen)
    tier_bytes = 2 * b * h * tier_n * d * 2 + ttab[1].numel() * 4
    nbytes = int2_bytes + tier_bytes + 2 * q.numel() * 2
    for name, cfg in CONFIGS.items():
        try:
            ms = time_ms(lambda: decode_attention(q, body, table, body_n, tier, ttab, tier_n, cfg=cfg))
        except Exception as e:  # a config the compiler rejects is logged, not fatal
            log(f"# config {name} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        row("rotkv_int2_cfg", ms, nbytes, config=name)
    cand = [r for r in rows if r["impl"] == "rotkv_int2_cfg"]
    if cand:
        best = min(cand, key=lambda r: r["ms"])
        row("rotkv_int2", best["ms"], nbytes, config=best["config"])
        dflt = [r for r in cand if r["config"] == "default"]
        if dflt:
            row("rotkv_int2_default", dflt[0]["ms"], nbytes, config="default")
    for r in rows:
        r["speedup_vs_best_bf16"] = best_bf16 / r["ms"]
    del body, tier
    torch.cuda.empty_cache()
    return rows


def add_shape_args(ap: argparse.ArgumentParser, batch: list[int]) -> None:
    """The attention shape and sweep arguments (Qwen3-8B attention by default)."""
    ap.add_argument("--batch", type=int, nargs="+", default=batch)
    ap.add_argument("--context", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap, [1, 8, 32])
    ap.add_argument("--sink", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--configs", nargs="*", default=None, help=f"subset of {list(CONFIGS)}")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/decode-<time>.json)")
    args = ap.parse_args(argv)
    if args.configs:
        for k in list(CONFIGS):
            if k not in args.configs:
                del CONFIGS[k]
    dev = "cuda"
    gpu = torch.cuda.get_device_name()
    commit = git_commit()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    out = Path(args.out or Path(__file__).parent / "results" / f"decode-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for length in args.context:
        for b in args.batch:
            rows += run_shape(b, length, args, dev, gpu, commit, lambda s: print(s, flush=True))
            out.write_text(json.dumps(rows, indent=1))
    print(f"\n{'B':>3} {'L':>7} {'impl':<14} {'ms':>8} {'TB/s':>6} {'x bf16':>7}  config")
    for r in rows:
        if r["impl"] != "rotkv_int2_cfg":
            print(f"{r['batch']:>3} {r['context']:>7} {r['impl']:<14} {r['ms']:8.4f} {r['tb_per_s']:6.2f} "
                  f"{r['speedup_vs_best_bf16']:7.2f}  {r.get('config', '')}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
