"""What the user feels, in one figure: peak GPU memory of generate, the largest batch that completes
on a memory budget, and where the time of a whole job goes (prefill against decode).

    python benchmarks/plot_memory.py \
        --generate benchmarks/results/generate-20261203-5f66706-smollm2-64x8k.json \
                   benchmarks/results/generate-20261203-5f66706-qwen8l-4x32k.json \
                   benchmarks/results/generate-prefill-b-ab85f6e.json \
        --capacity benchmarks/results/capacity-20261203-836f16b-16gb.json \
                   benchmarks/results/capacity-20261203-64f94e5-36l-int2.json \
                   benchmarks/results/capacity-20261203-64f94e5-36l-bf16.json \
                   benchmarks/results/capacity-20261203-64f94e5-36l-hf-static.json \
        --job benchmarks/results/job-20261203-16d96fc.json --out docs/serving_memory.png

Panels: (1) peak and cache GB per shape and method (``rotkv bench`` rows); (2) capacity: the
largest batch that completed and the smallest that ran out of memory (``rotkv bench --max-batch``),
one group per model, context and memory budget;
(3) the job's seconds split into prefill, first step (graph capture) and decode
(``benchmarks/bench_job.py``).
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"hf-dynamic": "HF DynamicCache", "hf-static-compile": "HF StaticCache + compile",
          "rotkv:bf16+graph": "rotkv bf16 + graph", "rotkv:quarot-int2+graph": "rotkv INT2 + graph",
          "bf16": "rotkv bf16 + graph", "rotkv-int2": "rotkv INT2 + graph"}
COLORS = {"hf-static-compile": "tab:gray", "hf-dynamic": "silver", "rotkv:bf16+graph": "tab:blue",
          "bf16": "tab:blue", "rotkv:quarot-int2+graph": "tab:orange", "rotkv-int2": "tab:orange"}


def rows_of(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)["rows"]


def shape_label(r: dict) -> str:
    model = r["model"].replace("random:", "").replace(" layers)", "L)")
    k = r["context"] // 1024
    return f"{model}\n{r['batch']} x {k}K"


def panel_peak(ax, files: list[str]) -> None:
    rows = [r for f in files for r in rows_of(f) if r["peak_gb"] == r["peak_gb"]]
    shapes = list(dict.fromkeys(shape_label(r) for r in rows))
    methods = [m for m in LABELS if any(r["method"] == m for r in rows)]
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        for j, s in enumerate(shapes):
            r = next((r for r in rows if r["method"] == m and shape_label(r) == s), None)
            if r is None:
                continue
            x = j + (i - (len(methods) - 1) / 2) * width
            ax.bar(x, r["peak_gb"], width, color=COLORS[m], label=LABELS[m] if j == 0 else None)
            ax.bar(x, r["cache_gb"], width * 0.5, color="black", alpha=0.35, label="cache" if (i, j) == (0, 0) else None)
            ax.text(x, r["peak_gb"], f"{r['peak_gb']:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(shapes)), shapes, fontsize=7)
    ax.set_ylabel("GB")
    ax.set_title("peak GPU memory of generate (dark: the cache)", fontsize=9)
    ax.legend(fontsize=7)


def capacity_label(r: dict) -> str:
    """The bar's text: the largest batch that completed, and the first that ran out of memory."""
    if not r["tries"]:
        return "search failed\n(see its log)" if r.get("note") else "no tries"
    if r["failed_at"] is None:
        return f">= {r['max_batch']}"
    return f"{r['max_batch']}\n(< {r['failed_at']})"


def panel_capacity(ax, paths: list[str]) -> None:
    """One group of bars per (model, context, memory budget), over every --capacity file."""
    groups: dict[str, list[dict]] = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        budget = f"{data['meta']['memory_gb']:.0f} GB" if data["meta"].get("memory_gb") else "whole GPU"
        for r in data["rows"]:
            model = r["model"].replace("random:", "")
            key = f"{model} ({r['layers']}L)\n{r['context'] // 1024}K, {budget}"
            groups.setdefault(key, []).append(r)
    methods = [m for m in COLORS if any(r["method"].replace("+fold", "") == m for g in groups.values() for r in g)]
    width = 0.8 / max(len(methods), 1)
    top_all = max((r["failed_at"] or r["max_batch"]) for g in groups.values() for r in g)
    seen: set[str] = set()
    for j, (key, rows) in enumerate(groups.items()):
        for r in rows:
            m = r["method"].replace("+fold", "")
            x = j + (methods.index(m) - (len(methods) - 1) / 2) * width
            ax.bar(x, r["max_batch"], width, color=COLORS.get(m, "tab:green"), label=None if m in seen else LABELS.get(m, m))
            seen.add(m)
            if r["failed_at"]:
                ax.plot([x, x], [r["max_batch"], r["failed_at"]], color="black", lw=1)
                ax.plot([x - width / 4, x + width / 4], [r["failed_at"]] * 2, color="black", lw=1)
            ax.text(x, max(r["failed_at"] or 0, r["max_batch"]) + 0.01 * top_all, capacity_label(r),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), list(groups), fontsize=7)
    ax.set_ylim(0, 1.25 * top_all)
    r0 = next(iter(groups.values()))[0]
    ax.set_title(f"largest batch that completes (real prefill + {r0['new_tokens']} new tokens;\n"
                 "bar to the first out-of-memory; >= : not searched higher)", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")


def panel_job(ax, path: str) -> None:
    rows = rows_of(path)
    parts = (("prefill_s", "prefill", "tab:purple"), ("first_token_s", "first step (capture)", "tab:olive"),
             ("decode_s", "decode", "tab:cyan"))
    for i, r in enumerate(rows):
        bottom = 0.0
        for key, label, color in parts:
            ax.bar(i, r[key], 0.6, bottom=bottom, color=color, label=label if i == 0 else None)
            bottom += r[key]
        ax.text(i, bottom, f"{r['job_s']:.0f} s, x{r['job_speedup_vs_bf16']}\n{r['concurrent']} at once, "
                f"peak {r['peak_gb']:.0f} GB", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), [LABELS.get(r["method"], r["method"]) for r in rows], fontsize=7)
    r0 = rows[0]
    ax.set_ylim(0, 1.25 * max(r["job_s"] for r in rows))
    ax.set_ylabel("s")
    ax.set_title(f"whole job: {r0['requests']} x {r0['context'] // 1024}K, {r0['new_tokens']} new tokens\n"
                 f"({r0['model'].replace('random:', '')})", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generate", nargs="+", required=True, help="rotkv bench JSONs (peak_gb, cache_gb)")
    ap.add_argument("--capacity", nargs="+", required=True, help="rotkv bench --max-batch JSONs")
    ap.add_argument("--job", required=True, help="a bench_job.py JSON")
    ap.add_argument("--out", default="docs/serving_memory.png")
    a = ap.parse_args(argv)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1.6, 1, 1]})
    panel_peak(axes[0], a.generate)
    panel_capacity(axes[1], a.capacity)
    panel_job(axes[2], a.job)
    gpu = rows_of(a.job)[0].get("gpu", "")
    fig.suptitle(f"rotkv INT2 against bf16 caches on {gpu} (random-weight models of real shapes)", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
