"""Job throughput (the serving headline): N requests of L tokens each, T new tokens each, on one GPU.

bf16 runs as many requests at once as its KV cache fits in GPU memory, in waves; rotkv INT2 runs
all of them at once. Both decode through rotkv's paged cache and kernels in a CUDA graph (the
bf16 preset keeps every token in its bf16 tier, read by the same split-K kernel), on a
random-weight model of a real shape (default: Qwen3-8B's attention and MLP shapes, Llama
architecture). The caches are filled synthetically (random keys and values written through the
cache's own write path and page flushes, chunk by chunk), not by a real prefill: ``fill`` says so.

    python benchmarks/bench_job.py --requests 32 --context 100000 --new-tokens 256
    python benchmarks/bench_job.py --tiny --device cpu     # a small shape, to check the script

Writes benchmarks/results/job-<UTC time>.json: one row per method with method, requests, context,
new_tokens, concurrent, prefill_s (the fill), first_token_s (the first step of each wave, which
captures the CUDA graph), decode_s (the other steps), step_ms, tok_per_s (steady: the other steps'
tokens over decode_s), job_tok_per_s (all new tokens over fill + first + decode), peak_gb,
speedup_vs_bf16 (steady), job_speedup_vs_bf16, fill, gpu, commit.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from rotkv.bench import commit, device_name
from rotkv.cache import RotkvCache
from rotkv.cache.layer import HybridLayer
from rotkv.cli.bench import RANDOM_SHAPES

TINY = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=512, vocab_size=1024)


def build_model(shape: dict, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**shape)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    return model


def fill_synthetic(model, cache, rows: int, context: int, chunk: int, seed: int = 0) -> None:
    """Put ``context`` random tokens per row into the cache through its own write and flush path."""
    layers = [layer for layer in cache.layers if isinstance(layer, HybridLayer)]
    ref = layers[0]
    dev, h, d = model.device, ref.kv_heads, ref.head_dim
    probe = torch.zeros(rows, h, 1, d, dtype=ref.tier_dtype, device=dev)
    for layer in layers:
        layer.lazy_initialization(probe, probe)
    st = cache.state
    st.reset(rows)
    st.chunk = chunk
    p = st.page
    if st.quantized:
        tier = st.sink_pages + -(-(st.window + p + chunk) // p) + 2
        body = -(-context // p) + 1
    else:
        tier, body = -(-(st.pad + context) // p) + 1, 0
    st.tier_free.grow(rows * tier)
    st.body_free.grow(max(1, rows * body))
    steps = st.plan(context, np.full(rows, context))
    st.chunk = cache.spec.prefill_chunk
    g = torch.Generator(device=dev).manual_seed(seed)
    kbuf = torch.randn(rows, h, chunk, d, generator=g, device=dev).to(ref.tier_dtype)
    vbuf = torch.randn(rows, h, chunk, d, generator=g, device=dev).to(ref.tier_dtype)
    for layer in tqdm(layers, desc="fill", leave=False):
        layer.pools.fit(st.tier_free.capacity, st.body_free.capacity)
        for step in steps:
            r, pos, slots = step.device_write(dev)
            layer.pools.write_tier(slots, kbuf[r, :, pos % chunk], vbuf[r, :, pos % chunk])
            if len(step.flush):
                layer.pools.flush(*step.device_flush(dev))
    st.plan_steps = []


def sync(dev) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


@torch.no_grad()
def run_wave(model, preset: str, rows: int, context: int, new_tokens: int, chunk: int, overrides: dict):
    from rotkv.hf.compat import cache_kwarg

    dev = model.device
    cache = RotkvCache(model, preset, check_finite=False, **overrides)
    t0 = sync(dev)
    fill_synthetic(model, cache, rows, context, chunk)
    fill_s = sync(dev) - t0
    tok = torch.randint(0, model.config.vocab_size, (rows,), device=dev)
    pos = torch.full((rows,), context, device=dev)
    kw = cache_kwarg(model)
    if dev.type == "cuda":
        from rotkv.cache.graph import GraphDecoder

        graph = GraphDecoder(model, cache, context + new_tokens, kw)

        def step(tok, pos):
            return graph.step(tok, pos).argmax(-1)
    else:
        def step(tok, pos):
            out = model(input_ids=tok[:, None], position_ids=pos[:, None], use_cache=True, **{kw: cache})
            return out.logits[:, -1].argmax(-1)
    # the first new token captures the CUDA graph: timed apart (first_s), the steady steps after it (decode_s)
    t1 = sync(dev)
    tok, pos = step(tok, pos), pos + 1
    t2 = sync(dev)
    for _ in range(new_tokens - 1):
        tok, pos = step(tok, pos), pos + 1
    decode_s = sync(dev) - t2
    stats = cache.stats()
    del cache
    gc.collect()
    return fill_s, t2 - t1, decode_s, stats


def kv_bytes_per_request(model, context: int) -> int:
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * context


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(RANDOM_SHAPES), default="qwen3-8b")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy shape (checks the script, e.g. on a CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--context", type=int, default=100_000)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=4096, help="fill chunk (tokens per row per write step)")
    ap.add_argument("--int2-preset", default="quarot-int2")
    ap.add_argument("--bf16-concurrent", type=int, default=None, help="bf16 requests at once (default: what fits)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    model = build_model(TINY if a.tiny else RANDOM_SHAPES[a.shape], a.device)
    dev = model.device
    per_req = kv_bytes_per_request(model, a.context + a.new_tokens)
    if a.bf16_concurrent:
        fit = a.bf16_concurrent
    elif dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        fit = max(1, min(a.requests, int(0.93 * free // per_req)))
    else:
        fit = a.requests
    rows = []
    results = {}
    for method, preset, concurrent in (("bf16", "bf16", fit), ("rotkv-int2", a.int2_preset, a.requests)):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        fill_s = first_s = decode_s = 0.0
        stats = None
        done = 0
        while done < a.requests:
            n = min(concurrent, a.requests - done)
            f, f1, d, stats = run_wave(model, preset, n, a.context, a.new_tokens, a.chunk, {})
            fill_s, first_s, decode_s, done = fill_s + f, first_s + f1, decode_s + d, done + n
        peak = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else 0.0
        new = a.requests * a.new_tokens
        steady = a.requests * (a.new_tokens - 1)
        results[method] = (steady / decode_s, new / (fill_s + first_s + decode_s))
        rows.append(dict(method=method, preset=preset, requests=a.requests, context=a.context, new_tokens=a.new_tokens,
                         concurrent=concurrent, waves=-(-a.requests // concurrent), prefill_s=round(fill_s, 3),
                         first_token_s=round(first_s, 3), decode_s=round(decode_s, 3),
                         step_ms=round(1e3 * decode_s / max(1, a.new_tokens - 1) / -(-a.requests // concurrent), 2),
                         tok_per_s=round(steady / decode_s, 1),
                         job_tok_per_s=round(new / (fill_s + first_s + decode_s), 1), peak_gb=round(peak, 2),
                         bits_per_element=round(stats["bits_per_element"], 3), fill="synthetic",
                         gpu=device_name(dev), commit=commit(),
                         model="tiny" if a.tiny else f"random:{a.shape}"))
        print(rows[-1], flush=True)
    for r in rows:
        r["speedup_vs_bf16"] = round(results[r["method"]][0] / results["bf16"][0], 3)
        r["job_speedup_vs_bf16"] = round(results[r["method"]][1] / results["bf16"][1], 3)
    out = a.out or os.path.join("benchmarks", "results", time.strftime("job-%Y%m%d-%H%M.json", time.gmtime()))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"rows": rows, "kv_bytes_per_request_bf16": per_req}, f, indent=1)
    for r in rows:
        print(f"{r['method']}: {r['concurrent']} at once, step {r['step_ms']} ms, {r['tok_per_s']} tok/s steady "
              f"(x{r['speedup_vs_bf16']} bf16); whole job {r['job_tok_per_s']} tok/s (x{r['job_speedup_vs_bf16']}), "
              f"peak {r['peak_gb']} GB")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
