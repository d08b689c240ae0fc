"""Does the prefill chunk change accuracy? KL(plain model || cache) of teacher-forced decode after a
context prefilled in chunks of C tokens, for several C on the same windows of held-out text.

A chunk attends to the stored (quantized) cache of the earlier chunks and to its own tokens at tier
precision, so the chunk size changes which context tokens a prefill token sees quantized; what is
scored here are the tokens after the context (decode, reading the stored cache), as in
``rotkv eval``'s nll task (same functions: rotkv.eval.nll). The context is fed in model calls of C
tokens and the cache's ``prefill_chunk`` is C too (one attention step per call).

    OMP_NUM_THREADS=1 python studies/prefill_chunk_kl.py --preset quarot-int2 --length 2048 --chunks 512 4096

Prints and writes (``--out``) per chunk: mean KL, NLL and top-1 agreement with 95% intervals over
the scored tokens, and per chunk after the first the paired difference of per-token KL against the
first chunk (mean and 95% interval; the interval ignores the within-window correlation).
"""

from __future__ import annotations

import argparse
import json

import torch

from rotkv.eval import nll
from rotkv.eval.config import builtin_eval_texts
from rotkv.eval.methods import Method, nominal_bits
from rotkv.eval.run import read_tokens
from rotkv.eval.stats import mean_ci


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--preset", default="quarot-int2")
    ap.add_argument("--artifact", default=None)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--windows", type=int, default=6)
    ap.add_argument("--chunks", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    from rotkv.hf.models import load_model

    loaded = load_model(a.model)
    model, tok = loaded.model, loaded.tokenizer
    ids = torch.tensor(read_tokens(tok, builtin_eval_texts()))[None]
    starts = nll.window_starts(ids.shape[1], a.length, a.new_tokens, a.windows)
    per = {c: {"nll": [], "kl": [], "top1": []} for c in a.chunks}
    for w, s0 in enumerate(starts):
        win = ids[:, s0: s0 + a.length + a.new_tokens]
        ref = nll.reference(model, win, a.length, a.new_tokens)
        for c in a.chunks:
            m = Method(a.preset, "rotkv", nominal_bits(a.preset),
                       {"sink": a.sink, "window": a.window, "prefill_chunk": c}, a.artifact)
            scores, _ = nll.score_window(model, m, win, a.length, a.new_tokens, c, ref)
            for k in per[c]:
                per[c][k] += scores[k]
        print(f"window {w + 1}/{len(starts)}: " + ", ".join(
            f"C={c} KL {sum(per[c]['kl']) / len(per[c]['kl']):.4f}" for c in a.chunks), flush=True)
    out = {"model": loaded.model_id, "preset": a.preset, "length": a.length, "new_tokens": a.new_tokens,
           "windows": len(starts), "sink": a.sink, "window": a.window, "chunks": {}}
    base = a.chunks[0]
    for c in a.chunks:
        row = {}
        for k in ("kl", "nll", "top1"):
            row[k], row[k + "_ci95"] = mean_ci(per[c][k])
        if c != base:
            row["kl_minus_first"], row["kl_minus_first_ci95"] = mean_ci(
                [x - y for x, y in zip(per[c]["kl"], per[base]["kl"])])
        out["chunks"][str(c)] = row
        print(f"C={c}: KL {row['kl']:.4f} +- {row['kl_ci95']:.4f}, NLL {row['nll']:.4f} +- {row['nll_ci95']:.4f}, "
              f"top-1 {row['top1']:.3f}" + (f"; KL - KL(C={base}) = {row['kl_minus_first']:+.4f} +- "
                                             f"{row['kl_minus_first_ci95']:.4f}" if c != base else ""))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
