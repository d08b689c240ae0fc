"""Decode over mixed-width bodies (K and V each INT2 or INT4) and the two score variants.

- ``bits``: Qwen3-8B's attention shape (32 q / 8 KV heads, D 128, G 64), body L - 320 tokens
  with K/V widths (2,2) (the default: CUDA INT2 kernel), (4,2), (4,4), (2,4) (Triton v1 kernel,
  int8 and bf16 scores), and the Triton split-K bf16 kernel over all L tokens for reference.
- ``score``: SmolLM2-135M's shape (9 q / 3 KV heads, D 64, G 64), INT2: int8 scores (CUDA
  kernel) against bf16 scores (Triton v1, and v2 as `auto` picks for small bodies).
- ``smolmix`` (only with ``--kinds smolmix``): oscar-mix's formats at SmolLM2's shape, 64 x 8K and 8 x 8K
  (e4m3 value metadata): its INT4-key layers (Triton v1) over a sweep of programs, warps and block,
  and its INT2 layers (CUDA kernel) over a sweep of target warps and tiles: the plan's defaults were
  tuned at Qwen3-8B's shape (32 q / 8 KV heads, D 128).

CUDA-graph replays with the L2 flushed (``bench_decode.time_ms``). Writes
``benchmarks/results/mixed-<YYYYMMDD-HHMM>.json``.

    PYTHONPATH=. python studies/bench_mixed.py
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from benchmarks.bench_decode import git_commit, make_bf16_pages, time_ms
from benchmarks.results_io import write_results
from rotkv.kernels.body import PagedBody, TokenPart
from rotkv.kernels.decode import DecodeConfig, decode_attention


def make_body(b, h, n, d, g, p, bits, dev, gen, v_meta=torch.float16):
    npr = -(-n // p)
    np_ = b * npr
    parts = []
    for nb, meta in zip(bits, (torch.float16, v_meta)):
        parts.append(TokenPart(torch.randint(0, 256, (np_, h, p, d * nb // 8), dtype=torch.uint8, device=dev,
                                             generator=gen),
                               (torch.rand(np_, h, p, d // g, device=dev, generator=gen) * 0.1 + 0.01).to(meta),
                               (-torch.rand(np_, h, p, d // g, device=dev, generator=gen) * 0.2).to(meta), nb, g, d))
    indices = torch.randperm(np_, device=dev, generator=gen).int()
    indptr = (torch.arange(b + 1, device=dev) * npr).int()
    last = torch.full((b,), n - (npr - 1) * p, dtype=torch.int32, device=dev)
    return PagedBody(*parts), (indptr, indices, last)


def overrides(cfg: DecodeConfig) -> str:
    """The config as ``ROTKV_TUNING`` fields (those that differ from the defaults; docs/configuration.md)."""
    base = DecodeConfig()
    return ",".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                    if getattr(cfg, f.name) != getattr(base, f.name) and f.name not in ("backend", "score"))


def body_bytes(b, h, n, d, g, bits, table, v_meta=torch.float16):
    meta_bytes = (2, v_meta.itemsize)
    return sum(b * h * n * (d * nb // 8 + 2 * mb * (d // g)) for nb, mb in zip(bits, meta_bytes)) + table[1].numel() * 4


def run(kind, b, length, hq, h, d, g, variants, dev, gen, rows, base, v_meta=torch.float16, tier_n=320):
    p, tier_n = 16, min(tier_n, length)
    body_n = length - tier_n
    q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16, generator=gen)
    tier, ttab = make_bf16_pages(b, h, tier_n, d, 16, dev, gen)
    tier_bytes = 2 * b * h * tier_n * d * 2 + ttab[1].numel() * 4
    (pk, pv), ptab = make_bf16_pages(b, h, length, d, 64, dev, gen)
    ms = time_ms(lambda: decode_attention(q, None, None, 0, (pk, pv), ptab, length,
                                          cfg=DecodeConfig(block_t=64, num_warps=4)))
    bf16_ms = ms
    rows.append(dict(kind=kind, impl="triton_bf16", batch=b, context=length, head_dim=d, ms=ms, **base))
    print(json.dumps(rows[-1]), flush=True)
    del pk, pv
    for name, bits, cfg in variants:
        body, table = make_body(b, h, body_n, d, g, p, bits, dev, gen, v_meta)
        nbytes = body_bytes(b, h, body_n, d, g, bits, table, v_meta) + tier_bytes + 2 * q.numel() * 2
        try:
            ms = time_ms(lambda: decode_attention(q, body, table, body_n, tier, ttab, tier_n, cfg=cfg))
        except Exception as e:
            print(f"# {kind} {name} failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        rows.append(dict(kind=kind, impl=name, k_bits=bits[0], v_bits=bits[1], batch=b, context=length, head_dim=d,
                         ms=ms, bytes=nbytes, tb_per_s=nbytes / ms / 1e9, speedup_vs_triton_bf16=bf16_ms / ms,
                         overrides=overrides(cfg), **base))
        print(json.dumps(rows[-1]), flush=True)
        del body
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--kinds", nargs="+", default=["bits", "score"], choices=["bits", "score", "smolmix"])
    args = ap.parse_args(argv)
    dev, base = "cuda", dict(gpu=torch.cuda.get_device_name(), commit=git_commit())
    gen = torch.Generator(device=dev).manual_seed(0)
    rows: list = []
    if "smolmix" in args.kinds:
        smolmix(dev, gen, rows, base)
    if "bits" not in args.kinds and "score" not in args.kinds:
        return finish(rows, args.out)
    tri = dict(backend="triton", block_n=64, num_warps=1, v2=False)
    bits_variants = [("default-22", (2, 2), DecodeConfig())]
    for bits in ((2, 2), (4, 2), (4, 4), (2, 4)):
        bits_variants.append((f"v1-i8-{bits[0]}{bits[1]}", bits, DecodeConfig(score="int8", **tri)))
        bits_variants.append((f"v1-bf16-{bits[0]}{bits[1]}", bits, DecodeConfig(score="bf16", **tri)))
    bits_variants.append(("default-42", (4, 2), DecodeConfig()))
    shapes = [(1, 32768), (8, 32768)] if args.quick else [(1, 32768), (8, 32768), (1, 131072), (8, 131072)]
    for b, length in shapes if "bits" in args.kinds else []:
        run("bits", b, length, 32, 8, 128, 64, bits_variants, dev, gen, rows, base)
    score_variants = [
        ("cuda-int8", (2, 2), DecodeConfig(backend="cuda", score="int8")),
        ("v1-bf16-n64-w1", (2, 2), DecodeConfig(score="bf16", **tri)),
        ("v1-bf16-n64-w2", (2, 2), DecodeConfig(score="bf16", backend="triton", block_n=64, num_warps=2)),
        ("v2-bf16-n128-w4", (2, 2), DecodeConfig(score="bf16", backend="triton", v2=True, block_n=128, num_warps=4)),
        ("v2-int8-n128-w4", (2, 2), DecodeConfig(score="int8", backend="triton", v2=True, block_n=128, num_warps=4)),
        ("default", (2, 2), DecodeConfig()),
    ]
    for b, length in [(1, 4096), (8, 4096), (1, 32768), (8, 32768)] if "score" in args.kinds else []:
        run("score", b, length, 9, 3, 64, 64, score_variants, dev, gen, rows, base)
    return finish(rows, args.out)


def smolmix(dev, gen, rows, base) -> None:
    """oscar-mix's layer formats at SmolLM2's shape: INT4 keys (Triton v1) and INT2 (CUDA), e4m3 value
    metadata, a 128-token bf16 window + 16 sink (the window share at 8K), over config sweeps."""
    k4 = [("default-42", (4, 2), DecodeConfig())]
    for tp in (1024, 2048, 4096, 8192):
        for nw in (1, 2, 4):
            k4.append((f"v1-42-p{tp}-w{nw}", (4, 2), DecodeConfig(wide_target_programs=tp, wide_num_warps=nw)))
    for bn in (32, 128):
        k4.append((f"v1-42-p4096-w2-n{bn}", (4, 2), DecodeConfig(wide_target_programs=4096, wide_num_warps=2,
                                                                  wide_block_n=bn)))
    k2 = [("default-22", (2, 2), DecodeConfig())]
    for tw in (1024, 4096, 8192):
        k2.append((f"cuda-22-w{tw}", (2, 2), DecodeConfig(cuda_target_warps=tw)))
    k2.append(("cuda-22-t2", (2, 2), DecodeConfig(cuda_tiles=2)))
    k2.append(("cuda-22-block", (2, 2), DecodeConfig(cuda_fuse="block")))
    for b, length in [(64, 8192), (8, 8192)]:
        run("smolmix", b, length, 9, 3, 64, 64, k4 + k2, dev, gen, rows, base, v_meta=torch.float8_e4m3fn,
            tier_n=16 + 128)


def finish(rows, out) -> int:
    write_results("mixed", rows, out=out)
    print(f"\n{'kind':<7} {'B':>2} {'L':>6} {'impl':<22} {'ms':>8} {'TB/s':>5} {'x bf16':>6}")
    for r in rows:
        print(f"{r['kind']:<7} {r['batch']:>2} {r['context']:>6} {r['impl']:<22} {r['ms']:8.4f} "
              f"{r.get('tb_per_s', 0):5.2f} {r.get('speedup_vs_triton_bf16', 1):6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
