"""The prefill's progress, in one figure: seconds of one prefill per commit, rotkv bf16 and INT2
against HF StaticCache, one panel per shape, with the peak GPU memory on each bar.

    python studies/plot_prefill.py \
        --files benchmarks/results/generate-20261203-3464ee4-smollm2-64x8k.json \
                benchmarks/results/generate-20261203-3464ee4-qwen8l-4x32k.json \
                benchmarks/results/prefill-sweep-smollm2-20261203-5f66706.json \
                benchmarks/results/prefill-sweep-qwen8l-20261203-5f66706.json \
                benchmarks/results/prefill-sweep-smollm2-20261203-8caa3b8.json \
                benchmarks/results/prefill-sweep-qwen8l-20261203-8caa3b8.json \
        --prefill-tokens 262144 32768 --out docs/serving_prefill.png

The real SmolLM2 with the recommended preset (docs/serving_prefill_real.png):

    python studies/plot_prefill.py --files benchmarks/results/generate-real-smollm2-64x8k-20261203-64f94e5.json \
        benchmarks/results/generate-oscar-mix-smollm2-64x8k-20261203-64f94e5.json \
        benchmarks/results/generate-real-smollm2-64x8k-20261203-56face6.json \
        benchmarks/results/generate-oscar-mix-smollm2-64x8k-20261203-56face6.json --out docs/serving_prefill_real.png

Inputs: ``rotkv bench`` JSONs (rows with ``step_ms``) and ``profile_prefill.py --sweep-prefill-tokens``
JSONs (rows with ``prefill_tokens``), oldest first; ``--labels`` names each file's bar group (default:
its commit). Panels: one per (model, batch, context). Sweep rows of rotkv count only at a budget of
``--prefill-tokens`` (rotkv's default: 262144 tokens per call for SmolLM2, 32768 for Qwen3-8B);
HF StaticCache prefills in one call whatever the budget. HF StaticCache is a horizontal line from the
last file that has it for the shape, with the target ``INT2 <= 1.3 x StaticCache`` dashed above it.
"""

from __future__ import annotations

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# method names of rotkv bench rows and of profile_prefill rows, mapped onto one key each
METHODS = {"rotkv:bf16+graph": "bf16", "rotkv:bf16": "bf16", "bf16": "bf16",
           "rotkv:quarot-int2+graph": "int2", "rotkv:quarot-int2": "int2", "quarot-int2": "int2",
           "rotkv:oscar-mix+graph": "mix", "rotkv:oscar-mix": "mix", "oscar-mix": "mix",
           "hf-static-compile": "hf", "hf-static": "hf"}
LABELS = {"bf16": "rotkv bf16", "int2": "rotkv quarot-int2", "mix": "rotkv oscar-mix", "hf": "HF StaticCache"}
COLORS = {"bf16": "tab:blue", "int2": "tab:orange", "mix": "tab:green", "hf": "tab:gray"}
BARS = ("bf16", "int2", "mix")  # the rotkv methods drawn as bars, in this order
TARGET = 1.3  # INT2's prefill at most this many times StaticCache's


def read(path: str) -> tuple[dict, list[dict]]:
    with open(path) as f:
        d = json.load(f)
    return d.get("meta", {}), d["rows"]


def shape_of(r: dict, meta: dict) -> tuple[str, int, int]:
    return (r.get("model") or meta.get("model", "?"), r["batch"], r["context"])


def shape_title(s: tuple[str, int, int]) -> str:
    model = s[0].replace("random:", "") + (" (random weights)" if s[0].startswith("random:") else "")
    return f"{model}, {s[1]} x {s[2] // 1024}K"


def collect(files: list[str], labels: list[str], budgets: set[int]):
    """bars[shape][(label, method)] = row; hf[shape] = (label, row) of the last file that has it."""
    bars: dict = {}
    hf: dict = {}
    for path, label in zip(files, labels):
        meta, rows = read(path)
        for r in rows:
            m = METHODS.get(r["method"])
            if m is None or r.get("prefill_s") != r.get("prefill_s"):  # other methods, failed cells (NaN)
                continue
            s = shape_of(r, meta)
            if m == "hf":
                hf[s] = (label, r)
            elif r.get("prefill_tokens") is None or r["prefill_tokens"] in budgets:
                bars.setdefault(s, {})[(label, m)] = r
    return bars, hf


