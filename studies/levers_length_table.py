"""The lever table of docs/results/levers_length.md from lever_length.py's and diagnose_length.py's JSON.

    python studies/levers_length_table.py docs/results/levers_length/L2048.json docs/results/levers_length/L8192.json \
        --screen docs/results/diagnosis_length/length.json
"""

from __future__ import annotations

import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--screen", default=None)
    args = ap.parse_args()
    runs, lengths = {}, []
    for f in args.files:
        d = json.load(open(f))
        L = d["settings"]["length"]
        lengths.append(L)
        for k, r in d["runs"].items():
            runs.setdefault(k, {})[L] = r
    lengths = sorted(set(lengths))
    for k, per in runs.items():  # emulated tiers: the base run's measured bits plus the tier's analytic bits
        for L, r in per.items():
            if r.get("bpe") is None and "tier_bits" in r and L in runs.get("base", {}):
                r["bpe"] = runs["base"][L]["bpe"] + r["tier_bits"]
    print("| lever | " + " | ".join(f"bits @{L // 1024}K | KL @{L // 1024}K | top-1 @{L // 1024}K | scored" for L in lengths) + " |")
    print("|---|" + "---|---|---|---|" * len(lengths))
    for k, per in sorted(runs.items(), key=lambda kv: kv[1].get(lengths[0], {}).get("bpe") or 99):
        cells = []
        for L in lengths:
            r = per.get(L)
            if r is None:
                cells.append("- | - | - | -")
                continue
            bits = f"{r['bpe']:.3f}" if r.get("bpe") is not None else "-"
            cells.append(f"{bits} | {r['kl']:.4f} +- {r['kl_ci95']:.4f} | {r['top1']:.3f} | {len(r['per_token_kl'])}")
        print(f"| {k} | " + " | ".join(cells) + " |")
    if args.screen:
        d = json.load(open(args.screen))
        print("\nOffline screen (attention-output error after W_O, mean over the 30 layers, same windows as the "
              "diagnosis; lower is better):\n")
        names = sorted({n for r in d["runs"].values() for n in r.get("levers", {})})
        keys = sorted(d["runs"], key=lambda k: int(k.split("/")[0][1:]))
        print("| config | " + " | ".join(f"K+V {k} | K only {k}" for k in keys) + " |")
        print("|---|" + "---|---|" * len(keys))

        def mean(recs, m):
            v = [x[m] for x in recs.values()]
            return sum(v) / len(v)
        print("| base | " + " | ".join(f"{mean(d['runs'][k]['layers'], 'both'):.4f} | {mean(d['runs'][k]['layers'], 'k_only'):.4f}"
                                       for k in keys) + " |")
        for n in names:
            cells = []
            for k in keys:
                lv = d["runs"][k].get("levers", {}).get(n)
                cells.append("- | -" if lv is None else f"{mean(lv['layers'], 'both'):.4f} | {mean(lv['layers'], 'k_only'):.4f}")
            print(f"| {n} | " + " | ".join(cells) + " |")
        pol = [m for m in next(iter(d["runs"][keys[0]]["layers"].values())) if m.startswith(("both_window", "both_recent4"))]
        for m in pol:
            cells = []
            for k in keys:
                recs = d["runs"][k]["layers"]
                cells.append(f"{mean(recs, m):.4f} | -" if m in next(iter(recs.values())) else "- | -")
            print(f"| policy {m[5:]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
