"""Bar charts of end-to-end generation results (`rotkv bench` JSONs): decode step and cache memory.

    python benchmarks/plot_generate.py benchmarks/results/generate-20261201-0633-b64.json \
        benchmarks/results/generate-20261201-0703-b64.json --out docs/serving_speed.png

Rows of later files replace rows of earlier ones for the same (method, batch, context).
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"hf-dynamic": "HF DynamicCache (eager)", "hf-static-compile": "HF StaticCache + compile",
          "rotkv:bf16+graph": "rotkv bf16 + graph", "rotkv:quarot-int2": "rotkv INT2 (eager)",
          "rotkv:quarot-int2+graph": "rotkv INT2 + graph"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default="docs/serving_speed.png")
    a = ap.parse_args(argv)
    rows = {}
    for f in a.files:
        for r in json.load(open(f))["rows"]:
            if r["step_ms"] == r["step_ms"]:  # skip failed cells (NaN)
                rows[(r["method"], r["batch"], r["context"])] = r | {"file": f.rsplit("/", 1)[-1]}
    shapes = sorted({(b, c) for _, b, c in rows}, key=lambda s: (s[0], s[1]))
    methods = [m for m in LABELS if any(k[0] == m for k in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    width = 0.8 / len(methods)
    for ax, key, title in ((axes[0], "step_ms", "decode step (ms, lower is better)"),
                           (axes[1], "cache_gb", "cache memory on the GPU (GB)")):
        for i, m in enumerate(methods):
            xs, ys = [], []
            for j, s in enumerate(shapes):
                r = rows.get((m, *s))
                if r is not None:
                    xs.append(j + (i - (len(methods) - 1) / 2) * width)
                    ys.append(r[key])
            bars = ax.bar(xs, ys, width, label=LABELS[m])
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(shapes)), [f"B={b}, L={c}" for b, c in shapes])
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    gpu = next(iter(rows.values()))["gpu"]
    model = ", ".join(sorted({r.get("model", "SmolLM2-135M-Instruct") for r in rows.values()}))
    fig.suptitle(f"{model}, end to end on {gpu} ({', '.join(sorted({r['file'] for r in rows.values()}))})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