def panel(ax, shape, cells: dict, hf_ref, labels: list[str]) -> None:
    groups = [g for g in dict.fromkeys(labels) if any((g, m) in cells for m in BARS)]
    methods = [m for m in BARS if any((g, m) in cells for g in groups)]
    width = 0.8 / max(len(methods), 1)
    top = 0.0
    hf_s = hf_ref[1]["prefill_s"] if hf_ref is not None else None
    for i, m in enumerate(methods):
        for j, g in enumerate(groups):
            r = cells.get((g, m))
            if r is None:
                continue
            x = j + (i - (len(methods) - 1) / 2) * width
            ax.bar(x, r["prefill_s"], width * 0.92, color=COLORS[m], label=LABELS[m] if j == 0 else None)
            peak = r.get("peak_gb")
            text = (f"{r['prefill_s']:.2f} s" + (f"\n{peak:.1f} GB" if peak else "")
                    + (f"\n{r['prefill_s'] / hf_s:.2f}x HF" if hf_s else ""))
            ax.text(x, 0.04, text, ha="center", va="bottom", fontsize=7, color="white", fontweight="bold",
                    transform=ax.get_xaxis_transform())  # at the foot of the bar, clear of the lines
            top = max(top, r["prefill_s"])
    if hf_ref is not None:
        label, r = hf_ref
        t = r["prefill_s"]
        peak = f", peak {r['peak_gb']:.1f} GB" if r.get("peak_gb") else ""
        ax.axhline(t, color=COLORS["hf"], lw=2,
                   label=f"{LABELS['hf']} ({r['method']} at {label.splitlines()[0]}): {t:.2f} s{peak}")
        ax.axhline(TARGET * t, color="tab:red", lw=1.5, ls="--",
                   label=f"target: INT2 <= {TARGET}x StaticCache ({TARGET * t:.2f} s)")
        top = max(top, TARGET * t)
    ax.set_xticks(range(len(groups)), groups, fontsize=8)
    ax.set_xlim(-0.6, len(groups) - 0.4)
    ax.set_ylim(0, top * 1.45)
    ax.set_ylabel("prefill s (lower is better)")
    ax.set_title(shape_title(shape), fontsize=10)
    ax.legend(fontsize=7, loc="upper left")


def default_label(path: str) -> str:
    meta, rows = read(path)
    commit = meta.get("commit") or (rows[0].get("commit") if rows else None) or path.rsplit("/", 1)[-1]
    kind = "rotkv bench" if rows and "step_ms" in rows[0] else "prefill sweep"
    return f"{commit}\n{kind}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", nargs="+", required=True, help="rotkv bench and prefill sweep JSONs, oldest first")
    ap.add_argument("--labels", nargs="+", help="one bar-group name per file (default: its commit)")
    ap.add_argument("--prefill-tokens", nargs="+", type=int, default=[262144, 32768],
                    help="the token budgets whose sweep rows count (rotkv's default budgets)")
    ap.add_argument("--out", default="docs/serving_prefill.png")
    a = ap.parse_args(argv)
    if a.labels is not None and len(a.labels) != len(a.files):
        ap.error(f"--labels needs one name per file: {len(a.files)} files, {len(a.labels)} labels")
    labels = a.labels or [default_label(f) for f in a.files]
    bars, hf = collect(a.files, labels, set(a.prefill_tokens))
    shapes = list(bars)
    if not shapes:
        ap.error("no rotkv bf16 / quarot-int2 / oscar-mix rows with a prefill time in these files")
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.2 * len(shapes), 4.8), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        panel(ax, s, bars[s], hf.get(s), labels)
    gpu = next((r.get("gpu") for c in bars.values() for r in c.values() if r.get("gpu")), None)
    fig.suptitle("prefill of the whole prompt per commit" + (f" on {gpu}" if gpu else "")
                 + "\n(in each bar: seconds, peak GPU memory, time / StaticCache)", fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
