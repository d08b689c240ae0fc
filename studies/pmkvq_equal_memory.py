"""Equal-memory comparison: a fixed KV budget, a long teacher-forced continuation.

Every method gets the same total KV memory budget (bytes, all layers, sink and window
included): ``--budget-bpe`` mean body bits per element over ``context + continuation`` tokens.

- ``bf16-trunc``: unquantized, keeping the sink and the most recent tokens that fit;
- ``int8``, ``int4``, ``int2`` (fixed width, per rotation): the same eviction when over budget;
- ``pmkvq`` (per rotation): a 16-bit body shrinking to the artifact's per-layer final widths.

All methods run in lockstep on the same chunks; each chunk's logits are scored against the
next tokens (NLL) and against an exact fp32 cache without a budget (KL(ref || method)).
Writes a JSON with the totals and, per chunk, each method's bytes, stored tokens and widths.

    python studies/pmkvq_equal_memory.py --context 1024 --continuation 6144 \\
        --artifact identity=pm_identity.safetensors --artifact oscar=pm_oscar.safetensors \\
        --out studies/results/pmkvq/pmkvq_equal_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from rotkv.cache import make_cache
from rotkv.cache.progressive import layer_budget
from rotkv.calibrate.corpus import token_chunks
from rotkv.config import CacheSpec
from rotkv.hf.compat import cache_kwarg
from rotkv.hf.geometry import model_geometry
from rotkv.hf.models import load_model
from rotkv.rotations.artifact import load_artifact


def common(args) -> dict:
    return dict(group_size=args.group_size, sink=args.sink, window=args.window, page_size=args.page_size,
                prefill_chunk=args.prefill_chunk)


def budget_tokens_for(spec: CacheSpec, bits: int | None, target: int, layers: int, h: int, d: int) -> int:
    """The largest budget_tokens whose budget over all layers at width ``bits`` is <= target bytes."""
    lo, hi = 1, 1 << 20
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if layers * layer_budget(spec.replace(budget_tokens=mid), bits, h, d, 2) <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


def target_bytes(args, layers: int, h: int, d: int) -> int:
    """Budget of every layer holding all tokens with a body of ``budget_bpe`` bits per element."""
    n = args.context + args.continuation
    tiers = min(n, args.sink + args.window + args.page_size - 1)
    return layers * (tiers * 2 * h * d * 2 + int((n - tiers) * 2 * h * d * args.budget_bpe / 8))


def build_methods(args, model, layers, h, d) -> dict:
    base = common(args)
    target = target_bytes(args, layers, h, d)
    n = args.context + args.continuation
    out = {}
    trunc = CacheSpec(name="bf16-trunc", bits=None, rotation="identity", rotate_values=False, **base)
    out["bf16-trunc"] = (trunc.replace(budget_tokens=budget_tokens_for(trunc.replace(budget_tokens=1), None, target, layers, h, d)), None)
    for label, path in args.artifact:
        art = load_artifact(path)
        rotation = "identity" if art.meta.get("pmkvq_rotation") == "identity" else (
            "hadamard" if art.meta.get("pmkvq_rotation") == "hadamard" else "artifact")
        rot = dict(rotation=rotation, clip_k=args.clip_k if rotation == "artifact" else 1.0,
                   clip_v=args.clip_v if rotation == "artifact" else 1.0, key_mean=rotation == "artifact")
        art_arg = path if rotation == "artifact" else None
        for b in args.fixed:
            s = CacheSpec(name=f"{label}-int{b}", bits=b, **base, **rot)
            out[s.name] = (s.replace(budget_tokens=budget_tokens_for(s.replace(budget_tokens=1), b, target, layers, h, d)), art_arg)
        pm = CacheSpec(name=f"{label}-pmkvq", bits=2, start_bits=16, budget_tokens=n, **base, **rot)
        out[pm.name] = (pm, path)
        if args.shift_ablation:  # anchor=start (fp32 metadata, a larger budget), the same for all three
            for shift in ("equivalent", "rounded", "plain"):
                out[f"{pm.name}-start-{shift}"] = (pm.replace(anchor="start", shift=shift), path)
    return {k: v for k, v in out.items() if k not in args.skip}, target


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model, device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    layers, h, d = model_geometry(model.config)
    n = args.context + args.continuation
    files = args.data or None
    ids = torch.cat(token_chunks(tok, files, n, chunk_len=n, kind="eval"), 1)[:, :n]
    if ids.shape[1] < n:
        raise ValueError(f"the evaluation text has only {ids.shape[1]} tokens, {n} needed")
    methods, target = build_methods(args, model, layers, h, d)
    ref = make_cache(model, CacheSpec(name="ref", bits=None, tier_dtype="float32", rotation="identity",
                                      rotate_values=False, **common(args)))
    caches = {name: make_cache(model, spec, art) for name, (spec, art) in methods.items()}
    kw = cache_kwarg(model)
    res = {name: {"nll": 0.0, "kl": 0.0, "seconds": 0.0, "trace": [], "budget_bytes": sum(
        getattr(l, "budget", 0) for l in c.layers), "budget_tokens": methods[name][0].budget_tokens}
        for name, c in caches.items()}
    scored = 0
    with torch.no_grad():
        model(input_ids=ids[:, : args.context], **{kw: ref})
        for name, c in caches.items():
            t0 = time.time()
            model(input_ids=ids[:, : args.context], **{kw: c})
            res[name]["seconds"] += time.time() - t0
        for i in range(args.context, n - 1, args.chunk):
            j = min(i + args.chunk, n - 1)
            x, y = ids[:, i:j], ids[0, i + 1 : j + 1]
            lp_ref = torch.log_softmax(model(input_ids=x, **{kw: ref}).logits[0].float(), -1)
            for name, c in caches.items():
                t0 = time.time()
                lp = torch.log_softmax(model(input_ids=x, **{kw: c}).logits[0].float(), -1)
                res[name]["seconds"] += time.time() - t0
                res[name]["nll"] += float(-lp.gather(-1, y[:, None]).sum())
                res[name]["kl"] += float((lp_ref.exp() * (lp_ref - lp)).sum())
                st = c.stats()
                res[name]["trace"].append({"context": j, "kv_bytes": st["kv_bytes"], "stored_tokens": c.layers[0].rows[0].length,
                                           "widths": sorted(set(w for w in getattr(c, "widths", lambda: [])() if w))})
            res.setdefault("ref", {"nll": 0.0})["nll"] += float(-lp_ref.gather(-1, y[:, None]).sum())
            scored += j - i
            if args.progress:
                print(f"{j}/{n}: " + ", ".join(f"{k} {v['nll'] / scored:.3f}" for k, v in res.items()), flush=True)
    elements = lambda t: 2 * layers * h * d * t  # noqa: E731
    for name, r in res.items():
        r["nll"] /= scored
        if name == "ref":
            continue
        r["kl"] /= scored
        for t in r["trace"]:
            t["bits_per_context_element"] = 8 * t["kv_bytes"] / elements(t["context"])
        r["final_bpe"] = r["trace"][-1]["bits_per_context_element"]
        r["peak_kv_bytes"] = max(t["kv_bytes"] for t in r["trace"])
    return {"config": vars(args) | {"artifact": args.artifact, "target_bytes": target, "scored_tokens": scored,
                                    "model": loaded.model_id}, "results": res}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--data", nargs="+", default=None, help="evaluation text files (default: rotkv/data/eval_*.txt)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--continuation", type=int, default=6144)
    p.add_argument("--chunk", type=int, default=64, help="teacher-forced tokens per forward")
    p.add_argument("--budget-bpe", type=float, default=3.5, help="mean body bits per element the budget allows")
    p.add_argument("--artifact", nargs=2, action="append", metavar=("LABEL", "FILE"), default=[],
                   help="a pmkvq artifact (widths; rotations if it has them); repeat per rotation")
    p.add_argument("--fixed", type=int, nargs="*", default=[8, 4, 2])
    p.add_argument("--shift-ablation", action="store_true",
                   help="also progressive with anchor=start and each shift (equivalent, rounded, plain)")
    p.add_argument("--skip", nargs="*", default=[], help="method names to leave out (e.g. oscar-int8)")
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--sink", type=int, default=16)
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--clip-k", type=float, default=0.96)
    p.add_argument("--clip-v", type=float, default=0.92)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    t0 = time.time()
    out = run(args)
    out["config"]["wall_seconds"] = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    for name, r in out["results"].items():
        extra = "" if name == "ref" else f" KL {r['kl']:.4f} final bpe {r['final_bpe']:.2f} ({r['seconds']:.0f} s)"
        print(f"{name:>18}: NLL {r['nll']:.4f}{extra}")


if __name__ == "__main__":
    main()
