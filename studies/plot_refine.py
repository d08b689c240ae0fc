"""KL against measured bits at 2K and 8K: the preset oscar-refine (keys and values refined, one page per 19
body pages, at most 224 tokens), the e4m3-key-metadata lever (one page per 9, at most 768 tokens; not the
preset) and the tier's first, keys-only form, beside the INT4 caches and the earlier INT2 presets.

Reads the committed runs (the rotkv rows from ``studies/lever_length.py`` JSONs, the INT4 peers from
``rotkv eval`` records) and draws one panel per length: every method a point at its measured bits with
its 95% interval.

    python studies/plot_refine.py --out docs/results/levers_length/refine/kl_bits.png
"""

from __future__ import annotations

import argparse
import json
import os

W6 = "docs/results/levers_length/w6"
T4 = "docs/results/levers_length/tier4"
MK = "docs/results/levers_length/metak"
# (label, length, file, kind): kind "lever" (one run in a lever_length JSON), "eval" (a method's nll
# record in a rotkv eval results.json), "record" (one record in a file of its own)
RUNS = [
    ("oscar-mix", 2048, f"{W6}/eval2k-w6-mix.json", "lever"),
    ("oscar-mix-long", 2048, f"{W6}/eval2k-w6-long.json", "lever"),
    ("keys-only tier (224)", 2048, f"{T4}/eval2k-w6-refine.json", "lever"),
    ("oscar-refine", 2048, f"{T4}/eval2k-w6-refine-kv-every19.json", "lever"),
    ("e4m3 keys, 1 page per 9", 2048, f"{MK}/preset-2k.json", "lever"),
    ("rotkv int4", 2048, f"{W6}/peers-2048-results.json:int4", "eval"),
    ("HF quanto INT4", 2048, f"{W6}/peers-2048-results.json:hf-quanto-int4", "eval"),
    ("oscar-mix", 8192, f"{W6}/eval8k-w6-mix.json", "lever"),
    ("oscar-mix-long", 8192, f"{W6}/eval8k-w6-long.json", "lever"),
    ("keys-only tier (224)", 8192, f"{T4}/eval8k-w6-refine.json", "lever"),
    ("oscar-refine", 8192, f"{T4}/eval8k-w6-refine-kv-every19.json", "lever"),
    ("e4m3 keys, 1 page per 9", 8192, f"{MK}/preset-8k.json", "lever"),
    ("rotkv int4", 8192, f"{W6}/peers-8192-results.json:int4", "eval"),
    ("HF quanto INT4", 8192, f"{W6}/peers-8192-quanto.json", "record"),
]


def point(path: str, kind: str) -> tuple[float, float, float]:
    """(bits, KL, KL 95% half-width) of one run."""
    if kind == "lever":
        runs = json.load(open(path))["runs"]
        if len(runs) != 1:
            raise ValueError(f"{path}: expected one run, found {list(runs)}")
        r = next(iter(runs.values()))
        return r["bpe"], r["kl"], r["kl_ci95"]
    if kind == "eval":
        path, method = path.split(":")
        recs = [r for r in json.load(open(path))["records"] if r["method"] == method and r["task"] == "nll"]
        if len(recs) != 1:
            raise ValueError(f"{path}: expected one nll record of {method}, found {len(recs)}")
        r = recs[0]
        return r["bpe_measured"], r["kl"], r["kl_ci95"]
    r = json.load(open(path))
    return r["bpe_measured"], r["kl"], r["kl_ci95"]


def plot(runs, out: str) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({length for _, length, _, _ in runs})
    fig, axes = plt.subplots(1, len(lengths), figsize=(5.2 * len(lengths), 4), sharey=True)
    axes = [axes] if len(lengths) == 1 else list(axes)
    table = {}
    colors = {}
    for ax, length in zip(axes, lengths):
        for label, ln, path, kind in runs:
            if ln != length:
                continue
            bits, kl, ci = point(path, kind)
            table[f"{label}@{length}"] = {"bits": bits, "kl": kl, "kl_ci95": ci}
            c = colors.setdefault(label.split(" (")[0], f"C{len(colors)}")
            marker = "D" if label == "oscar-refine" else "s" if label.startswith("keys-only") else "o"
            ax.errorbar(bits, kl, yerr=ci, fmt=marker, color=c, capsize=3, label=f"{label}: {kl:.4f} at {bits:.2f}")
        ax.legend(fontsize=8, loc="upper right")  # the INT2 points crowd at ~3 bits: named in the legend
        ax.set_title(f"{length} tokens (6 held-out windows, 384 tokens)")
        ax.set_xlabel("measured bits per element (every tier and all metadata)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("KL against the fp32 model (95% CI)")
    axes[0].set_ylim(0, 0.075)
    fig.suptitle("SmolLM2-135M: the refine tier against INT4 caches")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/results/levers_length/refine/kl_bits.png")
    args = ap.parse_args()
    for name, point_ in plot(RUNS, args.out).items():
        print(f"{name:28s} {point_['bits']:.3f} bits  KL {point_['kl']:.4f} +- {point_['kl_ci95']:.4f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
