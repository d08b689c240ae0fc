"""Clip thresholds a write kernel could compute in one reduction, against the exact rank (CPU, real model).

The quantizer clips each row at the r-th largest ``|x|`` (``rotkv.quant.quantizer.clip_rows``). In
the write kernel that costs r rounds of a dependent warp reduction per row and doubles the kernel's
time (docs/kernels.md). This measures the accuracy cost of thresholds that take one reduction:

- ``max``: ``t = alpha * max|x|``;
- ``rms``: ``t = beta * rms(x)``;

with alpha and beta fixed per clip ratio as the medians of ``t_rank / max`` and ``t_rank / rms``
over the rows the cache clips on *calibration* text. Every mode, and no clipping at all, is then
measured on held-out *evaluation* text with the eval harness's attn-error (per-layer relative error of
the attention output after W_O, ``rotkv.eval.attn_error``) and by the KL divergence of the next-token
distribution from the uncached model's over ``--kl-new`` decoded tokens after the same prefill
(``rotkv.calibrate.keybits.decode_kl``). The result is the mean over layers (attn-error), tokens (KL)
and windows, with a 95% CI over windows of the paired difference against the exact rank::

    python studies/clip_threshold.py --artifact oscar.safetensors   # from `rotkv calibrate --method oscar`
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rotkv.calibrate.corpus import token_chunks  # noqa: E402
from rotkv.calibrate.keybits import _logp, decode_kl  # noqa: E402
from rotkv.eval.attn_error import layer_errors, reference  # noqa: E402
from rotkv.eval.methods import Method  # noqa: E402
from rotkv.eval.stats import mean_ci  # noqa: E402
from rotkv.hf.models import load_model  # noqa: E402
from rotkv.quant import quantizer  # noqa: E402

EXACT = quantizer.clip_rows
MODES = ("rank", "max", "rms", "none")


def _rank_threshold(x: torch.Tensor, ratio: float) -> torch.Tensor:
    k = int(ratio * x.shape[-1])
    return torch.kthvalue(x.abs(), k + 1, dim=-1, keepdim=True).values


def recorder(stats: dict):
    """A clip_rows that clips exactly and records t_rank / max and t_rank / rms per row, per ratio."""
    def clip(x: torch.Tensor, ratio: float) -> torch.Tensor:
        if ratio < 1.0:
            t = _rank_threshold(x, ratio)
            mx = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
            rms = x.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-30)
            s = stats.setdefault(round(ratio, 6), {"max": [], "rms": []})
            s["max"].append((t / mx).flatten()[::7])  # a subsample keeps memory small
            s["rms"].append((t / rms).flatten()[::7])
        return EXACT(x, ratio)
    return clip


def clipper(mode: str, fit: dict):
    def clip(x: torch.Tensor, ratio: float) -> torch.Tensor:
        if ratio >= 1.0 or mode == "rank":
            return EXACT(x, ratio)
        if mode == "none":
            return x
        f = fit[round(ratio, 6)][mode]
        base = x.abs().amax(-1, keepdim=True) if mode == "max" else x.pow(2).mean(-1, keepdim=True).sqrt()
        t = f * base
        return torch.minimum(torch.maximum(x, -t), t)
    return clip


def run_errors(model, method, ids, length, queries, chunk, ref) -> float:
    errs, _ = layer_errors(model, method, ids, length, queries, chunk, ref)
    return sum(errs) / len(errs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--artifact", required=True, help="an OSCAR artifact with clip ratios (rotkv calibrate --method oscar)")
    ap.add_argument("--preset", default="oscar-int2")
    ap.add_argument("--model", default=None)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--windows", type=int, default=6, help="evaluation windows")
    ap.add_argument("--fit-windows", type=int, default=2, help="calibration windows for alpha and beta")
    ap.add_argument("--kl-new", type=int, default=32, help="decoded tokens for the KL (0: no KL)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    loaded = load_model(args.model, device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    n = args.length + args.queries
    method = Method(args.preset, "rotkv", 2.0, {}, args.artifact)
    t0 = time.time()
    # --- fit alpha / beta on calibration text
    stats: dict = {}
    quantizer.clip_rows = recorder(stats)
    try:
        for ids in token_chunks(tok, None, n * args.fit_windows, chunk_len=n, kind="calib"):
            ref = reference(model, ids)
            run_errors(model, method, ids, args.length, args.queries, args.chunk, ref)
    finally:
        quantizer.clip_rows = EXACT
    fit = {r: {m: torch.cat(v[m]).median().item() for m in ("max", "rms")} for r, v in stats.items()}
    print(f"fitted on calibration text ({time.time() - t0:.0f} s): " +
          ", ".join(f"ratio {r}: alpha {f['max']:.3f}, beta {f['rms']:.3f}" for r, f in sorted(fit.items())))
    # --- evaluate every mode on held-out text
    per: dict[str, list[float]] = {m: [] for m in MODES}
    kl: dict[str, list[float]] = {m: [] for m in MODES}
    n_kl = max(n, args.length + args.kl_new)
    for w, ids in enumerate(token_chunks(tok, None, n_kl * args.windows, chunk_len=n_kl, kind="eval")):
        ref = reference(model, ids[:, :n])
        ref_lp = _logp(model, ids[:, :args.length + args.kl_new - 1], keep=args.kl_new) if args.kl_new else None
        for mode in MODES:
            quantizer.clip_rows = clipper(mode, fit)
            try:
                per[mode].append(run_errors(model, method, ids, args.length, args.queries, args.chunk, ref))
                if args.kl_new:
                    kl[mode].append(decode_kl(model, lambda: method.build(model), ids, args.length, args.kl_new,
                                              args.chunk, ref_lp).mean().item())
            finally:
                quantizer.clip_rows = EXACT
        print(f"window {w}: " + ", ".join(f"{m} {per[m][-1]:.4f}" + (f" / KL {kl[m][-1]:.4f}" if kl[m] else "")
                                          for m in MODES), flush=True)
    rows = []
    for mode in MODES:
        mean, half = mean_ci(per[mode])
        dmean, dhalf = mean_ci([a - b for a, b in zip(per[mode], per["rank"])])
        row = dict(mode=mode, attn_error=mean, ci95=half, minus_rank=dmean, minus_rank_ci95=dhalf,
                   windows=len(per[mode]), per_window=per[mode])
        line = (f"{mode:5s} attn-error {mean:.4f} +- {half:.4f}; minus rank {dmean:+.4f} +- {dhalf:.4f}"
                f" (median over windows {statistics.median(per[mode]):.4f})")
        if kl[mode]:
            km, kh = mean_ci(kl[mode])
            dkm, dkh = mean_ci([a - b for a, b in zip(kl[mode], kl["rank"])])
            row.update(kl=km, kl_ci95=kh, kl_minus_rank=dkm, kl_minus_rank_ci95=dkh, kl_per_window=kl[mode])
            line += f"; KL {km:.4f} +- {kh:.4f}, minus rank {dkm:+.4f} +- {dkh:.4f}"
        rows.append(row)
        print(line)
    out = dict(preset=args.preset, artifact=os.path.basename(args.artifact), model=loaded.model_id,
               length=args.length, queries=args.queries, kl_new=args.kl_new, fit=fit, rows=rows, seconds=round(time.time() - t0))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
