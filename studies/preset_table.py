"""The README's preset table: per preset, its measured bits, KL and needle retrieval (one ``rotkv eval`` run,
each preset at its own sink and window) and its decode step (``rotkv.bench.run_method``), in one JSON.

    OMP_NUM_THREADS=1 .venv/bin/python studies/preset_table.py --artifact-dir artifacts \\
        --out docs/results/presets-cpu

Writes ``OUT/eval/`` (the eval run: results.json, report.md, its cache) and ``OUT/presets.json``: one row per
preset with ``bits`` (measured at the nll length), ``kl`` and ``kl_ci95`` (against the fp32 model), ``niah``
(needles found over every NIAH question of the run) with ``niah_found`` and ``niah_n``, and ``step_ms`` (median
greedy decode step at ``--batch`` x ``--context`` on ``--device``), plus the commands and the run's settings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

PRESETS = ["bf16", "int4", "quarot-int2", "oscar-mix", "oscar-mix-long", "oscar-refine"]


def run_eval(a, out: str) -> list[str]:
    from rotkv.cli import main as rotkv_main

    if a.report_only:  # a run stopped part way: its results.json rebuilt from what its cache holds
        argv = ["eval", "--report-only", "--out", out]
        if rotkv_main(argv) != 0:
            raise SystemExit("rotkv eval --report-only failed")
        return argv
    argv = ["eval", "--methods", ",".join(a.presets), "--sink", "preset", "--window", "preset",
            "--tasks", "nll,niah", "--lengths", f"nll={a.length}", f"niah={a.niah_lengths}",
            "--windows", str(a.windows), "--samples", str(a.samples), "--threads", str(a.threads),
            "--device", a.device, "--artifact-dir", a.artifact_dir, "--out", out]
    if rotkv_main(argv) != 0:
        raise SystemExit("rotkv eval failed")
    return argv


def step_times(a) -> dict[str, dict]:
    import torch

    from rotkv.bench import prompts, run_method
    from rotkv.config import PRESETS as SPECS
    from rotkv.config import artifact_file
    from rotkv.hf.models import load_model

    torch.set_num_threads(a.threads)
    m = load_model(device=a.device)
    ids = prompts(m.model.config.vocab_size, a.batch, a.context).to(m.model.device)
    out = {}
    for preset in a.presets:
        art = os.path.join(a.artifact_dir, artifact_file(preset)) if SPECS[preset].needs_artifact else None
        run, mem = run_method(m.model, f"rotkv:{preset}", ids, a.new_tokens, art)
        out[preset] = {"step_ms": run.step_ms, "prefill_s": run.prefill_s, "bits_at_step": mem["bits_per_element"]}
        print(f"{preset}: step {run.step_ms:.1f} ms, {mem['bits_per_element']:.2f} bits", flush=True)
    return out


def rows(results: dict, steps: dict, presets: list[str], length: int) -> list[dict]:
    out = []
    for p in presets:
        nll = [r for r in results["records"] if r["method"] == p and r["task"] == "nll" and r["length"] == length]
        niah = [r for r in results["records"] if r["method"] == p and r["task"] == "niah"]
        if len(nll) != 1 or not niah:
            raise SystemExit(f"the eval run has no nll record at {length} or no niah records for {p}")
        found = sum(round(r["accuracy"] * r["n"]) for r in niah)
        n = sum(r["n"] for r in niah)
        out.append({"preset": p, "bits": nll[0]["bpe_measured"], "kl": nll[0]["kl"], "kl_ci95": nll[0]["kl_ci95"],
                    "niah": found / n, "niah_found": found, "niah_n": n,
                    "niah_units": sorted({f"{r['variant']}@{r['length']}" for r in niah}), **steps[p]})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--artifact-dir", required=True, help="artifacts; a missing one is calibrated by rotkv eval")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--length", type=int, default=2048, help="nll context (KL and bits)")
    ap.add_argument("--niah-lengths", default="1024,2048")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--samples", type=int, default=1, help="haystacks per NIAH cell")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=2048, help="decode-step context")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--report-only", action="store_true",
                    help="do not run the eval: rebuild OUT/eval's results.json from its cache (a run stopped part "
                         "way keeps what it finished), then time the steps")
    a = ap.parse_args(argv)
    a.presets = a.presets.split(",")
    os.makedirs(a.out, exist_ok=True)
    eval_dir = os.path.join(a.out, "eval")
    eval_argv = run_eval(a, eval_dir)
    steps = step_times(a)
    with open(os.path.join(eval_dir, "results.json")) as f:
        results = json.load(f)
    from rotkv.bench import commit

    doc = {"rows": rows(results, steps, a.presets, a.length),
           "eval_command": "rotkv " + " ".join(eval_argv),
           "eval_run_argv": json.load(open(os.path.join(eval_dir, "config.json"))).get("argv"),
           "command": "python studies/preset_table.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "step": {"batch": a.batch, "context": a.context, "new_tokens": a.new_tokens, "device": a.device,
                    "threads": a.threads},
           "commit": commit(), "host": platform.processor() or platform.machine()}
    with open(os.path.join(a.out, "presets.json"), "w") as f:
        json.dump(doc, f, indent=1)
    for r in doc["rows"]:
        print(f"| {r['preset']} | {r['bits']:.2f} | {r['kl']:.4f} +- {r['kl_ci95']:.4f} | "
              f"{r['niah_found']}/{r['niah_n']} | {r['step_ms']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
