"""Evaluation suites: text of several domains, each split into a dev and a test part, scored domain by domain
and summarized as the mean over domains with a paired interval.

A suite's texts live in ``rotkv/data/suite/<domain>_<split>.txt``; ``rotkv/data/suite/sources.json`` names the
package, version, files, license and sha256 of each (``scripts/build_suite_texts.py`` rebuilds them), and none
of them shares text with the calibration corpus (``rotkv/data/calib_*.txt``). Levers are chosen on ``dev``;
reports quote ``test``.

Each domain runs as its own ``rotkv eval`` folder (``OUT/<domain>/``, with its cache, so a run resumes), with a
fixed number of nll windows at every length. The summary (``OUT/suite.md``, ``OUT/suite.json``) takes the
per-window means of each domain: the mean over domains weights every domain alike, and its interval is the
stratified one, ``1.96 * sqrt(sum_d s_d^2 / n_d) / D`` with ``s_d`` the spread of domain d's window means over
its ``n_d`` windows; a paired interval takes the same over the per-window differences of two methods, which
ran on the same windows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from rotkv.eval.config import DATA_DIR, EvalConfig

SUITE_DIR = os.path.join(DATA_DIR, "suite")
SPLITS = ("dev", "test")
# name -> its domains; every domain has a dev and a test file
SUITES: dict[str, tuple[str, ...]] = {"mixed": ("prose", "code", "docs", "dialogue")}
# the suite's nll protocol where the run gives none: 16 windows x 128 tokens = 2048 scored tokens per domain
# and length, at every length
SUITE_WINDOWS = 16
SUITE_NEW_TOKENS = 128
# the metrics the summary averages over domains
METRICS = ("kl", "nll", "top1")


def suite_texts(name: str, split: str) -> dict[str, str]:
    """{domain: text file} of suite ``name``'s ``split``."""
    if name not in SUITES:
        raise ValueError(f"`suite` has to be one of {list(SUITES)} but got {name!r}")
    if split not in SPLITS:
        raise ValueError(f"`split` has to be one of {list(SPLITS)} but got {split!r}")
    out = {}
    for d in SUITES[name]:
        path = os.path.join(SUITE_DIR, f"{d}_{split}.txt")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"suite text {path} not found (scripts/build_suite_texts.py writes it)")
        out[d] = path
    return out


def sources() -> dict:
    """``rotkv/data/suite/sources.json``: package, version, files, license and sha256 of every suite and added
    calibration text."""
    with open(os.path.join(SUITE_DIR, "sources.json")) as f:
        return json.load(f)


def domain_config(cfg: EvalConfig, path: str) -> EvalConfig:
    """``cfg`` for one domain: its text, its windows at every length (no fewer at longer contexts)."""
    return dataclasses.replace(cfg, texts=[path], nll_scale_windows=False)


def evaluate_suite(cfg: EvalConfig, name: str, split: str, out_dir: str, loaded=None, log=print) -> dict:
    """Run (or resume) every domain of the suite into ``out_dir/<domain>/``; returns the summary (see
    :func:`summarize`), also written to ``out_dir/suite.json`` and ``out_dir/suite.md``."""
    from rotkv.eval.report import write_report
    from rotkv.eval.run import evaluate
    from rotkv.hf.models import load_model

    import torch

    texts = suite_texts(name, split)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    loaded = loaded or load_model(cfg.model, device=cfg.device, dtype=torch.float32)
    per_domain = {}
    for domain, path in texts.items():
        log(f"suite {name}/{split}: domain {domain} ({os.path.basename(path)})")
        per_domain[domain] = evaluate(domain_config(cfg, path), os.path.join(out_dir, domain), loaded, log)
        if per_domain[domain]:
            write_report(os.path.join(out_dir, domain))
    return write_summary(out_dir, name, split, per_domain, cfg)


def rebuild_suite(cfg: EvalConfig, name: str, split: str, out_dir: str) -> dict:
    """The summary again from the domain folders' caches (no model)."""
    from rotkv.eval.report import write_report
    from rotkv.eval.run import rebuild

    per_domain = {}
    for d, p in suite_texts(name, split).items():
        per_domain[d] = rebuild(domain_config(cfg, p), os.path.join(out_dir, d))
        if per_domain[d]:
            write_report(os.path.join(out_dir, d))
    return write_summary(out_dir, name, split, per_domain, cfg)


