"""rotkv inside vLLM in one figure: each workload's figure for every vLLM KV cache, relative to vLLM's bf16 cache
(KV capacity in tokens, output tokens per second of the throughput and long-generation jobs, and the inverse of the
time per output token, so that higher is better in every panel), from ``bench_vllm.py`` JSONs.

    python studies/plot_vllm.py \
        --files benchmarks/results/vllm-20261206-h100-run8-qwen3-8b-throughput-32k.json \
                benchmarks/results/vllm-20261206-h100-run10-qwen3-8b-turboquant.json \
                benchmarks/results/vllm-20261206-h100-run9-qwen3-8b-longgen-10gib.json \
                benchmarks/results/vllm-20261206-h100-run8-qwen3-8b-tpot.json \
        --out docs/results/vllm-h100-run10/serving.png

(Run 9's figure, ``docs/results/vllm-h100-run9/serving.png``: the same without the TurboQuant file.)
(Run 8's figure, ``docs/results/vllm-h100-run8/serving.png``: the same with run 7's long-generation file. Run 7's figure, ``docs/results/vllm-h100-run7/serving.png``: its two files and run 6's two TPOT files.)

A panel per (workload, file): capacity comes from the throughput file (the engine at ``gpu_memory_utilization``),
not from a fixed-budget long-generation file. Rows of one workload in several files (the latency of bf16 and of
rotkv, run by one engine each) form one panel. Each bar is labelled with its ratio and its value; the panel title
says the workload's sizes and the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

COLORS = {"bf16": "#9e9e9e", "fp8": "#64b5f6", "rotkv": "#d84315"}
PANELS = [  # (workload, metric, title, higher is better)
    ("capacity", "kv_tokens", "KV capacity (tokens)", True),
    ("throughput", "output_tok_s", "throughput (output tok/s)", True),
    ("longgen", "output_tok_s", "long generation (output tok/s)", True),
    ("latency", "tpot_ms", "time per output token (ms; bars: bf16's / this)", False),
]


def _label(method: str) -> str:
    return method.split(":", 1)[1] if method.startswith("rotkv:") else method


def _color(method: str) -> str:
    return COLORS["rotkv"] if method.startswith("rotkv") else COLORS.get(method, "#7e57c2")


def _sizes(workload: str, d: dict) -> str:
    s = d.get("settings", {}).get("sizes", {})
    if workload == "throughput":
        return f"{s.get('tp_requests')} x ({s.get('tp_prompt')} + {s.get('tp_new')})"
    if workload == "longgen":
        kv = (d.get("settings", {}).get("engine_kwargs") or {}).get("kv_cache_memory_bytes")
        if kv:
            budget = f", {kv / 2 ** 30:g} GiB of KV"
        else:  # older files: the budget as bf16's capacity there
            cap = next((r["kv_tokens"] for r in d["rows"] if r.get("workload") == "capacity" and r["method"] == "bf16"),
                       None)
            budget = f", KV for {cap:,} bf16 tokens" if cap else ""
        return f"{s.get('lg_requests')} x ({s.get('lg_prompt')} + {s.get('lg_new')}){budget}"
    if workload == "latency":
        return f"1 x {s.get('lat_prompt')}"
    return f"gpu_memory_utilization {d.get('settings', {}).get('gpu_memory_utilization')}"


def _fixed_budget(d: dict) -> bool:
    """Whether a file's engines had a fixed KV budget (``--engine-kwargs``' kv_cache_memory_bytes; files from before
    the settings recorded it: a long-generation file without a throughput or latency workload)."""
    s = d.get("settings", {})
    if "engine_kwargs" in s:
        return bool((s["engine_kwargs"] or {}).get("kv_cache_memory_bytes"))
    return "longgen" in s.get("workloads", []) and not {"throughput", "latency"} & set(s.get("workloads", []))


def collect(paths: list[str]) -> dict:
    """{workload: {"rows": {method: value}, "sub": sizes, "gpu": set}} from the files' rows (the first file that
    has a workload's method wins; capacity only from files without a fixed KV budget)."""
    out: dict = defaultdict(lambda: {"rows": {}, "sub": None, "gpu": set()})
    for p in paths:
        d = json.load(open(p))
        fixed = _fixed_budget(d)
        for r in d["rows"]:
            for w, metric, _, _ in PANELS:
                if r.get("workload") != w or metric not in r or (w == "capacity" and fixed):
                    continue
                panel = out[w]
                panel["rows"].setdefault(r["method"], r[metric])
                panel["sub"] = panel["sub"] or _sizes(w, d)
                panel["gpu"].add(d.get("gpu", "?"))
    return out


def plot(paths: list[str], out_path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = collect(paths)
    panels = [p for p in PANELS if data.get(p[0], {}).get("rows")]
    if not panels:
        raise SystemExit("no capacity, throughput, longgen or latency rows in the files")
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6), squeeze=False)
    for ax, (w, metric, title, higher) in zip(axes[0], panels):
        rows = data[w]["rows"]
        base = rows.get("bf16")
        methods = sorted(rows, key=lambda m: (m.startswith("rotkv"), m != "bf16", m))
        ratios = [((rows[m] / base) if higher else (base / rows[m])) if base else float("nan") for m in methods]
        bars = ax.bar([_label(m) for m in methods], ratios, color=[_color(m) for m in methods])
        for bar, m, x in zip(bars, methods, ratios):
            v = rows[m]
            val = f"{v:,.0f}" if v >= 100 else f"{v:.2f}"
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{x:.2f}x\n{val}", ha="center",
                    va="bottom", fontsize=8)
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_ylim(0, max(r for r in ratios if r == r) * 1.3)
        gpu = ", ".join(sorted(g.replace("NVIDIA ", "") for g in data[w]["gpu"]))
        ax.set_title(f"{title}\n{data[w]['sub']} ({gpu})", fontsize=8.5)
        ax.set_ylabel("vs vLLM bf16" + ("" if higher else " (inverse time)"), fontsize=8)
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    fig.suptitle("vLLM 0.26, Qwen3-8B shape (36 layers, dummy weights): rotkv's INT2 cache against vLLM's own",
                 fontsize=9.5)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    fig.savefig(out_path, dpi=130)
    return out_path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", nargs="+", required=True, help="bench_vllm.py JSONs")
    ap.add_argument("--out", required=True, help="the PNG to write")
    args = ap.parse_args(argv)
    print(plot(args.files, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
