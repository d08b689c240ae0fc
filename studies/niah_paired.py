"""Needles found per method from `rotkv eval` NIAH caches, paired by question: counts per length and variant, and
for each method against a reference the questions only one of them answered, with an exact two-sided sign test.

Each run is ``LABEL=CACHE_DIR`` (a method's cache folder, ``.../cache/<method>``, holding ``niah-<variant>-<length>.json``
files), or ``LABEL=DIR,DIR,...`` for one method's runs over different lengths taken together (a length found in two
of them is refused); runs over the same questions (same haystacks, needles and seed) pair question by question.

    python studies/niah_paired.py bf16=docs/results/niah-aqua-4-8k-cpu/cache/bf16 \\
        refine=docs/results/niah-aqua-4-8k-cpu/cache/oscar-refine odd=OUT/cache/oscar-aqua --reference bf16
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from math import comb


def answers(folder: str) -> dict:
    """``{(variant, length, cell, i): found}`` over the folder's NIAH cache files."""
    out = {}
    for path in sorted(glob.glob(os.path.join(folder, "niah-*.json"))):
        _, variant, length = os.path.basename(path)[:-5].split("-")
        data = json.load(open(path))
        for cell, rec in enumerate(data["records"] if isinstance(data, dict) else data):
            for i, a in enumerate(rec["answers"]):
                out[(variant, int(length), cell, i)] = any(e in a["answer"] for e in a["expected"])
    if not out:
        raise SystemExit(f"{folder}: no niah-*.json files")
    return out


def sign_p(a: int, b: int) -> float:
    n = a + b
    return min(1.0, 2 * sum(comb(n, i) for i in range(min(a, b) + 1)) / 2**n) if n else 1.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", metavar="LABEL=CACHE_DIR[,CACHE_DIR...]")
    ap.add_argument("--reference", default=None, help="the label others are paired against (default: the first)")
    a = ap.parse_args(argv)
    runs = {}
    for spec in a.runs:
        label, _, folder = spec.partition("=")
        if not folder:
            ap.error(f"{spec!r}: write LABEL=CACHE_DIR")
        merged = {}
        for part in folder.split(","):
            got = answers(part)
            clash = sorted({k[1] for k in got} & {k[1] for k in merged})
            if clash:
                ap.error(f"{spec!r}: length(s) {clash} in more than one of its folders")
            merged |= got
        runs[label] = merged
    ref = a.reference or next(iter(runs))
    common = set.intersection(*(set(r) for r in runs.values()))
    lengths = sorted({k[1] for k in common})
    variants = sorted({k[0] for k in common})
    print(f"{len(common)} questions every run answered\n")
    print("| run | " + " | ".join(str(n) for n in lengths) + " | " + " | ".join(variants) + " | all | only this / only "
          f"{ref} (sign test p) |")
    print("|---|" + "---|" * (len(lengths) + len(variants) + 2))
    for label, r in runs.items():
        by_len = [sum(r[k] for k in common if k[1] == n) for n in lengths]
        n_len = [sum(1 for k in common if k[1] == n) for n in lengths]
        by_var = [sum(r[k] for k in common if k[0] == v) for v in variants]
        n_var = [sum(1 for k in common if k[0] == v) for v in variants]
        tot = sum(r[k] for k in common)
        if label == ref:
            pair = "-"
        else:
            mine = sum(1 for k in common if r[k] and not runs[ref][k])
            theirs = sum(1 for k in common if runs[ref][k] and not r[k])
            pair = f"{mine} / {theirs} (p = {sign_p(mine, theirs):.2f})"
        cells = [f"{x}/{n}" for x, n in zip(by_len, n_len)] + [f"{x}/{n}" for x, n in zip(by_var, n_var)]
        print(f"| {label} | " + " | ".join(cells) + f" | **{tot}/{len(common)}** | {pair} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
