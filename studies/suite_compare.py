"""Paired comparison of methods across two ``rotkv eval --suite`` folders (for example one preset with artifacts
calibrated two ways, each run in its own folder on the same windows): per domain and as the mean over domains,
the KL of each, and the difference with its paired 95% interval.

    python studies/suite_compare.py --length 2048 \\
        old=/tmp/acc/test2k_old:oscar-mix new=/tmp/acc/test2k_new:oscar-mix [--out compare.md]
    python studies/suite_compare.py --length 8192 --interval domains \\
        base=/tmp/dev-base:oscar-refine trade=/tmp/dev-kl13w16:oscar-refine [--out compare.md]

``--interval windows`` (the default) pairs over the windows within each domain, stratified by domain
(rotkv.eval.suite.paired_difference); a domain with one window adds no spread. ``--interval domains`` takes each
domain's KL difference (run - baseline, same windows) as one paired observation: the 95% interval of their mean
is Student's t with (domains - 1) degrees of freedom, and a "domains lower" column counts the domains where the
run's KL is below the baseline's. This is the one to use when each domain has one window.

Each argument is LABEL=DIR:METHOD; every one is compared with the first. The folders have to hold the same
suite split at the same windows (the texts and window counts are checked). Measured bits (all tiers counted) are
the mean of the domains' ``bpe_measured``, shown when every record has it. A run stopped before it wrote
suite.json counts the domains it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from scipy import stats

from rotkv.eval.suite import paired_difference

DOMAINS = ("prose", "code", "docs", "dialogue")


def _num(x: float, sign: bool = False) -> str:
    """Four decimals, or three significant digits in scientific form below 0.001 (pmkvq's KL)."""
    if x and abs(x) < 1e-3:
        return f"{x:+.2e}" if sign else f"{x:.2e}"
    return f"{x:+.4f}" if sign else f"{x:.4f}"


def load(spec: str, length: int):
    """(label, split, {domain: nll record}, {domain: (text file, windows, new tokens, chunk)}) of LABEL=DIR:METHOD.
    A run stopped before it wrote suite.json counts the domains it finished (in the suite's order); the split is
    then read from each domain's text file name (<domain>_<split>.txt)."""
    label, _, rest = spec.partition("=")
    folder, _, method = rest.rpartition(":")
    summary = None
    if os.path.exists(os.path.join(folder, "suite.json")):
        with open(os.path.join(folder, "suite.json")) as f:
            summary = json.load(f)
        domains = summary["domains"]
    else:
        domains = [d for d in DOMAINS if os.path.exists(os.path.join(folder, d, "results.json"))]
    recs, texts = {}, {}
    for d in domains:
        with open(os.path.join(folder, d, "results.json")) as f:
            rs = [r for r in json.load(f)["records"] if r["method"] == method and r["task"] == "nll"
                  and r["length"] == length]
        if not rs:
            raise SystemExit(f"{folder}/{d}: no nll record of {method} at {length}")
        recs[d] = rs[0]
        with open(os.path.join(folder, d, "config.json")) as f:
            cfg = json.load(f)["config"]
        texts[d] = (os.path.basename(cfg["texts"][0]), cfg["nll_windows"], cfg["new_tokens"], cfg["chunk"])
    if not recs:
        raise SystemExit(f"{folder}: no suite.json and no finished domain")
    if summary is not None:
        split = summary["split"]
    else:
        splits = sorted({os.path.splitext(t[0])[0].rpartition("_")[2] for t in texts.values()})
        split = "/".join(splits) + ("" if len(domains) == len(DOMAINS) else f" ({len(domains)} of {len(DOMAINS)} domains)")
    return label, split, recs, texts


def t_interval(xs: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% Student-t interval) of paired differences."""
    n = len(xs)
    m = sum(xs) / n
    if n < 2:
        return m, float("nan")
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    return m, stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="LABEL=DIR:METHOD; the first is the baseline")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--interval", choices=("windows", "domains"), default="windows",
                    help="windows: paired over windows, stratified by domain; domains: Student-t over the "
                         "per-domain differences (for one window per domain)")
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    args = ap.parse_args(argv)
    runs = [load(s, args.length) for s in args.runs]
    base_label, split, base, base_texts = runs[0]
    domains = list(base)
    for label, sp, recs, texts in runs[1:]:
        if sp != split or texts != base_texts:
            raise SystemExit(f"{label} ran another split or other windows than {base_label}: {texts} / {base_texts}")
    over_domains = args.interval == "domains"
    bits = all("bpe_measured" in recs[d] for _, _, recs, _ in runs for d in domains)
    w, nt = base_texts[domains[0]][1], base_texts[domains[0]][2]
    how = (f"paired per domain, 95% Student-t interval over the {len(domains)} domains "
           f"({len(domains) - 1} degrees of freedom)" if over_domains else "paired over windows")
    lines = [f"Suite split {split}, {args.length} tokens, {w} {'window(s)' if over_domains else 'windows'} x {nt} "
             f"tokens per domain; difference against "
             f"{base_label}, {how}.", "",
             "| run | " + ("measured bits | " if bits else "") + " | ".join(f"KL {d}" for d in domains)
             + " | KL mean over domains | difference ± paired 95% CI | " + ("domains lower | " if over_domains else "")
             + "ratio |",
             "|" + "---|" * (len(domains) + 4 + bits + over_domains)]
    base_mean = sum(base[d]["kl"] for d in domains) / len(domains)
    for label, _, recs, _ in runs:
        mean = sum(recs[d]["kl"] for d in domains) / len(domains)
        diffs = [recs[d]["kl"] - base[d]["kl"] for d in domains]
        if label == base_label:
            diff, lower = "-", "-"
        else:
            m, ci = t_interval(diffs) if over_domains else paired_difference(recs, base)
            diff = f"{_num(m, True)} ± {_num(ci)}"
            lower = f"{sum(x < 0 for x in diffs)}/{len(diffs)}"
        cells = " | ".join(_num(recs[d]['kl']) for d in domains)
        lead = f"{sum(recs[d]['bpe_measured'] for d in domains) / len(domains):.3f} | " if bits else ""
        tail = f"{lower} | " if over_domains else ""
        lines.append(f"| {label} | {lead}{cells} | {_num(mean)} | {diff} | {tail}{mean / base_mean:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
