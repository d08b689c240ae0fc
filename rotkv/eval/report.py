"""DIR/report.md from DIR/results.json and DIR/config.json, and the plots."""

from __future__ import annotations

import json
import os
from collections import defaultdict

from rotkv.eval import plots
from rotkv.eval.peers import PEERS
from rotkv.eval.stats import wilson


def _tiers_text(cfg: dict) -> str:
    """'sink 16 and window 32', with ``"preset"`` (or none given) written as each preset's own."""
    own = lambda v: "each preset's own" if v in (None, "preset") else v  # noqa: E731
    return f"sink {own(cfg.get('sink'))} and window {own(cfg.get('window'))}"


def _f(x, spec=".3f", none="-"):
    return none if x is None else format(x, spec)


def _bpe(r):
    """Measured bpe; for a cache holding float32 tensors (peers on the float32 CPU model) also at a bf16 model."""
    if r is None:
        return "-"
    b, b16 = r["bpe_measured"], r.get("bpe_at_bf16", r["bpe_measured"])
    return f"{b:.2f}" if abs(b - b16) < 0.01 else f"{b:.2f} ({b16:.2f} at bf16)"


def _kl(x):
    return "-" if x is None else (f"{x:.4f}" if x >= 1e-3 else f"{x:.1e}")


def _order(records):
    return plots._method_order(records)


def _by(records, **kw):
    return [r for r in records if all(r.get(k) == v for k, v in kw.items())]


def niah_pooled(records, method, length=None):
    """(accuracy, ci95, n, mean measured bpe) over every niah question of a method (at one length)."""
    rs = [r for r in _by(records, method=method, task="niah") if length is None or r["length"] == length]
    n = sum(r["n"] for r in rs)
    if not n:
        return None
    acc, ci = wilson(sum(r["accuracy"] * r["n"] for r in rs), n)
    return acc, ci, n, sum(r["bpe_measured"] * r["n"] for r in rs) / n


