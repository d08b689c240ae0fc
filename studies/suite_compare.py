"""Paired comparison of methods across two ``rotkv eval --suite`` folders (for example one preset with artifacts
calibrated two ways, each run in its own folder on the same windows): per domain and as the mean over domains,
the KL of each, and the difference with its paired, stratified 95% interval (rotkv.eval.suite).

    python studies/suite_compare.py --length 2048 \\
        old=/tmp/acc/test2k_old:oscar-mix new=/tmp/acc/test2k_new:oscar-mix [--out compare.md]

Each argument is LABEL=DIR:METHOD; every one is compared with the first. The folders have to hold the same
suite split at the same windows (the texts and window counts are checked).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rotkv.eval.suite import paired_difference


def load(spec: str, length: int):
    label, _, rest = spec.partition("=")
    folder, _, method = rest.rpartition(":")
    with open(os.path.join(folder, "suite.json")) as f:
        summary = json.load(f)
    recs, texts = {}, {}
    for d in summary["domains"]:
        with open(os.path.join(folder, d, "results.json")) as f:
            rs = [r for r in json.load(f)["records"] if r["method"] == method and r["task"] == "nll"
                  and r["length"] == length]
        if not rs:
            raise SystemExit(f"{folder}/{d}: no nll record of {method} at {length}")
        recs[d] = rs[0]
        with open(os.path.join(folder, d, "config.json")) as f:
            cfg = json.load(f)["config"]
        texts[d] = (os.path.basename(cfg["texts"][0]), cfg["nll_windows"], cfg["new_tokens"], cfg["chunk"])
    return label, summary["split"], recs, texts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=DIR:METHOD; the first is the baseline")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    args = ap.parse_args(argv)
    runs = [load(s, args.length) for s in args.runs]
    base_label, split, base, base_texts = runs[0]
    domains = list(base)
    for label, sp, recs, texts in runs[1:]:
        if sp != split or texts != base_texts:
            raise SystemExit(f"{label} ran another split or other windows than {base_label}: {texts} / {base_texts}")
    lines = [f"Suite split {split}, {args.length} tokens, {base_texts[domains[0]][1]} windows x "
             f"{base_texts[domains[0]][2]} tokens per domain; difference against {base_label}, paired over windows.", "",
             "| run | " + " | ".join(f"KL {d}" for d in domains) + " | KL mean over domains | difference ± paired 95% CI | ratio |",
             "|" + "---|" * (len(domains) + 4)]
    base_mean = sum(base[d]["kl"] for d in domains) / len(domains)
    for label, _, recs, _ in runs:
        mean = sum(recs[d]["kl"] for d in domains) / len(domains)
        if label == base_label:
            diff = "-"
        else:
            m, ci = paired_difference(recs, base)
            diff = f"{m:+.4f} ± {ci:.4f}"
        cells = " | ".join(f"{recs[d]['kl']:.4f}" for d in domains)
        lines.append(f"| {label} | {cells} | {mean:.4f} | {diff} | {mean / base_mean:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
