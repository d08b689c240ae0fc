"""The window-share lever (a bf16 window that keeps its share of the context, ``CacheSpec.window_share``)
against oscar-mix's fixed window, rotkv INT4 and HF quanto INT4, on the same held-out windows: a markdown table
and a plot of KL against context length.

    python studies/window_share_table.py --levers docs/results/levers_length/share/L*.json \
        --evals docs/results/levers_length/share/peers-* --plot docs/results/levers_length/share/kl_vs_length.png

``--levers``: ``lever_length.py`` JSONs (per-token KL kept, so the share's paired difference against the fixed
window is computed token by token); ``--evals``: ``rotkv eval`` output folders (``results.json``: KL, its CI and the
measured bits of each method). Rows are matched by length; the paired difference is against the run keyed
``base/w32/s0`` (oscar-mix, fixed 32-token window) of the same length.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

NAMES = {"base/w32/s0": "oscar-mix, fixed window 32", "base/w32/s0.015625": "oscar-mix, window_share 1/64",
         "base/w128/s0": "oscar-mix, fixed window 128"}
BASELINE = "base/w32/s0"


def mean_ci(xs: list[float]) -> tuple[float, float]:
    n = len(xs)
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / max(n - 1, 1))
    return m, 1.96 * sd / math.sqrt(n)


def load(levers: list[str], evals: list[str]) -> dict:
    """{length: {name: row}}, row = kl, ci, bits, top1, per (per-token KL or None)."""
    rows: dict = {}
    for f in levers:
        d = json.load(open(f))
        L = d["settings"]["length"]
        for key, r in d["runs"].items():
            rows.setdefault(L, {})[NAMES.get(key, key)] = dict(kl=r["kl"], ci=r["kl_ci95"], bits=r["bpe"], top1=r["top1"],
                                                             per=r.get("per_token_kl"), key=key)
    for folder in evals:
        d = json.load(open(os.path.join(folder, "results.json")))
        for r in d["records"]:
            # the peers' rows; the eval's own oscar-mix rows repeat the lever runs (same windows, same KL)
            if r.get("task") != "nll" or "kl" not in r or r["method"] not in ("int4", "hf-quanto-int4"):
                continue
            name = {"int4": "rotkv int4", "hf-quanto-int4": "HF quanto INT4"}[r["method"]]
            rows.setdefault(r["length"], {})[name] = dict(kl=r["kl"], ci=r["kl_ci95"], bits=r.get("bpe_measured"),
                                                          top1=r.get("top1"), per=None, key=r["method"])
    return rows


def table(rows: dict) -> str:
    out = ["| length | method | bits | KL | top-1 | paired vs window 32 |", "|---|---|---|---|---|---|"]
    for L in sorted(rows):
        base = next((r for r in rows[L].values() if r["key"] == BASELINE), None)
        for name, r in sorted(rows[L].items(), key=lambda kv: -(kv[1]["bits"] or 0)):
            paired = "-"
            if base and r["per"] and r is not base and len(r["per"]) == len(base["per"]):
                m, ci = mean_ci([a - b for a, b in zip(r["per"], base["per"])])
                paired = f"{m:+.4f} +- {ci:.4f}"
            bits = f"{r['bits']:.3f}" if r["bits"] is not None else "-"
            top1 = f"{r['top1']:.3f}" if r["top1"] is not None else "-"
            out.append(f"| {L} | {name} | {bits} | {r['kl']:.4f} +- {r['ci']:.4f} | {top1} | {paired} |")
    return "\n".join(out)


def plot(rows: dict, path: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    names = list(dict.fromkeys(n for L in sorted(rows) for n in rows[L]))
    for i, name in enumerate(names):
        pts = [(L, rows[L][name]) for L in sorted(rows) if name in rows[L]]
        xs = [L * (1 + 0.02 * (i - len(names) / 2)) for L, _ in pts]  # a small offset so the bars do not overlap
        ax.errorbar(xs, [r["kl"] for _, r in pts], yerr=[r["ci"] for _, r in pts], marker="o", capsize=3,
                    label=name + " (" + ", ".join(f"{r['bits']:.2f}" for _, r in pts if r["bits"] is not None) + " bits)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(rows), [f"{L // 1024}K" for L in sorted(rows)])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("KL to the fp32 model (per token)")
    ax.set_title("KL against context, same held-out windows (SmolLM2-135M, CPU)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--levers", nargs="+", default=[])
    ap.add_argument("--evals", nargs="*", default=[])
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    rows = load(a.levers, a.evals)
    print(table(rows))
    if a.plot:
        plot(rows, a.plot)
        print(f"wrote {a.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
