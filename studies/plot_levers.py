"""The lever table and its Pareto plot (KL against measured bits) from the lever runs' JSON files.

Every run: SmolLM2, held-out text (rotkv/data/eval_python_reference.txt), 2048-token context prefilled in
512-token chunks, then 64 teacher-forced decode tokens, 2 windows (128 scored tokens), sink 16, CPU, one
thread; KL against the fp32 plain model; bits measured from the cache's bytes. Sources:
docs/results/levers/e2e*.json (studies/lever_e2e.py) and the deployable rows of
docs/results/diagnosis/main.json (studies/diagnose_int2.py; the oracle rows are left out).

    python studies/plot_levers.py   # prints the markdown table, writes docs/results/levers/pareto.png
"""

from __future__ import annotations

import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = "docs/results/levers"
DIAG = {  # deployable diagnosis rows: label
    "oscar-int2/keep-top16-last": "top-16 tokens by last-prefill attention in bf16 (dense-and-sparse)",
    "oscar-int2/keep-top32-last": "top-32 tokens by last-prefill attention in bf16",
    "oscar-int2/keep-top16-norm": "top-16 tokens by key norm in bf16",
    "oscar-int2/lever-Kg32": "keys in groups of 32",
    "oscar-int2/lever-Kg32-window32": "keys in groups of 32, window 32",
}
LABELS = {
    "oscar-int2": "oscar-int2 (baseline)",
    "Kc1": "keys unclipped",
    "Vc1": "values unclipped",
    "Kopt": "keys: per-row MSE-optimal clip",
    "meta8": "fp8 scale/lo for K and V",
    "Vmeta8": "fp8 scale/lo for V",
    "K4@0-29": "all keys at 4 bits",
    "Kchan": "keys per channel over each page (KIVI's grouping) after OSCAR's rotation",
}


def label(name: str, k3_clip: str = "unclipped") -> str:
    if name in LABELS:
        return LABELS[name]
    if name.startswith("K="):
        kept = sum(int(t.split("@")[0]) for t in name[2:].split("+"))
        return f"keys: eigen-split {name[2:]} (directions@bits" + ("; the rest dropped)" if kept < 64 else ")")
    parts = []
    for p in name.split("+"):
        if p.startswith("K4@"):
            parts.append(f"4-bit keys in layers {p[3:].replace('.', ',')}")
        elif p.startswith("K3@"):
            parts.append(f"3-bit keys ({k3_clip}) in layers {p[3:].replace('.', ',')}")
        else:
            parts.append(LABELS.get(p, p))
    return ", ".join(parts)


def rows():
    out = []
    for path in sorted(glob.glob(os.path.join(HERE, "e2e*.json"))):
        for key, r in json.load(open(path))["runs"].items():
            name, _, rest = key.partition("/")
            win = 32 if rest.endswith("w32") else 64
            page = rest.split("p")[-1] if rest.rsplit("w", 1)[-1].count("p") else None
            if "K4clip@" in name:
                name = name.replace("K4clip@", "K4@") + " (clipped at the 2-bit ratio)"
            k3 = "clip 0.96" if os.path.basename(path).startswith("e2e_k3c") else "unclipped"  # K3_CLIP of the run
            out.append({"lever": label(name, k3) + ("" if win == 64 else ", window 32") + (f", pages of {page}" if page else ""), "kl": r["kl"], "ci": r["kl_ci95"],
                        "top1": r["top1"], "bits": r["bpe"], "src": os.path.basename(path)})
    diag = json.load(open("docs/results/diagnosis/main.json"))["runs"]
    for key, text in DIAG.items():
        r = diag[key]
        out.append({"lever": text, "kl": r["kl"], "ci": r["kl_ci95"], "top1": r["top1"], "bits": r["bpe"],
                    "src": "diagnosis/main.json"})
    return sorted(out, key=lambda r: r["bits"])


def main():
    rs = rows()
    print("| lever | KL +- 95% | top-1 | measured bits | source |\n|---|---|---|---|---|")
    for r in rs:
        print(f"| {r['lever']} | {r['kl']:.4f} +- {r['ci']:.4f} | {r['top1']:.3f} | {r['bits']:.3f} | {r['src']} |")
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rs:
        base = "baseline" in r["lever"]
        ax.errorbar(r["bits"], r["kl"], yerr=r["ci"], fmt="o", color="C3" if base else "C0", ms=4, alpha=0.8, capsize=2)
    tags = {"4-bit keys in layers 4,7,14,15,18,20,21,23,24,26, fp8 scale/lo for V, window 32": "oscar-mix (calibrated layers)",
            "all keys at 4 bits": "all keys 4-bit", "keys unclipped": "keys unclipped",
            "keys: eigen-split 32@4 (directions@bits; the rest dropped)": "key subspace 32@4",
            "top-16 tokens by last-prefill attention in bf16 (dense-and-sparse)": "top-16 tokens bf16",
            "fp8 scale/lo for K and V": "fp8 metadata K+V", "4-bit keys in layers 15-24": "4-bit keys L15-24",
            "keys in groups of 32": "K groups of 32"}
    for r in rs:
        if r["lever"] in tags:
            ax.annotate(tags[r["lever"]], (r["bits"], r["kl"]), textcoords="offset points", xytext=(5, 3), fontsize=7)
    front, best = [], float("inf")
    for r in rs:
        if r["kl"] < best:
            best = r["kl"]
            front.append(r)
    ax.plot([r["bits"] for r in front], [r["kl"] for r in front], color="C2", lw=1, alpha=0.6, label="Pareto front")
    ax.legend(loc="upper right", fontsize=8)
    ax.axvline(3.1, color="grey", ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("measured bits per element at 2K tokens")
    ax.set_ylabel("decode KL vs fp32 (log)")
    ax.set_title("SmolLM2, held-out text: INT2 levers (red: oscar-int2)")
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, "pareto.png"), dpi=110)


if __name__ == "__main__":
    main()
