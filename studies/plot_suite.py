"""KL per domain on the suite's test split, one panel per length: each cache's KL to the float32 model in every
domain and over all four (bars, with the 95% interval over windows), its measured bits in the legend, from the
``suite.json`` files that ``rotkv eval --suite`` writes (every cache on the same windows).

    python studies/plot_suite.py --out docs/results/test2k-2048/kl_domains.png \\
        --panel 2048 docs/results/test2k-2048/t2k/suite.json docs/results/test2k-2048/refine/suite.json \\
                     docs/results/test2k-2048/int4-w32/suite.json \\
        --panel 8192 docs/results/test8k-2048/aqua/suite.json docs/results/test8k-2048/refine/suite.json \\
                     docs/results/test8k-2048/int4-w32/suite.json docs/results/test8k-2048/quanto/suite.json

A method present in several files of a panel is taken from the first. ``plain-fp32`` (the reference, KL 0) is
left out. The "all" bar is the suite's mean over domains with its interval as
``rotkv eval --suite`` reports them (the method entry's ``kl`` and ``kl_ci95``; where a file lacks them, the mean of
the domains and their intervals combined as independent). The legend's bits are the entry's ``bpe_measured``.
"""

from __future__ import annotations

import argparse
import json
import math

LABELS = {"int4": "rotkv int4 (sink 16, window 32)", "hf-quanto-int4": "HF quanto INT4"}
ORDER = ["oscar-aqua", "oscar-refine", "oscar-mix-long", "oscar-mix", "int4", "hf-quanto-int4"]
COLORS = {"oscar-aqua": "#d84315", "oscar-refine": "#ff8a65", "oscar-mix-long": "#ffab91", "oscar-mix": "#ffccbc",
          "int4": "#64b5f6", "hf-quanto-int4": "#9e9e9e"}


def read_panel(files: list[str], length: str) -> tuple[list[str], dict]:
    """(domains, {method: {"per_domain": {domain: (kl, ci)}, "all": (kl, ci), "bits": float}}) at ``length``."""
    domains, out = None, {}
    for f in files:
        d = json.load(open(f))
        if length not in d.get("lengths", {}):
            raise ValueError(f"{f} has no length {length} (it has {sorted(d.get('lengths', {}))})")
        if domains is None:
            domains = list(d["domains"])
        elif list(d["domains"]) != domains:
            raise ValueError(f"{f}: domains {d['domains']} differ from the panel's {domains}")
        for m, r in d["lengths"][length]["methods"].items():
            if m == "plain-fp32" or m in out:
                continue
            per = {dom: (r["per_domain"][dom]["kl"], r["per_domain"][dom]["kl_ci95"]) for dom in domains}
            if any(kl is None for kl, _ in per.values()):
                raise ValueError(f"{f}: {m} has no KL in some domain")
            mean = sum(kl for kl, _ in per.values()) / len(per)
            ci = r.get("kl_ci95")
            if ci is None:  # the domains' intervals combined as independent, for the mean of the domains
                ci = math.sqrt(sum(c * c for _, c in per.values())) / len(per)
            first = r["per_domain"][domains[0]]
            out[m] = {"per_domain": per, "all": (mean if r.get("kl") is None else r["kl"], ci),
                      "bits": r.get("bpe_measured"), "windows": first.get("windows"), "tokens": first.get("n")}
    if not out:
        raise ValueError(f"no method with a KL at {length} in {files}")
    return domains, out


def plot(panels: list[tuple[str, list[str]]], out: str) -> dict:
    """Draw the panels; returns {length: {method: entry}} as read."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    read = {length: read_panel(files, length) for length, files in panels}
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels), 4.2), squeeze=False)
    for ax, (length, _) in zip(axes[0], panels):
        domains, methods = read[length]
        names = sorted(methods, key=lambda m: (ORDER.index(m) if m in ORDER else len(ORDER), m))
        groups = domains + ["all"]
        width = 0.8 / len(names)
        for i, m in enumerate(names):
            e = methods[m]
            vals = [e["per_domain"][g] if g != "all" else e["all"] for g in groups]
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(groups))]
            bits = f" ({e['bits']:.2f} bits)" if e["bits"] is not None else ""
            ax.bar(xs, [v[0] for v in vals], width, yerr=[v[1] for v in vals], capsize=2,
                   color=COLORS.get(m, "#7e57c2"), edgecolor="black", linewidth=0.4, label=LABELS.get(m, m) + bits)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_ylabel("KL to the float32 model (lower is better)")
        e0 = methods[names[0]]
        ax.set_title(f"test split at {int(length) // 1024}K tokens: {e0['windows']} windows, "
                     f"{e0['tokens']} scored tokens per domain")
        top = max(v[0] + v[1] for e in methods.values() for v in [*e["per_domain"].values(), e["all"]])
        ax.set_ylim(0, top * 1.35)  # room above the bars for the legend
        ax.legend(fontsize=8, ncols=2, loc="upper center")
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("SmolLM2-135M-Instruct on text rotkv never saw: KL per domain (bars: 95% interval over windows)")
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    print(out)
    return {length: read[length][1] for length, _ in panels}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--panel", nargs="+", action="append", required=True, metavar=("LENGTH", "SUITE_JSON"),
                    help="a length (tokens) and the suite.json files of its panel")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    panels = []
    for p in args.panel:
        if len(p) < 2 or not p[0].isdigit():
            ap.error(f"--panel takes a length and at least one suite.json, got {p}")
        panels.append((p[0], p[1:]))
    plot(panels, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
