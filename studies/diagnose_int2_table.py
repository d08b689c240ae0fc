"""Markdown tables from the JSON files of studies/diagnose_int2.py.

    python studies/diagnose_int2_table.py docs/results/diagnosis/*.json
"""

from __future__ import annotations

import argparse
import json


def row(key: str, r: dict) -> str:
    delta = ""
    if "delta_vs_preset" in r:
        delta = f"{r['delta_vs_preset']:+.4f} +- {r['delta_ci95']:.4f}"
    extra = f"{r['side_bpe']:.3f}" if r.get("side_bpe") else ""
    return (f"| {key} | {r['kl']:.4f} +- {r['kl_ci95']:.4f} | {delta} | {r['top1']:.3f} | {r['bpe']:.3f} | {extra} |"
            f" {r['seconds']:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--stats", action="store_true", help="also the per-layer attention-mass table")
    args = ap.parse_args()
    for f in args.files:
        d = json.load(open(f))
        s = d["settings"]
        print(f"\n### {f}\n\nL={s['length']}, {s['windows']} windows x {s['new_tokens']} tokens, chunk {s['chunk']}, "
              f"sink {s['sink']}, window {s['window']}\n")
        print("| run | KL +- 95% | delta KL vs preset (paired) | top-1 | bits/elem | sparse bits | s |")
        print("|---|---|---|---|---|---|---|")
        for k, r in d["runs"].items():
            print(row(k, r))
        if args.stats:
            for p, st in d.get("token_stats", {}).items():
                print(f"\n{p}: decode attention mass (mean over KV heads and windows)\n")
                print("| layer | sink | body | window | top-8 share of body | top-32 share of body | rank corr(key norm, mass) |")
                print("|---|---|---|---|---|---|---|")
                for layer, r in st["layers"].items():
                    print(f"| {layer} | {r['sink_mass']:.3f} | {r['body_mass']:.3f} | {r['window_mass']:.3f} | "
                          f"{r['top8_body_mass']:.3f} | {r['top32_body_mass']:.3f} | {r['norm_dec_spearman']:+.2f} |")
                print("\ntop-8 body tokens by decode mass, most frequent:", st["top_tokens"])


if __name__ == "__main__":
    main()