def main_table(records) -> list[str]:
    methods = _order(records)
    nll_L = sorted({r["length"] for r in records if r["task"] == "nll"})
    niah_L = sorted({r["length"] for r in records if r["task"] == "niah"})
    attn_L = sorted({r["length"] for r in records if r["task"] == "attn-error"})
    head = ["method"]
    for L in nll_L:
        head += [f"bpe @{L}", f"ppl @{L}", f"KL @{L}", f"top-1 @{L}"]
    for L in attn_L:
        head += [f"attn err @{L}"]
    for L in niah_L:
        head += [f"NIAH @{L} (bpe)"]
    if niah_L:
        head += ["NIAH all"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    plain = {r["length"]: r for r in _by(records, method="plain-fp32", task="nll")}
    if plain:
        row = ["plain model (fp32, no cache)"]
        for L in nll_L:
            p = plain.get(L)
            row += ["32 (fp32)", _f(p and p["ppl"], ".2f"), "0", "1"]
        row += ["-"] * (len(head) - len(row))
        lines.append("| " + " | ".join(row) + " |")
    for m in methods:
        row = [m]
        for L in nll_L:
            r = next(iter(_by(records, method=m, task="nll", length=L)), None)
            row += [_bpe(r), _f(r and r["ppl"], ".2f"), _kl(r and r.get("kl")),
                    _f(r and r.get("top1"), ".3f")]
        for L in attn_L:
            r = next(iter(_by(records, method=m, task="attn-error", length=L)), None)
            row.append(f"{r['rel_error']:.4f} ({r['bpe_measured']:.2f})" if r else "-")
        for L in niah_L:
            p = niah_pooled(records, m, L)
            row.append(f"{p[0]:.2f} ({p[3]:.2f})" if p else "-")
        if niah_L:
            p = niah_pooled(records, m)
            row.append(f"{p[0]:.2f} ± {p[1]:.2f}, n={p[2]}" if p else "-")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def nll_table(records) -> list[str]:
    lines = ["| method | context | windows | tokens | NLL ± 95% CI | ppl | KL ± 95% CI | top-1 | KV MB | bpe measured | "
             "bpe at bf16 model | bpe nominal |", "|" + "---|" * 12]
    for r in sorted(_by(records, task="nll"), key=lambda r: (r["length"], r["method"] != "plain-fp32")):
        if r["method"] == "plain-fp32":
            lines.append(f"| plain model (fp32, no cache) | {r['length']} | {r['windows']} | {r['n']} | "
                         f"{r['nll']:.3f} ± {r['ci95']:.3f} | {r['ppl']:.2f} | 0 | 1 | - | - | - | - |")
            continue
        lines.append(
            f"| {r['method']} | {r['length']} | {r['windows']} | {r['n']} | {r['nll']:.3f} ± {r['ci95']:.3f} | "
            f"{r['ppl']:.2f} | {_kl(r['kl'])} ± {_kl(r['kl_ci95'])} | {r['top1']:.3f} | {r['kv_bytes'] / 1e6:.2f} | "
            f"{r['bpe_measured']:.2f} | {r['bpe_at_bf16']:.2f} | {r['bpe_nominal']:g} |")
    return lines


def niah_tables(records) -> list[str]:
    out = []
    for variant in ("noise", "essay", "multikey", "multivalue"):
        rs = _by(records, task="niah", variant=variant)
        if not rs:
            continue
        cols = sorted({(r["length"], r["depth"] if r["depth"] is not None else -1) for r in rs})
        head = ["method"] + [f"{L} @ {'all' if d < 0 else format(d, '.0%')}" for L, d in cols] + ["pooled ± 95% CI", "bpe"]
        out += [f"**{variant}**", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for m in _order(rs):
            row, k, n, bpe = [m], 0.0, 0, 0.0
            for L, d in cols:
                r = next((x for x in rs if x["method"] == m and x["length"] == L
                          and (x["depth"] if x["depth"] is not None else -1) == d), None)
                if r is None:
                    row.append("-")
                    continue
                mark = {"sink": " (S)", "window": " (W)"}.get(r["bf16_tier"], "")
                row.append(f"{r['accuracy']:.2f}{mark}")
                k, n, bpe = k + r["accuracy"] * r["n"], n + r["n"], bpe + r["bpe_measured"] * r["n"]
            acc, ci = wilson(k, n) if n else (float("nan"), float("nan"))
            row += [f"{acc:.2f} ± {ci:.2f} (n={n})", f"{bpe / max(n, 1):.2f}"]
            out.append("| " + " | ".join(row) + " |")
        out.append("")
    return out


def attn_table(records) -> list[str]:
    rs = _by(records, task="attn-error")
    if not rs:
        return []
    lines = ["| method | context | mean rel. error ± 95% CI (over layers) | worst layer | bpe measured |", "|---|---|---|---|---|"]
    for r in rs:
        worst = max(range(len(r["rel_error_per_layer"])), key=lambda i: r["rel_error_per_layer"][i])
        lines.append(f"| {r['method']} | {r['length']} | {r['rel_error']:.4f} ± {r['ci95']:.4f} | "
                     f"{worst} ({r['rel_error_per_layer'][worst]:.4f}) | {r['bpe_measured']:.2f} |")
    return lines


def write_report(out_dir: str) -> list[str]:
    with open(os.path.join(out_dir, "results.json")) as f:
        blob = json.load(f)
    records, unavailable = blob["records"], blob.get("unavailable", {})
    cfg_path = os.path.join(out_dir, "config.json")
    prov = json.load(open(cfg_path)) if os.path.exists(cfg_path) else {}
    cfg = prov.get("config", {})
    paths = plots.plot_heatmaps(records, out_dir) + plots.plot_pareto(records, out_dir, set(PEERS)) + plots.plot_attn(records, out_dir)
    secs = defaultdict(float)
    for r in records:
        secs[r["method"]] += r.get("seconds", 0.0)
    L = ["# rotkv evaluation", ""]
    if prov:
        v = prov.get("versions", {})
        L += [f"- model: `{prov.get('model_id')}`; profile `{cfg.get('profile')}`; rotkv presets run with "
              f"{_tiers_text(cfg)} (bf16 tiers), prefill chunks of {cfg.get('chunk')} tokens",
              f"- commit `{(prov.get('git') or {}).get('commit')}`; torch {v.get('torch')}, transformers "
              f"{v.get('transformers')}, optimum-quanto {v.get('optimum-quanto')}, hqq {v.get('hqq')}, turboquant "
              f"{v.get('turboquant')}; {prov.get('threads')} CPU thread(s)",
              (f"- merged from the cache on {prov.get('report_utc')} by `{' '.join(prov['argv_merge'])}`; the runs "
               "that filled the cache: see run_full.sh and log_*.txt" if prov.get("argv_merge") else
               f"- started {prov.get('started_utc')}; command: `{' '.join(prov.get('argv', []))}`"), ""]
    L += ["bpe = measured bits per element: resident bytes of the cache (codes, scales, bf16 sink/window, peer residuals "
          "and any dequantized copy a peer keeps) x 8 / (2 x tokens x kv_heads x head_dim x layers). The CPU run keeps the "
          "model in float32, so a peer's residual and metadata are float32; `bpe at bf16 model` counts those float32 "
          "tensors at 2 bytes. Rotation matrices are not counted (fixed per model, not per token).", ""]
    methods = set(_order(records))
    notes = []
    if methods & set(PEERS):
        notes.append("Peers run with their own defaults through their own APIs: transformers' `QuantizedCache` (quanto / "
                     "hqq backends: groups of 64 along the channel axis, a 128-token residual at the model dtype, and the "
                     "whole cache re-quantized whenever the residual fills) and `turboquant.TurboQuantCache(bits=3)` "
                     "(uint8 codes, float32 norms, a 128-token residual, and the dequantized cache kept as the layer's "
                     "keys/values). turboquant 0.2.0 fails on transformers 5.24 (`update() got an unexpected keyword "
                     "argument 'kwargs'`) and on numpy 2.4 (`np.trapz` removed); `rotkv/eval/peers.py` adapts the call "
                     "(a subclass whose `update` drops the extra arguments) and restores the `np.trapz` alias; the "
                     "environment is unchanged.")
    if methods - set(PEERS):
        notes.append("rotkv's paged layers keep no float32 copy of the body (the CPU reader decodes it a chunk of "
                     "pages at a time); records made before that hold one in `scratch_bytes` (about 42-63 bits per "
                     "element at 1-3K tokens), not in rotkv's bpe. A peer's dequantized copy is counted because it "
                     "is part of the peer's only implementation.")
    if notes:
        L += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    if unavailable:
        L += ["## Not run", ""] + [f"- `{m}`: {why}" for m, why in unavailable.items()] + [""]
    if blob.get("unverified"):
        L += ["## Read back without their artifact", "",
              "These methods' records came from the cache of a run whose artifact is not here now, so its hash could "
              "not be checked; they were matched by their recorded settings:", ""]
        L += [f"- `{m}`: {why}" for m, why in blob["unverified"].items()] + [""]
    if blob.get("failed"):
        L += ["## Failed", ""] + [f"- `{k}`: {why}" for k, why in blob["failed"].items()] + [""]
    if blob.get("missing"):
        per = defaultdict(list)
        for x in blob["missing"]:
            m, unit = x.split(" ", 1)
            per[m].append(unit)
        L += ["## Not finished in this run", "", "Units of the configured plan without a result (the run was stopped "
              "before reaching them):", ""] + [f"- `{m}`: " + ", ".join(units) for m, units in per.items()] + [""]
    L += ["## Main table", ""] + main_table(records) + [""]
    L += ["NIAH cells: accuracy pooled over the variants and depths at that length (measured bpe in brackets); "
          "`NIAH all`: every question, Wilson 95% interval.", ""]
    L += ["## nll: decode after a context", "", "The context is prefilled in chunks through the method's cache; the next "
          "tokens are teacher-forced one per call. KL is against the plain model (float32, no cache). Intervals are over "
          "tokens and ignore the correlation within a window.", ""] + nll_table(records) + [""]
    at = attn_table(records)
    if at:
        L += ["## attn-error", "", "Each layer isolated: its input is the plain model's, so the error is its own cache's.",
              ""] + at + [""]
    nt = niah_tables(records)
    if nt:
        L += ["## niah", "", "(S)/(W): the needle lies in the bf16 sink / recent window of the rotkv presets at question "
              "time, so quantization cannot touch it.", ""] + nt
    if secs:
        L += ["## Time per method (s, this run)", "", "| " + " | ".join(secs) + " |", "|" + "---|" * len(secs),
              "| " + " | ".join(f"{s:.0f}" for s in secs.values()) + " |", ""]
    L += ["## Plots", ""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in paths
                             if not os.path.basename(p).startswith("niah_heatmap_")]
    L += [""] + [f"- [{os.path.basename(p)}]({os.path.basename(p)})" for p in paths if os.path.basename(p).startswith("niah_heatmap_")]
    p = os.path.join(out_dir, "report.md")
    with open(p, "w") as f:
        f.write("\n".join(L) + "\n")
    return [p, write_readme_section(out_dir, records, prov, paths)] + paths


def write_readme_section(out_dir: str, records: list[dict], prov: dict, paths: list[str]) -> str:
    """A README section: the main table and one heatmap, with links relative to the repository root."""
    rel = os.path.relpath(out_dir, os.getcwd())
    heat = next((p for p in paths if os.path.basename(p) == "niah_heatmaps.png"), None)
    cfg = prov.get("config", {})
    dev = str(cfg.get("device") or "cpu")
    where = "a CPU" if dev == "cpu" else f"a GPU ({prov.get('gpu') or dev})"
    L = ["## Results", "",
         f"SmolLM2-135M-Instruct on {where}, every method through its own cache: the context is prefilled in chunks of "
         f"{cfg.get('chunk')} tokens that read the quantized cache of the earlier ones, and whatever is scored (the next "
         f"tokens, the question) reads the stored cache. rotkv presets keep a bf16 {_tiers_text(cfg)} "
         f"(tokens); peers run with their own defaults. Every score has the measured bits per element "
         "(all tiers, metadata and peer residuals counted) beside it. Full tables, intervals and plots: "
         f"[{rel}/report.md]({rel}/report.md).", ""]
    L += main_table(records) + [""]
    if heat:
        L += [f"![NIAH heatmaps]({rel}/{os.path.basename(heat)})", ""]
    L += [f"Reproduce: `rotkv eval --profile full{'' if dev == 'cpu' else ' --device ' + dev} --out DIR --artifact-dir ARTIFACTS` "
          f"(this run: [{rel}/run_full.sh]({rel}/run_full.sh)).", ""]
    p = os.path.join(out_dir, "README_section.md")
    with open(p, "w") as f:
        f.write("\n".join(L))
    return p
