"""Where a decode call's time goes: the INT2 body kernel, the bf16 tier kernel and the merge, timed
apart and together (CUDA-graph replays, L2 flushed, median; as ``bench_decode.py``).

Same shape and data as ``bench_decode.py`` (Qwen3-8B attention by default). For each (B, L) it
times ``decode_attention`` (the default, whose CUDA kernel merges the partials itself, and
``cuda_fuse`` "none" and "all"), and each launch of the unfused path alone: the body kernel into
preallocated partials, the tier kernel (``_split_kernel`` over the tier splits only) and the merge
kernel. Writes ``benchmarks/results/breakdown-<time>.json``.

    PYTHONPATH=. python studies/decode_breakdown.py --batch 1 8 --context 4096 131072
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import triton

from benchmarks.bench_decode import add_shape_args, git_commit, make_bf16_pages, make_int2, time_ms
from rotkv.kernels import decode as dk
from rotkv.kernels.decode import DecodeConfig, decode_attention
from rotkv.kernels.plan import cuda_variant

def pieces(q, body, table, body_n, tier, ttab, tier_n, cfg):
    """Closures running the CUDA body kernel, the tier kernel and the merge alone (the same
    launches decode_attention makes for this call)."""
    b_sz, hq, d = q.shape
    h = body.kv_heads
    rep = hq // h
    per, n_int2 = dk._splits(body_n, b_sz * h, 16 * cfg.cuda_tiles, cfg.cuda_target_warps, cfg.cuda_min_split_tokens)
    tper, n_tier = dk._splits(tier_n, b_sz * h, cfg.block_t, cfg.target_programs, 64)
    ns = n_int2 + n_tier
    o = torch.empty(b_sz, hq, ns, d, dtype=torch.float32, device=q.device)
    m = torch.zeros(b_sz, hq, ns, dtype=torch.float32, device=q.device)
    l_ = torch.ones(b_sz, hq, ns, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    scale = d ** -0.5 * dk.LOG2E
    _, _, tiles, mb, prefetch, vf16, vflush, qf16, _ = cuda_variant(cfg, d, body.k.groups)

    def body_only():
        from rotkv.kernels.cuda_decode import body_partials
        body_partials(q, body, table, o, m, l_, n_int2, per, scale, tiles=tiles, min_blocks=mb, prefetch=bool(prefetch),
                      value_f16=bool(vf16), value_flush=vflush, score_f16=qf16)

    def tier_only():
        dk._split_kernel[(b_sz * h, n_tier)](
            q, *body.tensors(), *table, *tier, *ttab, o, m, l_, h, hq, ns, n_int2, n_int2, scale, per, tper, 0,
            REP=rep, HPAD=max(16, triton.next_power_of_2(rep)), D=d, G=body.group_size, P=body.page_size,
            PT=tier[0].shape[2], BLOCK_N=cfg.block_n, BLOCK_T=cfg.block_t, QK_INT8=True, USE_ASM=True,
            HAS_INT2=False, HAS_TIER=True, STATIC_STEPS=0, TIER_STATIC_STEPS=0, F16=False, V2=False,
            RP=max(4, triton.next_power_of_2(rep)), PB=min(body.page_size, cfg.block_n), K_BITS=2, V_BITS=2,
            rf_ptr=q, RK=1, RE=1, REFINE=False, rv_ptr=q, REFINE_V=False, REF_ONLY=False, rl_ptr=q,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def merge_only():
        chunk = min(64, triton.next_power_of_2(ns))
        db = d if b_sz * hq >= 1024 else 32
        dk._merge_kernel[(b_sz * hq, d // db)](o, m, l_, out, ns, o, hq, D=d, DB=db, CHUNK=chunk, STATIC_STEPS=0,
                                                ROT=False, GROUP=1, K=0)

    return {"body": body_only, "tier": tier_only, "merge": merge_only}, dict(n_int2=n_int2, n_tier=n_tier)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_shape_args(ap, [1, 8])
    ap.add_argument("--tier", type=int, default=320, help="sink + window tokens in bf16")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    # the default (block pre-merge), one partial per split, and the in-kernel final merge
    cfgs = {"default": DecodeConfig(), "none": DecodeConfig(cuda_fuse="none"), "all": DecodeConfig(cuda_fuse="all")}
    dev, gpu, commit = "cuda", torch.cuda.get_device_name(), git_commit()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    out = Path(a.out or Path(__file__).resolve().parents[1] / "benchmarks" / "results" / f"breakdown-{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for length in a.context:
        for b in a.batch:
            gen = torch.Generator(device=dev).manual_seed(b * 7 + length)
            tier_n = min(a.tier, length)
            body_n = length - tier_n
            q = torch.randn(b, a.q_heads, a.head_dim, device=dev, dtype=torch.bfloat16, generator=gen)
            body, table = make_int2(b, a.kv_heads, body_n, a.head_dim, a.group_size, a.page_size, dev, gen)
            tier, ttab = make_bf16_pages(b, a.kv_heads, tier_n, a.head_dim, 16, dev, gen)
            base = dict(batch=b, context=length, gpu=gpu, commit=commit)
            ref = None
            for name, cfg in cfgs.items():
                f = lambda: decode_attention(q, body, table, body_n, tier, ttab, tier_n, cfg=cfg)  # noqa: E731
                o = f().float()
                ref = o if ref is None else ref
                err = (o - ref).abs().max().item()
                rows.append(dict(base, part=f"call:{name}", ms=time_ms(f), max_abs_diff_vs_default=err))
                print(json.dumps(rows[-1]), flush=True)
            fns, info = pieces(q, body, table, body_n, tier, ttab, tier_n, DecodeConfig(cuda_fuse="none"))
            for name, fn in fns.items():
                rows.append(dict(base, part=name, ms=time_ms(fn), **info))
                print(json.dumps(rows[-1]), flush=True)
            out.write_text(json.dumps(rows, indent=1))
            del body, tier
            torch.cuda.empty_cache()
    print(f"\n{'B':>3} {'L':>7} {'part':<22} {'ms':>8}")
    for r in rows:
        print(f"{r['batch']:>3} {r['context']:>7} {r['part']:<22} {r['ms']:8.4f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