# ---- the summary --------------------------------------------------------------------------------------
def _stratified(per_domain: list[list[float]]) -> tuple[float, float, int]:
    """(mean over domains of each domain's mean, half-width of its 95% interval, windows) of per-window values;
    a domain with one window adds no spread."""
    means, var = [], 0.0
    for xs in per_domain:
        n = len(xs)
        m = sum(xs) / n
        means.append(m)
        if n > 1:
            var += sum((x - m) ** 2 for x in xs) / (n - 1) / n
    d = len(per_domain)
    return sum(means) / d, 1.96 * math.sqrt(var) / d, sum(len(xs) for xs in per_domain)


def _windows(rec: dict, metric: str) -> list[float] | None:
    return rec.get("per_window", {}).get(metric)


def paired_difference(a: dict[str, dict], b: dict[str, dict], metric: str = "kl") -> tuple[float, float]:
    """(mean over domains of the per-window ``metric`` difference a - b, its paired 95% half-width) of two nll
    records per domain ({domain: record}) that ran on the same windows."""
    diffs = []
    for d in a:
        xa, xb = _windows(a[d], metric), _windows(b[d], metric)
        if xa is None or xb is None or len(xa) != len(xb):
            raise ValueError(f"{a[d]['method']} and {b[d]['method']} ran on different windows in domain {d} "
                             f"at {a[d]['length']}")
        diffs.append([x - y for x, y in zip(xa, xb)])
    mean, ci, _ = _stratified(diffs)
    return mean, ci


def summarize(per_domain: dict[str, list[dict]], baselines: tuple[str, ...] = ("int4", "hf-quanto-int4")) -> dict:
    """{"lengths": {L: {"methods": {m: {...}}, "paired": {...}}}}: per method and length the mean over domains of
    KL, NLL and top-1 with stratified intervals, its mean measured bits and its per-domain figures; "paired":
    for each baseline present and each other method, the mean over domains of the per-window KL difference
    (method - baseline) with its paired interval, and the ratio of the means. A method or length missing in a
    domain is left out of that length's mean (and listed under "incomplete")."""
    domains = list(per_domain)
    nll_recs = {d: [r for r in rs if r["task"] == "nll"] for d, rs in per_domain.items()}
    lengths = sorted({r["length"] for rs in nll_recs.values() for r in rs})
    out: dict = {"domains": domains, "lengths": {}}
    for L in lengths:
        by = {d: {r["method"]: r for r in rs if r["length"] == L} for d, rs in nll_recs.items()}
        names = []
        for d in domains:
            names += [m for m in by[d] if m not in names]
        methods, incomplete = {}, []
        for m in names:
            recs = [by[d].get(m) for d in domains]
            if any(r is None for r in recs) or any(_windows(r, "nll") is None for r in recs):
                incomplete.append(m)
                continue
            row = {"windows": sum(r["windows"] for r in recs), "tokens": sum(r["n"] for r in recs),
                   "per_domain": {d: {k: r.get(k) for k in ("kl", "kl_ci95", "nll", "ppl", "top1", "bpe_measured",
                                                          "n", "windows")} for d, r in zip(domains, recs)}}
            for k in METRICS:
                if all(_windows(r, k) is not None for r in recs):
                    row[k], row[k + "_ci95"], _ = _stratified([_windows(r, k) for r in recs])
            if all("bpe_measured" in r for r in recs):
                row["bpe_measured"] = sum(r["bpe_measured"] for r in recs) / len(recs)
            methods[m] = row
        paired = {}
        for b in baselines:
            if b not in methods or "kl" not in methods[b]:
                continue
            for m, row in methods.items():
                if m == b or "kl" not in row:
                    continue
                mean, ci = paired_difference({d: by[d][m] for d in domains}, {d: by[d][b] for d in domains})
                paired[f"{m} vs {b}"] = {"method": m, "baseline": b, "kl_diff": mean, "kl_diff_ci95": ci,
                                         "kl_ratio": row["kl"] / methods[b]["kl"] if methods[b]["kl"] else None}
        out["lengths"][L] = {"methods": methods, "paired": paired, "incomplete": incomplete}
    return out


