"""The prefill work on the GPU in one process per section: prefill peak memory and time, the prefill-chunk
sweep, capacity (largest batch) and the job benchmark with real prefill, on random-weight models of
real shapes. Called by studies/device/device_prefill.sh; runs on a CPU with ``--device cpu --tiny``
(tiny shapes, no hf-static-compile or CUDA graphs) to check the script.

Sections (``--sections``, in this order):

- ``peak``: ``rotkv bench`` rows (prefill_s, step_ms, peak_gb, cache_gb) for
  (a) Qwen3-8B shape, 8 layers, 4 x 32K; (b) all 36 layers, 8 x 32K; (c) SmolLM2 shape, 64 x 8K;
  methods rotkv:quarot-int2+graph, rotkv:bf16+graph, hf-static-compile (oscar-mix needs a
  calibration artifact of the model: none exists for random weights, so it is not run);
- ``sweep``: shape (a) with the prefill chunk at 1024, 2048, 4096, 8192 tokens per row;
- ``capacity``: shape (b) at 32K: the largest batch of rotkv:bf16+graph and hf-static-compile
  (doubling, then bisection, tries capped), then rotkv:quarot-int2+graph tried at 4x the best bf16's
  (``--int2-tries`` tries: at 1, the row says whether the 4x target fits, exact: false);
- ``job``: benchmarks/bench_job.py with real prefill at ``--job-requests`` x ``--job-context``.

Writes JSONs under ``--out`` (and a summary table, also printed at the end).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import asdict

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rotkv import bench  # noqa: E402
from rotkv.cli.bench import RANDOM_SHAPES  # noqa: E402

TINY = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=512, vocab_size=1024, max_position_embeddings=8192)
GPU_METHODS = ["rotkv:quarot-int2+graph", "rotkv:bf16+graph", "hf-static-compile"]
CPU_METHODS = ["rotkv:quarot-int2", "rotkv:bf16", "hf-dynamic"]


def build(shape: str, layers: int | None, device: str, tiny: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(TINY if tiny else RANDOM_SHAPES[shape])
    if layers and not tiny:
        fields["num_hidden_layers"] = layers
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    finally:
        torch.set_default_dtype(old)
    name = "tiny" if tiny else f"random:{shape}" + (f" ({layers} layers)" if layers else "")
    return model, name


def free(model=None) -> None:
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def save(path: str, rows, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)


def section_peak(a, methods, out: str) -> list:
    cases = [("a", "qwen3-8b", 8, 4, 32768), ("b", "qwen3-8b", 36, 8, 32768), ("c", "smollm2", None, 64, 8192)]
    if a.tiny:
        cases = [("a", "tiny", None, 2, 96), ("c", "tiny", None, 3, 64)]
    rows = []
    for tag, shape, layers, b, c in cases:
        if a.cases and tag not in a.cases:
            continue
        t0 = time.perf_counter()
        model, name = build(shape, layers, a.device, a.tiny)
        r = bench.bench(model, name, methods, [b], [c], a.new_tokens, progress=False)
        for row in r:
            row.note = (row.note + f" case {tag}").strip()
        rows += r
        save(os.path.join(out, f"generate-prefill-{tag}.json"), r, {"case": tag, "shape": shape, "layers": layers})
        free(model)
        print(f"peak case {tag} done in {time.perf_counter() - t0:.0f} s", flush=True)
        print(bench.table(r), flush=True)
    return rows


def section_sweep(a, methods, out: str) -> list:
    shape, layers, b, c = ("tiny", None, 2, 96) if a.tiny else ("qwen3-8b", 8, 4, 32768)
    model, name = build(shape, layers, a.device, a.tiny)
    rows = []
    chunks = [16, 32, 64] if a.tiny else [1024, 2048, 4096, 8192]
    for chunk in chunks:
        r = bench.bench(model, name, [m for m in methods if m.startswith("rotkv:")], [b], [c], a.new_tokens,
                        progress=False, prefill_chunk=chunk)
        for row in r:
            row.note = f"prefill_chunk {chunk}"
        rows += r
        save(os.path.join(out, "generate-prefill-sweep.json"), rows, {"chunks": chunks})
    free(model)
    print(bench.table(rows), flush=True)
    return rows


def section_capacity(a, out: str) -> list:
    shape, layers, c = ("tiny", None, 64) if a.tiny else ("qwen3-8b", 36, 32768)
    model, name = build(shape, layers, a.device, a.tiny)
    path = os.path.join(out, "capacity-prefill.json")
    cuda = a.device == "cuda"
    bf16_methods = ["rotkv:bf16+graph", "hf-static-compile"] if cuda else ["rotkv:bf16"]
    rows = []
    for m, start, tries in zip(bf16_methods, (a.bf16_start, a.static_start), (a.bf16_tries, a.static_tries)):
        rows += bench.capacity(model, name, [m], c, a.capacity_new_tokens, start=start, max_tries=tries,
                               limit=a.limit)
        save(path, rows, {"context": c})
    best = max((r.max_batch for r in rows), default=0)
    int2 = "rotkv:quarot-int2+graph" if cuda else "rotkv:quarot-int2"
    rows += bench.capacity(model, name, [int2], c, a.capacity_new_tokens, start=max(1, 4 * best), max_tries=a.int2_tries,
                           limit=a.limit)
    save(path, rows, {"context": c, "int2_start": 4 * best})
    free(model)
    print(bench.capacity_table(rows), flush=True)
    return rows


def section_job(a, out: str) -> list:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import bench_job

    path = os.path.join(out, "job-prefill.json")
    argv = ["--requests", str(a.job_requests), "--context", str(a.job_context), "--new-tokens", str(a.job_new_tokens),
            "--device", a.device, "--out", path]
    argv += ["--tiny"] if a.tiny else ["--layers", str(a.job_layers)]
    bench_job.main(argv)
    with open(path) as f:
        return json.load(f)["rows"]


def summary(peak, sweep, cap, job) -> str:
    lines = ["## prefill device summary", "", "| case | method | B x L | prefill s | step ms | peak GB | cache GB | note |",
             "|---|---|---|---|---|---|---|---|"]
    for r in peak + sweep:
        lines.append(f"| {r.note} | {r.method} | {r.batch} x {r.context} | {r.prefill_s} | {r.step_ms} | {r.peak_gb} | "
                     f"{r.cache_gb} | |")
    # the targets' ratios, where their rows exist
    by = {(r.note.split()[-1], r.method): r for r in peak}
    for tag in ("a", "b", "c"):
        st = by.get((tag, "hf-static-compile"))
        for m in ("rotkv:quarot-int2+graph", "rotkv:quarot-int2"):
            q = by.get((tag, m))
            if q and st and st.peak_gb == st.peak_gb and st.peak_gb:
                bf = [by.get((tag, x)) for x in ("hf-static-compile", "rotkv:bf16+graph", "rotkv:bf16", "hf-dynamic")]
                best = min((x.prefill_s for x in bf if x and x.prefill_s == x.prefill_s), default=float("nan"))
                lines.append(f"case {tag}: {m} peak / hf-static-compile peak = {q.peak_gb / st.peak_gb:.3f}; "
                             f"prefill / best bf16 prefill = {q.prefill_s / best:.3f}")
    if cap:
        lines += ["", bench.capacity_table(cap)]
        bf = [r for r in cap if "int2" not in r.method]
        q = [r for r in cap if "int2" in r.method]
        if bf and q:
            best = max(bf, key=lambda r: r.max_batch)
            lines.append(f"capacity: INT2 {q[0].max_batch} ({'exact' if q[0].exact else 'at least'}) vs best bf16 "
                         f"{best.method} {best.max_batch} ({'exact' if best.exact else f'below {best.failed_at}' if best.failed_at else 'at least'}): "
                         f"{q[0].max_batch / max(best.max_batch, 1):.2f}x")
    if job:
        lines += ["", "| job method | concurrent | waves | prefill s | decode s | job s | job x bf16 | steady x bf16 | fill |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in job:
            lines.append(f"| {r['method']} | {r['concurrent']} | {r['waves']} | {r['prefill_s']} | {r['decode_s']} | "
                         f"{r['job_s']} | {r['job_speedup_vs_bf16']} | {r['speedup_vs_bf16']} | {r['fill']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="peak,sweep,capacity,job")
    ap.add_argument("--cases", default="", help="peak cases to run (a,b,c; default all)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (checks the script on a CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    ap.add_argument("--new-tokens", type=int, default=8, help="new tokens of the peak and sweep runs")
    ap.add_argument("--capacity-new-tokens", type=int, default=64)
    ap.add_argument("--bf16-start", type=int, default=16)
    ap.add_argument("--bf16-tries", type=int, default=6)
    ap.add_argument("--static-start", type=int, default=8)
    ap.add_argument("--static-tries", type=int, default=2)
    ap.add_argument("--int2-tries", type=int, default=1)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--job-requests", type=int, default=32)
    ap.add_argument("--job-context", type=int, default=32768)
    ap.add_argument("--job-new-tokens", type=int, default=256)
    ap.add_argument("--job-layers", type=int, default=36)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    methods = GPU_METHODS if a.device == "cuda" else CPU_METHODS
    sections = a.sections.split(",")
    peak, sweep, cap, job = [], [], [], []
    for name in sections:
        t0 = time.perf_counter()
        try:
            if name == "peak":
                peak = section_peak(a, methods, a.out)
            elif name == "sweep":
                sweep = section_sweep(a, methods, a.out)
            elif name == "capacity":
                cap = section_capacity(a, a.out)
            elif name == "job":
                job = section_job(a, a.out)
            else:
                raise SystemExit(f"unknown section {name!r}")
        except Exception as e:  # noqa: BLE001 - a failing section must not lose the others
            import traceback

            traceback.print_exc()
            print(f"section {name} failed: {type(e).__name__}: {e}", flush=True)
        print(f"section {name}: {time.perf_counter() - t0:.0f} s", flush=True)
        free()
    text = summary(peak, sweep, cap, job)
    import rotkv.cache.layer as layer_mod

    text += f"\n\nflash lower-right path: {'ok' if layer_mod._FLASH_FAILED is False else layer_mod._FLASH_FAILED}"
    with open(os.path.join(a.out, "summary.md"), "w") as f:
        f.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
