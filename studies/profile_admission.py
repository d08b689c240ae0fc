"""Where an admission's time goes (issue 40's long-generation job, whose INT2 admission was its measured bound in
docs/results/gpu-h100-run12): one group of ``--group`` requests, prompts
uniform in ``--prompt-tokens``, prefilled into a cache of their own and adopted into a batch's rows, as
:func:`rotkv.jobs.run_job` does it, for each method (``rotkv:<preset>@overrides`` as in
``bench_job.py --workload reasoning``).

Per method: the host time of each part (making the group's cache, the model calls, ``adopt_rows``; the
device synchronized around each), then one group under ``torch.profiler``: the ops with the most device time,
the most host time, and the host-device syncs (``cudaStreamSynchronize``, ``cudaMemcpy*`` calls).

    python studies/profile_admission.py --shape qwen3-8b --out prof-admission.txt
    python studies/profile_admission.py --tiny --device cpu     # checks the script
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_job import build_model  # noqa: E402
from job_reasoning import REFINE_TIERS, TINY, make_requests, split_overrides  # noqa: E402

from rotkv.bench import device_name, parse_method  # noqa: E402
from rotkv.cache import RotkvCache  # noqa: E402
from rotkv.cli.bench import RANDOM_SHAPES  # noqa: E402
from rotkv.generation import prefill  # noqa: E402
from rotkv.jobs import left_padded  # noqa: E402


def sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def admit(model, make, cache, reqs, rows, dev, times=None):
    ids, mask = left_padded(reqs)
    t0 = time.perf_counter()
    side = make()
    sync(dev)
    t1 = time.perf_counter()
    prefill(model, ids, side, mask)
    sync(dev)
    t2 = time.perf_counter()
    cache.adopt_rows(rows, side, list(range(len(reqs))))
    sync(dev)
    t3 = time.perf_counter()
    cache.release_rows(rows)
    if times is not None:
        times.append((t1 - t0, t2 - t1, t3 - t2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(RANDOM_SHAPES), default="qwen3-8b")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--methods", nargs="+", default=[f"rotkv:quarot-int2@{REFINE_TIERS}", "rotkv:bf16"])
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(512, 2048))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None, help="also write the report here")
    a = ap.parse_args()
    dev = torch.device(a.device)
    shape = dict(TINY if a.tiny else RANDOM_SHAPES[a.shape])
    if a.layers:
        shape["num_hidden_layers"] = a.layers
    model = build_model(shape, a.device)
    reqs = make_requests(a.group * (a.repeats + 2), tuple(a.prompt_tokens), (64, 64), shape["vocab_size"])
    lines = [f"# admission profile: {a.shape if not a.tiny else 'tiny'} ({shape['num_hidden_layers']} layers), "
             f"groups of {a.group}, prompts {a.prompt_tokens[0]}-{a.prompt_tokens[1]}, {device_name(dev)}"]
    for method in a.methods:
        name, overrides = split_overrides(method)
        preset, _ = parse_method(name)

        def make():
            return RotkvCache(model, preset, None, check_finite=False, context_length=4096, **overrides)

        cache = make()
        cache.open_rows(a.group, a.group * 16, a.group * (a.prompt_tokens[1] // 8 + 8), dev)
        rows = list(range(a.group))
        groups = [reqs[i * a.group:(i + 1) * a.group] for i in range(a.repeats + 2)]
        admit(model, make, cache, groups[0], rows, dev)  # warm-up: kernel builds
        times = []
        for g in groups[1:-1]:
            admit(model, make, cache, g, rows, dev, times)
        med = [sorted(t[k] for t in times)[len(times) // 2] for k in range(3)]
        lines.append(f"\n## {method}\nmedian over {len(times)} groups: cache {1e3 * med[0]:.1f} ms, model "
                     f"{1e3 * med[1]:.1f} ms, adopt {1e3 * med[2]:.1f} ms (tokens per group: "
                     f"{sum(len(r.ids) for r in groups[1])})")
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with torch.profiler.profile(activities=acts) as prof:
            admit(model, make, cache, groups[-1], rows, dev)
        ev = prof.key_averages()
        dkey = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        for title, key in (("device time", dkey), ("host time", "self_cpu_time_total")):
            lines.append(f"\n### top {a.top} ops by {title}\n")
            lines.append(ev.table(sort_by=key, row_limit=a.top, max_name_column_width=60))
        aten = sum(e.count for e in ev if e.key.startswith("aten::"))
        launches = sum(e.count for e in ev if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC"))
        lines.append(f"\nops in the profiled group: {aten} aten calls (nested included), {launches} kernel launches")
        syncs = [(e.key, e.count, e.cpu_time_total / 1e3) for e in ev
                 if "Synchronize" in e.key or "Memcpy" in e.key or "local_scalar" in e.key or "nonzero" in e.key]
        lines.append("\n### syncs and copies (op, calls, host ms)\n")
        lines += [f"{k}: {n}, {ms:.2f}" for k, n, ms in sorted(syncs, key=lambda s: -s[1])]
        del cache
    report = "\n".join(lines)
    print(report)
    if a.out:
        with open(a.out, "w") as f:
            f.write(report + "\n")


if __name__ == "__main__":
    main()
