"""The decode step with and without the model's layers compiled (`rotkv bench` JSONs), one panel per file.

    python studies/plot_step_compile.py \
        benchmarks/results/generate-compile-smollm2-1x4k-20261204-6e62d7f.json \
        benchmarks/results/generate-compile-qwen8L-4x32k-20261204-6e62d7f.json \
        benchmarks/results/generate-compile-real-smollm2-64x8k-20261204-d525038.json \
        benchmarks/results/generate-compile-qwen36L-8x32k-20261204-d525038.json \
        --out docs/serving_compile.png

Each panel is one file (one run): its methods' median decode step in ms, each bar labelled with the
step and its ratio to the panel's strongest bf16 (rotkv bf16 + graph [+ compile], transformers'
StaticCache + compile). The panel title names the model, the batch x context and the commit.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ORDER = ["hf-static-compile", "rotkv:bf16+graph", "rotkv:bf16+graph+compile", "rotkv:quarot-int2+graph",
         "rotkv:quarot-int2+graph+compile", "rotkv:oscar-mix+graph", "rotkv:oscar-mix+graph+compile",
         "rotkv:oscar-mix+graph+fold+compile"]
BF16 = ("hf-static-compile", "rotkv:bf16+graph", "rotkv:bf16+graph+compile")


def label(method: str) -> str:
    if method == "hf-static-compile":
        return "HF Static\n+ compile"
    preset, *flags = method.removeprefix("rotkv:").split("+")
    return preset + "".join(f"\n+ {f}" for f in flags if f != "graph")


def color(method: str) -> str:
    if method.startswith("hf-"):
        return "0.6"
    base = {"bf16": "tab:blue", "quarot-int2": "tab:orange", "oscar-mix": "tab:green"}
    return base.get(method.removeprefix("rotkv:").split("+")[0], "tab:gray")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default="docs/serving_compile.png")
    a = ap.parse_args(argv)
    fig, axes = plt.subplots(1, len(a.files), figsize=(4.2 * len(a.files), 4.6), squeeze=False)
    for ax, f in zip(axes[0], a.files):
        rows = {r["method"]: r for r in json.load(open(f))["rows"] if r["step_ms"] == r["step_ms"]}
        if not rows:
            raise SystemExit(f"{f}: no measured rows")
        methods = [m for m in ORDER if m in rows] + sorted(set(rows) - set(ORDER))
        best = min((rows[m]["step_ms"] for m in BF16 if m in rows), default=None)
        ys = [rows[m]["step_ms"] for m in methods]
        bars = ax.bar(range(len(methods)), ys, color=[color(m) for m in methods],
                      hatch=None, edgecolor="black", linewidth=0.4)
        for b, m in zip(bars, methods):
            if "compile" not in m and m != "hf-static-compile":
                b.set_alpha(0.45)  # not compiled
        texts = [f"{y:.2f}" + (f"\n{y / best:.2f}x" if best else "") for y in ys]
        ax.bar_label(bars, texts, fontsize=7)
        ax.set_xticks(range(len(methods)), [label(m) for m in methods], fontsize=7)
        r0 = next(iter(rows.values()))
        model = r0.get("model") or "?"
        model = model if model.startswith("random:") else f"{model} (real weights)"
        ax.set_title(f"{model}\n{r0['batch']} x {r0['context']}, commit {r0.get('commit', '?')}", fontsize=8)
        ax.set_ylabel("decode step, ms (lower is better)")
        ax.set_ylim(0, max(ys) * 1.25)
    gpu = json.load(open(a.files[0]))["rows"][0].get("gpu", "")
    fig.suptitle(f"The decode step with the model's layers compiled into the CUDA graph ({gpu}); "
                 "ratios: to the panel's fastest bf16; pale bars: not compiled", fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
