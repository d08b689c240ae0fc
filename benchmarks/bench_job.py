"""Job throughput (the serving headline): N requests of L tokens each, T new tokens each, on one GPU.

Every request is prefilled through the model (``rotkv.generation.prefill``: model calls of one
chunk, the cache's own chunk by default) and then decoded greedily, in waves of as many requests as
fit at once for each method: bf16 (rotkv's bf16 preset: every token in its bf16 tier, read by the
same split-K kernel) and rotkv INT2. Both decode through rotkv's paged cache in a CUDA graph, on a
random-weight model of a real shape (default: Qwen3-8B's attention and MLP shapes, Llama
architecture). What fits: ``--concurrent-bf16`` / ``--concurrent-int2``, else estimated from the
free GPU memory and the cache's bytes per request; a wave that runs out of memory is retried at
half the rows (``retries`` counts them). ``--fill synthetic`` writes random keys and values through
the cache's own write path instead of running the model over the prompt (the earlier headline;
the rows then say ``fill: "synthetic"``).

    python benchmarks/bench_job.py --requests 32 --context 32768 --new-tokens 1024
    python benchmarks/bench_job.py --tiny --device cpu     # a small shape, to check the script
    python benchmarks/bench_job.py --workload reasoning ...  # short prompts, 8K-32K new tokens,
                                                             # continuous batching (benchmarks/job_reasoning.py)

Writes benchmarks/results/job-<UTC time>.json: one row per method with method, requests, context,
new_tokens, concurrent, waves, retries, prefill_s (every wave's prefill, or synthetic fill),
first_token_s (the first step of each wave, which captures the CUDA graph), decode_s (the other
steps), step_ms, tok_per_s (steady: the other steps' tokens over decode_s), job_s and
job_tok_per_s (all new tokens over prefill + first + decode), peak_gb, speedup_vs_bf16 (steady),
job_speedup_vs_bf16, prefill_speedup_vs_bf16, fill, prefill_chunk, gpu, commit.
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
    steps = st.plan(context, np.full(rows, context))
    st.chunk = cache.spec.prefill_chunk
    g = torch.Generator(device=dev).manual_seed(seed)
    kbuf = torch.randn(rows, h, chunk, d, generator=g, device=dev).to(ref.tier_dtype)
    vbuf = torch.randn(rows, h, chunk, d, generator=g, device=dev).to(ref.tier_dtype)
    take = lambda r, pos: (kbuf[r, :, pos % chunk], vbuf[r, :, pos % chunk])  # noqa: E731
    for layer in tqdm(layers, desc="fill", leave=False):
        layer.pools.fit(st.tier_free.capacity, st.body_free.capacity, st.rows)  # the tiers hold every row
        for step in steps:
            layer.store(step, take)
    st.plan_steps = []


def sync(dev) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


@torch.no_grad()
def run_wave(model, preset: str, rows: int, context: int, new_tokens: int, chunk: int | None, overrides: dict,
             fill: str = "prefill", seed: int = 0, compile_layers: bool = False):
    """One wave: ``rows`` requests prefilled (or filled synthetically) then decoded greedily.
    Returns (prefill_s, first_step_s, decode_s, cache stats)."""
    from rotkv.generation import prefill
    from rotkv.hf.compat import cache_kwarg

    dev = model.device
    extra = dict(overrides)
    if chunk:
        extra["prefill_chunk"] = chunk
    cache = RotkvCache(model, preset, check_finite=False, **extra)
    ids = torch.randint(100, model.config.vocab_size - 1, (rows, context), generator=torch.Generator().manual_seed(seed))
    t0 = sync(dev)
    if fill == "prefill":
        tok = prefill(model, ids, cache).argmax(-1)
    else:
        fill_synthetic(model, cache, rows, context, chunk or cache.spec.prefill_chunk)
        tok = ids[:, -1].to(dev)
    fill_s = sync(dev) - t0
    del ids
    pos = torch.full((rows,), context, device=dev)
    kw = cache_kwarg(model)
    if dev.type == "cuda":
        from rotkv.cache.graph import GraphDecoder

        graph = GraphDecoder(model, cache, context + new_tokens, kw, compile_layers=compile_layers)

        def step(tok, pos):
            return graph.step(tok, pos).argmax(-1)
    else:
        def step(tok, pos):
            out = model(input_ids=tok[:, None], position_ids=pos[:, None], use_cache=True, **{kw: cache})
            return out.logits[:, -1].argmax(-1)
    # the first new token (from the prefill's logits) is free; the first step captures the CUDA
    # graph: timed apart (first_s), the steady steps after it (decode_s)
    t1 = sync(dev)
    tok, pos = step(tok, pos), pos + 1
    t2 = sync(dev)
    for _ in range(new_tokens - 2):
        tok, pos = step(tok, pos), pos + 1
    decode_s = sync(dev) - t2
    cache.check_metadata_range()  # the graph's eager flushes (one sync, after the timing)
    stats = cache.stats()
    del cache
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return fill_s, t2 - t1, decode_s, stats


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def kv_bytes_per_request(model, context: int) -> int:
    c = model.config
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 * context


def int2_bytes_per_request(model, context: int, spec) -> int:
    """Bytes an INT2 request holds: the body at ``bits`` plus fp16 scale and minimum per group, and
    the bf16 tier (sink + window + one page)."""
    c = model.config
    d = c.head_dim
    g = spec.resolved_group(d)
    per_token_body = 2 * c.num_key_value_heads * (d * spec.bits // 8 + 4 * (d // g))
    tier = spec.sink + spec.window + spec.page_size
    return c.num_hidden_layers * (per_token_body * context + 2 * c.num_key_value_heads * d * 2 * tier)


def fits(model, per_request: int, requests: int, chunk: int, reserve_gb: float) -> int:
    """Requests at once: what the free GPU memory holds after ``reserve_gb`` (activations of one
    prefill chunk, the dequantized history of one layer-chunk, the CUDA graph's buffers)."""
    free, _ = torch.cuda.mem_get_info(model.device)
    return max(1, min(requests, int((free - reserve_gb * 1e9) // per_request)))


def main(argv=None) -> int:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workload", choices=["prefill", "reasoning"], default="prefill")
    known, rest = pre.parse_known_args(argv)
    if known.workload == "reasoning":  # short prompts, long generations, continuous batching: its own options
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import job_reasoning

        return job_reasoning.main(rest)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=["prefill", "reasoning"], default="prefill",
                    help="prefill: this job (long prompts, few new tokens, waves); reasoning: short prompts and "
                         "long generations, continuous batching (benchmarks/job_reasoning.py; --workload reasoning -h)")
    ap.add_argument("--shape", choices=sorted(RANDOM_SHAPES), default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy shape (checks the script, e.g. on a CPU)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--fill", choices=["prefill", "synthetic"], default="prefill",
                    help="prefill: every request through the model (the headline); synthetic: random keys/values")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk, tokens per row per model call "
                    "(default: the cache's prefill_chunk)")
    ap.add_argument("--int2-preset", default="quarot-int2")
    ap.add_argument("--artifact", default=None, help="calibration artifact for an artifact preset (oscar-mix, ...)")
    ap.add_argument("--concurrent-bf16", "--bf16-concurrent", dest="concurrent_bf16", type=int, default=None,
                    help="bf16 requests at once (default: what fits)")
    ap.add_argument("--concurrent-int2", type=int, default=None, help="INT2 requests at once (default: what fits)")
    ap.add_argument("--reserve-gb", type=float, default=12.0,
                    help="GPU memory kept free for the prefill's activations when estimating what fits")
    ap.add_argument("--compile-layers", action="store_true",
                    help="the model's own layers compiled into the captured decode step (rotkv.cache.compiled; CUDA)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for name in ("requests", "context"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} has to be >= 1")
    if a.new_tokens < 2:
        raise SystemExit("--new-tokens has to be >= 2 (the first comes from the prefill, the second is the graph's capture)")
    shape = dict(TINY if a.tiny else RANDOM_SHAPES[a.shape])
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    model = build_model(shape, a.device)
    dev = model.device
    from rotkv.config import get_preset

    int2_spec = get_preset(a.int2_preset)
    chunk = a.chunk or int2_spec.prefill_chunk
    per_req = {"bf16": kv_bytes_per_request(model, a.context + a.new_tokens),
               "rotkv-int2": int2_bytes_per_request(model, a.context + a.new_tokens, int2_spec)}
    overrides = {"bf16": {}, "rotkv-int2": {"artifact": a.artifact} if a.artifact else {}}
    rows = []
    results = {}
    for method, preset, fixed in (("bf16", "bf16", a.concurrent_bf16), ("rotkv-int2", a.int2_preset, a.concurrent_int2)):
        if fixed:
            concurrent = fixed
        elif dev.type == "cuda":
            concurrent = fits(model, per_req[method], a.requests, chunk, a.reserve_gb)
        else:
            concurrent = a.requests
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        fill_s = first_s = decode_s = 0.0
        stats = None
        done = retries = waves = 0
        while done < a.requests:
            n = min(concurrent, a.requests - done)
            try:
                f, f1, d, stats = run_wave(model, preset, n, a.context, a.new_tokens, a.chunk, overrides[method], a.fill,
                                           seed=done, compile_layers=a.compile_layers)
            except Exception as e:  # noqa: BLE001 - an OOM is retried at half the rows
                if not _is_oom(e) or n == 1:
                    raise
                gc.collect()
                torch.cuda.empty_cache()
                concurrent, retries = max(1, n // 2), retries + 1
                print(f"{method}: {n} at once ran out of memory; retrying at {concurrent}", flush=True)
                continue
            fill_s, first_s, decode_s, done, waves = fill_s + f, first_s + f1, decode_s + d, done + n, waves + 1
        peak = torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else 0.0
        new = a.requests * a.new_tokens
        steady = a.requests * (a.new_tokens - 2)
        job_s = fill_s + first_s + decode_s
        results[method] = (steady / decode_s, new / job_s, fill_s)
        rows.append(dict(method=method, preset=preset, requests=a.requests, context=a.context, new_tokens=a.new_tokens,
                         concurrent=concurrent, waves=waves, retries=retries, prefill_s=round(fill_s, 3),
                         first_token_s=round(first_s, 3), decode_s=round(decode_s, 3),
                         step_ms=round(1e3 * decode_s / max(1, a.new_tokens - 2) / waves, 2),
                         tok_per_s=round(steady / decode_s, 1), job_s=round(job_s, 3),
                         job_tok_per_s=round(new / job_s, 1), peak_gb=round(peak, 2),
                         bits_per_element=round(stats["bits_per_element"], 3), fill=a.fill, prefill_chunk=chunk,
                         gpu=device_name(dev), commit=commit(),
                         model="tiny" if a.tiny else f"random:{a.shape}" + (f" ({a.layers} layers)" if a.layers else "")))
        print(rows[-1], flush=True)
    for r in rows:
        r["speedup_vs_bf16"] = round(results[r["method"]][0] / results["bf16"][0], 3)
        r["job_speedup_vs_bf16"] = round(results[r["method"]][1] / results["bf16"][1], 3)
        r["prefill_speedup_vs_bf16"] = round(results["bf16"][2] / results[r["method"]][2], 3)
    out = a.out or os.path.join("benchmarks", "results", time.strftime("job-%Y%m%d-%H%M.json", time.gmtime()))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"rows": rows, "compile_layers": a.compile_layers, "kv_bytes_per_request_bf16": per_req["bf16"],
                   "kv_bytes_per_request_int2_estimate": per_req["rotkv-int2"]}, f, indent=1)
    for r in rows:
        print(f"{r['method']}: {r['concurrent']} at once in {r['waves']} waves, prefill {r['prefill_s']} s "
              f"({r['fill']}), step {r['step_ms']} ms, {r['tok_per_s']} tok/s steady (x{r['speedup_vs_bf16']} bf16); "
              f"whole job {r['job_s']} s, {r['job_tok_per_s']} tok/s (x{r['job_speedup_vs_bf16']}), peak {r['peak_gb']} GB")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