def _kl(x) -> str:
    return "-" if x is None else (f"{x:.4f}" if abs(x) >= 1e-3 else f"{x:.1e}")


def summary_markdown(summary: dict, name: str, split: str, cfg: EvalConfig | None = None) -> list[str]:
    domains = summary["domains"]
    lines = [f"# rotkv eval --suite {name} --split {split}", ""]
    if cfg is not None:
        tiers = lambda v: "each preset's own" if v in (None, "preset") else v  # noqa: E731
        lines += [f"nll protocol: {cfg.nll_windows} windows x {cfg.new_tokens} teacher-forced tokens per domain and "
                  f"length, prefill chunks of {cfg.chunk}, sink {tiers(cfg.sink)}, window {tiers(cfg.window)}, "
                  f"device {cfg.device}; domains: {', '.join(domains)}.", ""]
    lines += ["Mean over domains (each domain weighs the same); the interval is the stratified 95% interval of the "
              "per-window means (windows as the unit, domains as strata). Paired: the same over the per-window "
              "differences of two methods on the same windows.", ""]
    for L, block in summary["lengths"].items():
        methods = block["methods"]
        lines += [f"## {L} tokens", "",
                  "| method | bits (measured) | KL, mean over domains ± 95% CI | NLL | top-1 | "
                  + " | ".join(f"KL {d}" for d in domains) + " |", "|" + "---|" * (5 + len(domains))]
        for m, row in methods.items():
            per = [_kl(row["per_domain"][d]["kl"]) for d in domains]
            bpe = row.get("bpe_measured")
            kl = "0" if m == "plain-fp32" else f"{_kl(row.get('kl'))} ± {_kl(row.get('kl_ci95'))}"
            top1 = "-" if row.get("top1") is None else f"{row['top1']:.3f}"
            lines.append(f"| {m} | {'-' if bpe is None else format(bpe, '.2f')} | {kl} | "
                         f"{row['nll']:.3f} ± {row['nll_ci95']:.3f} | {top1} | " + " | ".join(per) + " |")
        if block["paired"]:
            lines += ["", "| method vs baseline | KL difference ± paired 95% CI | KL ratio |", "|---|---|---|"]
            for key, p in block["paired"].items():
                ratio = "-" if p["kl_ratio"] is None else f"{p['kl_ratio']:.2f}x"
                lines.append(f"| {key} | {p['kl_diff']:+.4f} ± {p['kl_diff_ci95']:.4f} | {ratio} |")
        lines += ["", "Per domain (KL ± 95% CI over tokens, NLL, top-1, bits, scored tokens / windows):", "",
                  "| method | " + " | ".join(domains) + " |", "|" + "---|" * (1 + len(domains))]
        for m, row in methods.items():
            cells = []
            for d in domains:
                r = row["per_domain"][d]
                kl = "-" if r.get("kl") is None else f"{_kl(r['kl'])} ± {_kl(r['kl_ci95'])}"
                top1 = "-" if r.get("top1") is None else f"{r['top1']:.3f}"
                bpe = "-" if r.get("bpe_measured") is None else f"{r['bpe_measured']:.2f}"
                cells.append(f"{kl}, {r['nll']:.3f}, {top1}, {bpe}, {r['n']}/{r['windows']}")
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        if block["incomplete"]:
            lines += ["", f"Not in every domain (left out of the mean): {', '.join(block['incomplete'])}."]
        lines.append("")
    return lines


def write_summary(out_dir: str, name: str, split: str, per_domain: dict[str, list[dict]],
                  cfg: EvalConfig | None = None) -> dict:
    summary = summarize(per_domain)
    summary.update(suite=name, split=split)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "suite.json"), "w") as f:
        json.dump(summary, f, indent=1)
    with open(os.path.join(out_dir, "suite.md"), "w") as f:
        f.write("\n".join(summary_markdown(summary, name, split, cfg)) + "\n")
    return summary
