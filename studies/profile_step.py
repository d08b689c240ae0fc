"""Where a graph-captured decode step spends its GPU time, rotkv bf16 and INT2 side by side.

Per preset: a random-weight model of a real shape, N rows of L tokens filled synthetically through
the cache's own write and flush path (``bench_job.fill_synthetic``), the CUDA-graph decode step
captured; then it times

- ``graph_ms``: ``GraphDecoder.step`` as generation calls it (host planning, table copies, the
  replay and, every P steps, the flush graph), averaged over a multiple of P steps;
- ``replay_ms``: the graph replay alone;
- ``graph_ms_eager_flush``: ``graph_ms`` with the flush run eagerly instead of replayed from its
  graph (``GraphDecoder(flush_graph=False)``, what every step did before the flush graph), then
  ``graph_ms_again`` with the flush graph (the spread between the two orders); every timing starts
  after a flush, so the flush graph's one-off capture is not in them;
- the decode-time flush (every P steps each row's oldest window page is quantized into the body):
  ``flush_ms_by_pages`` its graph's replay alone at 1, 8 and N pages at once (a continuous batch's rows
  flush a few pages a step), ``flush_ms`` at N, ``flush_per_step_ms`` that over P steps and
  ``flush_share`` its share of ``graph_ms``;

and records replays with ``torch.profiler``, summing the GPU time per kernel and per *category*
(attention body / tier / merge, write and flush, rotations (small matmuls), the model's GEMMs,
norms and elementwise, copies), so that what costs INT2 more than bf16 is read off one table.

    python studies/profile_step.py --shape smollm2 --requests 64 --context 8192
    python studies/profile_step.py --shape qwen3-8b --layers 8 --requests 4 --context 32768
    # "+compile": the model's own layers compiled into the graph (rotkv.cache.compiled)
    python studies/profile_step.py --shape smollm2 --presets bf16 bf16+compile quarot-int2 quarot-int2+compile
    # a real model (a GGUF or a model directory) and presets that need an artifact (the artifact folder, named as rotkv eval names them)
    python studies/profile_step.py --model $ROTKV_GGUF --artifact-dir artifacts --presets bf16 quarot-int2 oscar-mix
    # a preset's layout as CacheSpec overrides (random weights have no artifact): PRESET[+compile]@field=value,...
    python studies/profile_step.py --shape qwen3-8b --layers 8 --requests 16 --context 32768 \
        --presets "quarot-int2+compile@sink=4,window=32,refine_tokens=224,refine_values=true,refine_every=19"

Writes benchmarks/results/stepprof-<UTC time>-<shape>.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # profile_prefill.py
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))  # bench_job.py, results_io.py
from bench_job import build_model, fill_synthetic  # noqa: E402
from job_reasoning import split_overrides  # noqa: E402
from profile_prefill import preset_artifact  # noqa: E402
from results_io import write_results  # noqa: E402

from rotkv.bench import commit, device_name  # noqa: E402
from rotkv.cache import RotkvCache  # noqa: E402
from rotkv.cli.bench import RANDOM_SHAPES  # noqa: E402

SHAPES = dict(RANDOM_SHAPES)
SHAPES.setdefault("smollm2", dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                  head_dim=64, intermediate_size=1536, vocab_size=49152, rope_theta=1e5,
                                  max_position_embeddings=8192, tie_word_embeddings=True))

# kernel name -> category, first match wins (names of the rotkv kernels, cuBLAS/cutlass GEMMs, torch ops)
CATEGORIES = [
    ("compiled model ops (inductor)", r"^triton_(poi|red|per|tem)_"),
    ("attn: CUDA INT2 body", r"int2_decode_kernel"),
    ("attn: Triton split (tier; body at D 64)", r"_split_kernel"),
    ("attn: merge", r"_merge_kernel"),
    ("attn: other", r"flash|fmha|attn|sdpa"),
    ("write / flush", r"write_plain|write_rot|_quant_write|index_put|scatter|_dequant"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|matmul|splitK"),
    ("norm / elementwise", r"elementwise|vectorized|reduce|norm|silu|mul|add|pow|rsqrt|unrolled|triton_"),
    ("copy / cast", r"copy|cat|memcpy|memset|fill"),
]


def category(name: str) -> str:
    for cat, pat in CATEGORIES:
        if re.search(pat, name, re.I):
            return cat
    return "other"


def timed(fn, n: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def flush_profile(graph, rows: int) -> dict[int, float]:
    """The decode-time flush's GPU time alone, ms per flush, by pages flushed at once: 1, 8 and ``rows``
    (a lockstep batch flushes every row's page on one step in P; the rows of a continuous batch flush a
    few pages a step, ``rotkv.cache.graph.flush_bucket``), each a replay of its flush graph (captured
    here where the run has not). Run it last: a replay quantizes the last flush's tier pages again, which
    hold newer tokens by now, into body pages still in use."""
    out = {}
    for n in sorted({1, min(8, rows), rows}):
        g = graph._flush_captured.get(n)
        if g is None:
            pages = graph.flush_pages[:, :n]  # the first n rows' pages of the last flush
            graph._flush_layers(*pages)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                graph._flush_layers(*pages)
        out[n] = round(timed(g.replay, 16), 4)
    return out


@torch.no_grad()
def profile_preset(model, preset: str, rows: int, context: int, chunk: int, steps: int,
                   artifact_dir: str | None = None) -> dict:
    from torch.profiler import ProfilerActivity, profile

    from rotkv.cache.graph import GraphDecoder
    from rotkv.hf.compat import cache_kwarg

    name = preset
    preset, overrides = split_overrides(preset)
    preset, plus, flag = preset.partition("+")
    if plus and flag != "compile":
        raise ValueError(f"{name!r}: the one suffix is +compile (the model's layers compiled into the graph)")
    cache = RotkvCache(model, preset, artifact=preset_artifact(preset, artifact_dir), check_finite=False, **overrides)
    fill_synthetic(model, cache, rows, context, chunk)
    dev = model.device
    p = cache.spec.page_size
    state = {"tok": torch.randint(0, model.config.vocab_size, (rows,), device=dev),
             "pos": torch.full((rows,), context, device=dev)}
    graph = GraphDecoder(model, cache, context + 16 * p + 64, cache_kwarg(model), compile_layers=bool(plus))

    def gstep():
        state["tok"] = graph.step(state["tok"], state["pos"]).argmax(-1)
        state["pos"] = state["pos"] + 1

    t0 = time.perf_counter()
    gstep()  # the warm-up step and the capture (and, with +compile, the layers' compile)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t0
    for _ in range(p + 2):  # past a flush: the flush graph is captured before anything is timed
        gstep()
    graph_ms = timed(gstep, 4 * p)
    graph.flush_graph = False
    eager_flush_ms = timed(gstep, 4 * p)
    graph.flush_graph = True
    graph_ms_again = timed(gstep, 4 * p)  # the flush graph again: how much the two orders differ
    replay_ms = timed(graph.graph.replay, 16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            graph.graph.replay()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            kernels[e.key] = {"us": round(us / steps, 2), "calls": e.count / steps, "category": category(e.key)}
    cats: dict[str, float] = {}
    for k in kernels.values():
        cats[k["category"]] = round(cats.get(k["category"], 0.0) + k["us"], 2)
    flush = flush_profile(graph, rows) if cache.spec.quantized else {}
    stats = cache.stats()
    del graph, cache
    gc.collect()
    torch.cuda.empty_cache()
    return dict(preset=name, first_step_s=round(first_s, 2), graph_ms=round(graph_ms, 3), graph_ms_eager_flush=round(eager_flush_ms, 3),
                graph_ms_again=round(graph_ms_again, 3),
                replay_ms=round(replay_ms, 3),
                kernel_ms=round(sum(cats.values()) / 1e3, 3), categories=cats,
                kernels=dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us"])),
                flush_ms_by_pages=flush, flush_ms=flush.get(rows, 0.0),
                flush_per_step_ms=round(flush.get(rows, 0.0) / p, 4),
                flush_share=round(flush.get(rows, 0.0) / p / graph_ms, 4) if graph_ms else 0.0,
                bits_per_element=round(stats["bits_per_element"], 3), kv_gb=round(stats["kv_bytes"] / 1e9, 3))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="random weights of this shape")
    ap.add_argument("--model", default=None, help="a real model instead (GGUF file or model directory)")
    ap.add_argument("--artifact-dir", default=None, help="the artifacts of presets that need one (as rotkv eval names them)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the real shape")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--presets", nargs="+", default=["bf16", "quarot-int2"])
    ap.add_argument("--steps", type=int, default=8, help="profiled replays")
    ap.add_argument("--chunk", type=int, default=2048, help="fill chunk")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA device")
    if a.model:
        from rotkv.hf.models import load_model

        if a.layers:
            ap.error("--layers is for random shapes")
        model = load_model(a.model, device="cuda").model
        shape = {"num_hidden_layers": model.config.num_hidden_layers}
        a.shape = os.path.basename(a.model.rstrip("/")).split(".")[0]
    else:
        shape = dict(SHAPES[a.shape])
        if a.layers:
            shape["num_hidden_layers"] = a.layers
        model = build_model(shape, "cuda")
    res = [profile_preset(model, p, a.requests, a.context, a.chunk, a.steps, a.artifact_dir) for p in a.presets]
    cats = sorted({c for r in res for c in r["categories"]}, key=lambda c: -max(r["categories"].get(c, 0) for r in res))
    label = f"{a.shape}{'-' + str(a.layers) + 'L' if a.layers else ''} {a.requests} x {a.context}"
    print(f"\n## {label}  (us per step; graph = GraphDecoder.step incl. host work and flush)")
    print("| category | " + " | ".join(r["preset"] for r in res) + " |")
    print("|---|" + "---|" * len(res))
    for c in cats:
        print(f"| {c} | " + " | ".join(f"{r['categories'].get(c, 0):.0f}" for r in res) + " |")
    for key in ("kernel_ms", "replay_ms", "graph_ms", "graph_ms_eager_flush", "graph_ms_again", "flush_ms",
                "flush_per_step_ms", "flush_share"):
        print(f"| **{key}** | " + " | ".join(f"{r[key]:.3f}" for r in res) + " |")
    for r in res:
        print(f"top kernels, {r['preset']}:")
        for name, k in list(r["kernels"].items())[:8]:
            print(f"  {k['us']:9.1f} us {k['calls']:5.1f}x  [{k['category']}] {name[:90]}")
    write_results("stepprof", dict(shape=a.shape, layers=shape["num_hidden_layers"], requests=a.requests,
                                   context=a.context, results=res, gpu=device_name(model.device), commit=commit()),
                  tag=a.shape, out=a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
