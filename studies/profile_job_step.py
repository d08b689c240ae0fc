"""Where a decode step of the job benchmark spends its GPU time (the kernels in the model).

Builds the job benchmark's setting (``bench_job.py``: random-weight Qwen3-8B shapes, N requests of L
tokens filled synthetically through the cache's write path), captures the CUDA-graph decode step,
times it, then records a few replays with ``torch.profiler`` and sums the GPU time per kernel name,
so the attention kernels in the model can be set against the isolated kernel benchmark
(``bench_decode.py``) and against the rest of the step.

    python studies/profile_job_step.py --requests 32 --context 100000

Writes benchmarks/results/jobprof-<UTC time>.json.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))  # bench_job.py, results_io.py
from bench_job import build_model, fill_synthetic  # noqa: E402
from results_io import write_results  # noqa: E402

from rotkv.bench import commit, device_name  # noqa: E402
from rotkv.cache import RotkvCache  # noqa: E402
from rotkv.cli.bench import RANDOM_SHAPES  # noqa: E402


def step_ms(fn, n: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(RANDOM_SHAPES), default="qwen3-8b")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--context", type=int, default=100_000)
    ap.add_argument("--preset", default="quarot-int2")
    ap.add_argument("--steps", type=int, default=8, help="profiled replays")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from rotkv.cache.graph import GraphDecoder
    from rotkv.hf.compat import cache_kwarg

    model = build_model(RANDOM_SHAPES[args.shape], "cuda")
    cache = RotkvCache(model, args.preset, check_finite=False)
    fill_synthetic(model, cache, args.requests, args.context, args.chunk)
    dev = model.device
    tok = torch.randint(0, model.config.vocab_size, (args.requests,), device=dev)
    pos = torch.full((args.requests,), args.context, device=dev)
    graph = GraphDecoder(model, cache, args.context + 64, cache_kwarg(model))
    state = {"tok": tok, "pos": pos}

    def step():  # one graph replay, no flush (P steps apart) and no host planning in the timing
        graph.graph.replay()

    for _ in range(3):
        state["tok"] = graph.step(state["tok"], state["pos"]).argmax(-1)
        state["pos"] = state["pos"] + 1
    full = step_ms(lambda: graph.step(state["tok"], state["pos"]), 16)
    replay = step_ms(step, 16)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            kernels[e.key] = {"us_per_step": us / args.steps, "calls_per_step": e.count / args.steps}
    total = sum(k["us_per_step"] for k in kernels.values())
    rows = sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_step"])
    print(f"step: {full:.2f} ms (graph.step), {replay:.2f} ms (replay alone); profiled kernel time {total / 1e3:.2f} ms/step")
    print(f"{'us/step':>9} {'calls':>6}  kernel")
    for name, k in rows[:30]:
        print(f"{k['us_per_step']:9.1f} {k['calls_per_step']:6.1f}  {name[:110]}")
    res = dict(shape=args.shape, requests=args.requests, context=args.context, preset=args.preset,
               step_ms=full, replay_ms=replay, kernel_ms=total / 1e3, kernels=dict(rows), gpu=device_name(dev),
               commit=commit())
    write_results("jobprof", res, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
