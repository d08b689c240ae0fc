"""Tables and the plot of studies/diagnose_length.py's JSON (docs/results/diagnosis_length.md).

    python studies/diagnose_length_table.py docs/results/diagnosis_length/length.json --plot docs/results/diagnosis_length/length.png
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict


def ci(xs):
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, 1.96 * sd / math.sqrt(n)


def gather(res, field="layers"):
    """{L: {metric: [value per (window, layer)]}}, and {L: {metric: {layer: [values per window]}}}."""
    pooled, per_layer = defaultdict(lambda: defaultdict(list)), defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for key, run in res["runs"].items():
        L = int(key.split("/")[0][1:])
        for layer, rec in run.get(field, {}).items():
            for m, v in rec.items():
                pooled[L][m].append(v)
                per_layer[L][m][int(layer)].append(v)
        if field == "layers":
            pooled[L]["share_window"].append(run["share_window"])
    return pooled, per_layer


def fmt(xs, digits=4):
    m, h = ci(xs)
    return f"{m:.{digits}f} +- {h:.{digits}f}" if h == h else f"{m:.{digits}f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--alt", default=None, help="a JSON with the `rot` experiment (layers_alt) made apart")
    args = ap.parse_args()
    res = json.load(open(args.json))
    pooled, per_layer = gather(res)
    alt, _ = gather(json.load(open(args.alt)) if args.alt else res, "layers_alt")
    Ls = sorted(pooled)
    buckets = res["settings"]["buckets"]
    print("Attention-output error after W_O (relative, mean over layers and windows, +- 95% over those):\n")
    print("| L | both | K only | V only | K only, alt rotation | both, tiers at the 2K share (window) | body mass | eff. body tokens | body tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for L in Ls:
        p = pooled[L]
        a = fmt(alt[L]["k_only"]) if L in alt else "-"
        sh = f"{fmt(p['both_share'])} ({int(p['share_window'][0])})" if "both_share" in p else "-"
        print(f"| {L} | {fmt(p['both'])} | {fmt(p['k_only'])} | {fmt(p['v_only'])} | {a} | {sh} | "
              f"{fmt(p['mass_body'], 3)} | {fmt(p['eff_body_tokens'], 0)} | {sum(p['body_tokens']) / len(p['body_tokens']):.0f} |")
    print("\nK-only error with only one query-distance bucket of body keys quantized (the rest exact), and that bucket's "
          "attention mass and per-key squared logit error:\n")
    print("| L | " + " | ".join(buckets) + " |")
    print("|---|" + "---|" * len(buckets))
    for L in Ls:
        p = pooled[L]
        cells = []
        for b in buckets:
            if f"k_bucket_{b}" in p:
                cells.append(f"{ci(p[f'k_bucket_{b}'])[0]:.4f} / {ci(p[f'mass_{b}'])[0]:.3f} / {ci(p[f'logit_mse_{b}'])[0]:.3f}")
            else:
                cells.append("-")
        print(f"| {L} | " + " | ".join(cells) + " |")
    print("\nEarly (first half of the context) against late body, K only; per-key relative key MSE and squared logit "
          "error by absolute key position:\n")
    pos = ["pos0-512", "pos512-2048", "pos2048-4096", "pos4096+"]
    print("| L | early body | late body | logit MSE body / logit var body | " + " | ".join(f"key rel. MSE {q}" for q in pos) + " | "
          + " | ".join(f"logit MSE {q}" for q in pos) + " |")
    print("|---|---|---|---|" + "---|" * (2 * len(pos)))
    for L in Ls:
        p = pooled[L]
        kp = [f"{ci(p[f'key_relmse_{q}'])[0]:.4f}" if f"key_relmse_{q}" in p else "-" for q in pos]
        lp = [f"{ci(p[f'logit_mse_{q}'])[0]:.4f}" if f"logit_mse_{q}" in p else "-" for q in pos]
        print(f"| {L} | {fmt(p['k_early_body'])} | {fmt(p['k_late_body'])} | {ci(p['logit_mse_body'])[0]:.4f} / "
              f"{ci(p['logit_var_body'])[0]:.3f} | " + " | ".join(kp) + " | " + " | ".join(lp) + " |")
    print("\nPer layer, K-only error (mean over windows):\n")
    layers = sorted(per_layer[Ls[0]]["k_only"])
    print("| layer | " + " | ".join(f"L={L}" for L in Ls) + " | ratio last/first |")
    print("|---|" + "---|" * (len(Ls) + 1))
    for i in layers:
        vals = [ci(per_layer[L]["k_only"][i])[0] for L in Ls]
        print(f"| {i} | " + " | ".join(f"{v:.4f}" for v in vals) + f" | {vals[-1] / vals[0]:.2f} |")
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 3, figsize=(15, 4.2))
        for m, lab in (("both", "K+V"), ("k_only", "K only"), ("v_only", "V only"), ("both_share", "K+V, tiers at 2K share")):
            ys = [ci(pooled[L][m]) for L in Ls if m in pooled[L]]
            ax[0].errorbar([L for L in Ls if m in pooled[L]], [y[0] for y in ys], yerr=[y[1] for y in ys], marker="o", label=lab, capsize=3)
        if alt:
            ys = [ci(alt[L]["k_only"]) for L in Ls if L in alt]
            ax[0].errorbar([L for L in Ls if L in alt], [y[0] for y in ys], yerr=[y[1] for y in ys], marker="s", ls="--",
                           label="K only, long-calibrated rotation", capsize=3)
        ax[0].set_xscale("log", base=2)
        ax[0].set_xlabel("context L")
        ax[0].set_ylabel("rel. attention-output error (after W_O)")
        ax[0].legend(fontsize=8)
        for L in Ls:
            ax[1].plot(layers, [ci(per_layer[L]["k_only"][i])[0] for i in layers], marker=".", label=f"L={L}")
        ax[1].set_xlabel("layer")
        ax[1].set_ylabel("K-only error")
        ax[1].legend(fontsize=8)
        for L in Ls:
            bs = [b for b in buckets if f"k_bucket_{b}" in pooled[L]]
            ax[2].plot(range(len(bs)), [ci(pooled[L][f"k_bucket_{b}"])[0] for b in bs], marker="o", label=f"L={L}: error")
            ax[2].plot(range(len(bs)), [ci(pooled[L][f"mass_{b}"])[0] for b in bs], ls=":", marker="x", label=f"L={L}: attn mass")
        ax[2].set_xticks(range(len(buckets)))
        ax[2].set_xticklabels(buckets, rotation=30, fontsize=7)
        ax[2].set_xlabel("query distance of the quantized keys")
        ax[2].legend(fontsize=7)
        fig.suptitle(f"{res['settings']['preset']}: why the error grows with context (SmolLM2-135M, held-out text)")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)


if __name__ == "__main__":
    main()
