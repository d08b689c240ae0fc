"""The held-out calibration table (docs/results/calibration.md) and the mixing-support curve: a study
that runs the calibration pieces and the evaluation's decode KL (rotkv.calibrate never imports
rotkv.eval, so the study joins them here).

One capture of the calibration corpus feeds every row's fit (OSCAR in each C_S form, pairwise,
block-Hadamard, key means, clip search on the held-out calibration chunks, OptR); one capture of
the *evaluation* text (``rotkv/data/eval_*.txt``) gives each layer's fp32 q, k, v, on which every
row's attention-output error after W_O is measured (layer-local, averaged over layers). The
decode-regime KL runs the real cache (RotkvCache) at 2K context, chunked prefill, sink 16, window 64.

    python studies/calibration_table.py --out docs/results/calibration.md
"""

from __future__ import annotations

import argparse
import sys
import json
import os
import tempfile
import time

import torch
from tqdm.auto import tqdm

from rotkv.calibrate import clip
from rotkv.calibrate.corpus import token_chunks
from rotkv.calibrate.error import output_error
from rotkv.calibrate.run import collect
from rotkv.calibrate.stats import weighted_cs
from rotkv.hf.fingerprint import model_meta
from rotkv.hf.geometry import attention_modules, model_geometry
from rotkv.hf.models import load_model
from rotkv.rotations import optr, oscar, pairwise
from rotkv.rotations.artifact import save_artifact
from rotkv.rotations.base import LayerRotation
from rotkv.rotations.hadamard import hadamard_matrix


def _rot(h, m):
    return None if m is None else m.expand(h, *m.shape[-2:]).contiguous()


def fit_rows(rec, head_dim: int, blocks: list[int]) -> dict[str, list[tuple]]:
    """Per row name, per layer ``(R_K, R_V)`` ``[H, D, D]`` (None = identity)."""
    rows: dict[str, list[tuple]] = {}
    had = hadamard_matrix(head_dim)
    for st in rec.layers:
        h = st.cq.shape[0]
        cand = {
            "identity": (None, None),
            "hadamard": (_rot(h, had), _rot(h, had)),
            "pairwise": (pairwise.pair_matrix(pairwise.pair_angles(st.ck)),
                         pairwise.pair_matrix(pairwise.pair_angles(st.cv))),
        }
        for b in blocks:
            bh = _rot(h, pairwise.block_hadamard(head_dim, b))
            cand[f"block-hadamard-{b}"] = (bh, bh)
        rk = oscar.oscar_rotation(oscar.pooled(st.cq, "layer"))
        for form, cv in (("exact", st.cs), ("weighted", weighted_cs(st)), ("diag", st.cdiag)):
            cand[f"oscar-{form}"] = (rk, oscar.oscar_rotation(oscar.pooled(cv, "layer")))
        cand["oscar-exact-kvhead"] = (oscar.oscar_rotation(st.cq), oscar.oscar_rotation(st.cs))
        for name, v in cand.items():
            rows.setdefault(name, []).append(v)
    return rows


def evaluate_row(rec, ev, attn, rots, mean: bool, bits: int, group: int, sink: int, search: bool, grid=clip.GRID):
    """Per layer: clip search on the held-out calibration chunks, then eval errors (K only, V only, both)."""
    out = {"k": [], "v": [], "kv": [], "clip_k": [], "clip_v": []}
    for l, (st, est) in enumerate(zip(rec.layers[: len(rots)], ev.layers)):
        r = LayerRotation(rots[l][0], rots[l][1], st.k_mean if mean else None)
        w_o = attn[l].o_proj.weight.detach().float()
        sc = float(attn[l].scaling)
        held = list(st.samples.values())
        ck, cv = clip.search_layer(held, r, w_o, bits, group, sink, sc, grid) if search else (1.0, 1.0)
        samples = list(est.samples.values())
        for key, qk, qv in (("k", True, False), ("v", False, True), ("kv", True, True)):
            out[key].append(output_error(samples, r, w_o, bits, group, ck, cv, sink, sc, qk, qv))
        out["clip_k"].append(ck)
        out["clip_v"].append(cv)
    return out


def train_optr(rec, attn, base_rows, bits, group, sink, steps, heldout_ids, train_ids, grid, n_queries):
    """OptR+mean per KV head from the OSCAR (exact, per KV head) base; returns per-layer (R_K, R_V), info."""
    rots, infos = [], []
    for l, st in enumerate(tqdm(rec.layers[: len(base_rows)], desc="optr")):
        r_k, r_v = base_rows[l]
        w_o = attn[l].o_proj.weight.detach().float()
        sc = float(attn[l].scaling)
        held = [st.samples[i] for i in heldout_ids]
        tr = [st.samples[i] for i in train_ids]
        ck, cv = clip.search_layer(held, LayerRotation(r_k, r_v, st.k_mean), w_o, bits, group, sink, sc, grid)
        nk, nv, info = optr.optimize_layer(tr, held, r_k, r_v, st.k_mean, w_o, bits, group, ck, cv, sink, sc, steps=steps,
                                           n_queries=n_queries, eval_every=max(1, steps // 4))
        rots.append((nk, nv))
        infos.append(info)
    return rots, infos


def write_row_artifacts(loaded, rows_for_kl, rec, clips, directory: str) -> dict[str, tuple[str, bool]]:
    """One artifact per row (rotations, key means, clip ratios); returns name -> (path, key_mean)."""
    model = loaded.model
    meta = model_meta(model, loaded.model_id)
    d = model_geometry(model.config)[2]
    os.makedirs(directory, exist_ok=True)
    paths = {}
    for name, (rots, mean) in rows_for_kl.items():
        tensors = {}
        for l, (rk, rv) in enumerate(rots):
            eye = torch.eye(d).expand(rec.layers[l].cq.shape[0], d, d)
            tensors[f"R_K.{l}"] = eye if rk is None else rk
            tensors[f"R_V.{l}"] = eye if rv is None else rv
            tensors[f"k_mean.{l}"] = rec.layers[l].k_mean
        tensors["clip_k"] = torch.tensor(clips[name][0])
        tensors["clip_v"] = torch.tensor(clips[name][1])
        path = os.path.join(directory, f"{name}.safetensors")
        save_artifact(path, tensors, {**meta, "method": f"table:{name}", "bits": 2, "values_folded": "0",
                                      "clip_k": ",".join(f"{c:g}" for c in clips[name][0]),
                                      "clip_v": ",".join(f"{c:g}" for c in clips[name][1])})
        paths[name] = (path, mean)
    return paths


def decode_kl(model, ids, paths, sink, window, length, new_tokens, chunk):
    """KL(fp || cache) per row in the decode regime via rotkv.eval.nll (RotkvCache), and measured bits/element."""
    from rotkv.cache import RotkvCache
    from rotkv.config import CacheSpec
    from rotkv.eval import nll

    ref = nll.reference(model, ids, length, new_tokens)
    res = {}
    for name, (path, mean) in tqdm(paths.items(), desc="decode KL"):
        spec = CacheSpec(name=name, bits=2, group_size=64, sink=sink, window=window, prefill_chunk=chunk,
                         rotation="artifact", key_mean=mean)

        class M:  # the small interface rotkv.eval.nll expects
            def build(self, model, context_length=None):
                return RotkvCache(model, spec, path, context_length=context_length)

            def measure(self, cache, model):
                return cache.stats()

        scores, mem = nll.score_window(model, M(), ids, length, new_tokens, chunk, ref)
        res[name] = {"kl": sum(scores["kl"]) / len(scores["kl"]), "top1": sum(scores["top1"]) / len(scores["top1"]),
                     "bpe": mem["bits_per_element"], "body_bpe": mem["body_bits_per_element"]}
    return res


def run_kl(loaded, paths, out, a) -> None:
    ids = token_chunks(loaded.tokenizer, None, 10**9, a.kl_length + a.kl_new, kind="eval")[0]
    t0 = time.perf_counter()
    out["kl"] = decode_kl(loaded.model, ids, paths, 16, 64, a.kl_length, a.kl_new, 256)
    out["times_s"]["decode_kl"] = time.perf_counter() - t0
    write(out, a)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--eval-tokens", type=int, default=1024)
    ap.add_argument("--optr-steps", type=int, default=80)
    ap.add_argument("--kl-length", type=int, default=2048)
    ap.add_argument("--kl-new", type=int, default=32)
    ap.add_argument("--no-kl", action="store_true")
    ap.add_argument("--kl-rows", default="identity,hadamard,pairwise,oscar-exact,oscar-exact+mean,optr+mean")
    ap.add_argument("--layers", type=int, default=None, help="fit and evaluate only the first N layers (smoke runs)")
    ap.add_argument("--heldout-chunks", type=int, default=1)
    ap.add_argument("--rows", default="identity,hadamard,pairwise,block-hadamard-8,oscar-exact,oscar-weighted,oscar-diag,"
                    "hadamard+mean,oscar-exact+mean,oscar-diag+mean", help="table rows besides optr+mean")
    ap.add_argument("--optr-train", type=int, default=2, help="512-token chunks OptR trains on")
    ap.add_argument("--optr-queries", type=int, default=64, help="query rows per chunk in the OptR loss")
    ap.add_argument("--grid", default="1,0.96,0.92,0.88,0.84", help="clip-ratio grid")
    ap.add_argument("--artifact-dir", default="/tmp/rotkv_table", help="where each KL row's artifact is written")
    ap.add_argument("--kl-only", action="store_true", help="only the decode KL, from --json's artifacts")
    ap.add_argument("--out", default="docs/results/calibration.md")
    ap.add_argument("--json", default="docs/results/calibration.json")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    loaded = load_model(device="cpu")
    if a.kl_only:  # rerun the decode KL from the artifacts a previous run left
        with open(a.json) as f:
            out = json.load(f)
        paths = {k: (p, k.endswith("+mean")) for k, p in out["artifacts"].items() if k in a.kl_rows.split(",")}
        run_kl(loaded, paths, out, a)
        return 0
    model = loaded.model
    layers, kv_heads, d = model_geometry(model.config)
    bits, group, sink = 2, min(64, d), 16
    chunks = token_chunks(loaded.tokenizer, None, a.tokens, 512)
    n = len(chunks)
    held_ids, train_ids = list(range(n - a.heldout_chunks, n)), list(range(a.optr_train))
    grid = tuple(float(x) for x in a.grid.split(","))
    t0 = time.perf_counter()
    rec = collect(model, chunks, sink, keep=set(held_ids) | set(train_ids), keep_kv=True, heldout=set(held_ids), desc="capture calib")
    capture_s = time.perf_counter() - t0
    echunks = token_chunks(loaded.tokenizer, None, a.eval_tokens, 512, kind="eval")
    ev = collect(model, echunks, sink, keep=set(range(len(echunks))), keep_kv=False, desc="capture eval")
    for st in rec.layers:  # OptR's train chunks stay in rec for training; clip search uses held-out only
        st.samples = {i: s for i, s in st.samples.items()}
    attn = attention_modules(model)
    blocks = [b for b in (2, 4, 8, 16, 32) if b < d]
    t0 = time.perf_counter()
    rows = fit_rows(_Limit(rec, a.layers), d, blocks)
    fit_s = time.perf_counter() - t0
    held_only = _HeldView(rec, held_ids)
    results, clips = {}, {}
    plan = [(r.split("+")[0], r.endswith("+mean")) for r in a.rows.split(",")]
    for name, mean in tqdm(plan, desc="rows"):
        key = name + ("+mean" if mean else "")
        results[key] = evaluate_row(held_only, ev, attn, rows[name], mean, bits, group, sink, True, grid)
        clips[key] = (results[key]["clip_k"], results[key]["clip_v"])
    out = {"results": results, "curve": {}, "kl": {}, "optr_info": [], "times_s": {"capture": capture_s, "fit_oscar_etc": fit_s},
           "threads": torch.get_num_threads(), "calib_tokens": a.tokens, "eval_tokens": a.eval_tokens,
           "command": "python studies/calibration_table.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "args": vars(a)}
    write(out, a)  # before OptR, the slow part
    t0 = time.perf_counter()
    rows["optr"], infos = train_optr(rec, attn, rows["oscar-exact-kvhead"], bits, group, sink, a.optr_steps, held_ids, train_ids,
                                     grid, a.optr_queries)
    optr_s = time.perf_counter() - t0
    results["optr+mean"] = evaluate_row(held_only, ev, attn, rows["optr"], True, bits, group, sink, True, grid)
    clips["optr+mean"] = (results["optr+mean"]["clip_k"], results["optr+mean"]["clip_v"])
    # mixing-support curve: no clipping, no mean, INT4 and INT2, on the first evaluation chunk
    ev1 = _HeldView(ev, [0])
    curve = {}
    for b in [1] + blocks + [d]:
        name = {1: "identity", d: "hadamard"}.get(b, f"block-hadamard-{b}")
        curve[b] = {f"int{q}": evaluate_row(held_only, ev1, attn, rows[name], False, q, group, sink, False)["kv"] for q in (4, 2)}
    curve["pairwise"] = {f"int{q}": evaluate_row(held_only, ev1, attn, rows["pairwise"], False, q, group, sink, False)["kv"] for q in (4, 2)}
    out = {"results": results, "curve": {str(k): v for k, v in curve.items()}, "kl": {}, "optr_info": infos,
           "times_s": {"capture": capture_s, "fit_oscar_etc": fit_s, "optr": optr_s, "total": time.perf_counter() - t_start},
           "threads": torch.get_num_threads(), "calib_tokens": a.tokens, "eval_tokens": a.eval_tokens,
           "command": "python studies/calibration_table.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "args": vars(a)}
    write(out, a)  # the layer-level table first; the decode KL (slow) is added when it is done
    if not a.layers:
        kl_rows = {k: (rows[k.split("+")[0]], k.endswith("+mean")) for k in a.kl_rows.split(",")}
        paths = write_row_artifacts(loaded, kl_rows, rec, clips, a.artifact_dir)
        out["artifacts"] = {k: v[0] for k, v in paths.items()}
        write(out, a)
        if not a.no_kl:
            run_kl(loaded, paths, out, a)
    return 0


def write(out, a) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    with open(a.out, "w") as f:
        f.write(render(out, a))
    print(render(out, a), flush=True)


class _Limit:
    def __init__(self, rec, n):
        self.layers = rec.layers[:n] if n else rec.layers


class _HeldView:
    """The calibration stats with only the held-out chunks as samples (for clip search)."""

    def __init__(self, rec, held_ids):
        self.layers = [_LayerView(st, held_ids) for st in rec.layers]


class _LayerView:
    def __init__(self, st, held_ids):
        self.k_mean = getattr(st, "k_mean", None)
        self.samples = {i: st.samples[i] for i in held_ids}


def _avg(xs):
    return sum(xs) / len(xs)


def render(out, _a=None) -> str:
    res, kl = out["results"], out["kl"]
    a = argparse.Namespace(**out["args"])
    lines = ["# Calibration: held-out results on SmolLM2-135M-Instruct (INT2, G=64)", "",
             f"Reproduce: `{out['command']}` "
             f"(calibration {out['calib_tokens']} tokens of `rotkv/data/calib_*.txt`, the last {a.heldout_chunks} 512-token chunk(s) held out for clip search "
             f"(grid {a.grid}) and OptR early stopping, OptR trained on {a.optr_train} chunk(s), {a.optr_steps} steps, "
             f"{a.optr_queries} query rows per chunk; errors on {out['eval_tokens']} tokens of `rotkv/data/eval_*.txt`).", "",
             "Attention-output error after W_O: per layer `||(o_hat - o) W_O^T||^2 / ||o W_O^T||^2` on fp32 post-RoPE "
             "q/k/v of the evaluation text (first 16 tokens of each 512-token chunk unquantized, the rest INT2 fake-quantized "
             "with the row's rotation and searched clip ratios), averaged over the 30 layers. "
             "Decode KL: `rotkv.eval.nll` with RotkvCache, 2K context prefilled in 256-token chunks, sink 16, window 64, "
             f"then {a.kl_new} teacher-forced decode steps, KL(fp32 || cache) of the next-token distribution; "
             "bits/element measured by the cache (all tiers and metadata).", "",
             "| row | err K only | err V only | err K+V | mean c_K | mean c_V | decode KL @2K | top-1 agree | bits/elem |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in res.items():
        k = kl.get(name, {})
        lines.append(f"| {name} | {_avg(r['k']):.4f} | {_avg(r['v']):.4f} | {_avg(r['kv']):.4f} | {_avg(r['clip_k']):.3f} | "
                     f"{_avg(r['clip_v']):.3f} | {k['kl']:.4f} | {k['top1']:.3f} | {k['bpe']:.3f} |" if k else
                     f"| {name} | {_avg(r['k']):.4f} | {_avg(r['v']):.4f} | {_avg(r['kv']):.4f} | {_avg(r['clip_k']):.3f} | "
                     f"{_avg(r['clip_v']):.3f} | - | - | - |")
    if not out["curve"]:
        return "\n".join(lines)
    lines += ["", "## Mixing support (block-Hadamard of size b, post-RoPE; no clipping, no mean)", "",
              "| b | err K+V INT4 | err K+V INT2 |", "|---|---|---|"]
    for b, v in out["curve"].items():
        lines.append(f"| {b} | {_avg(v['int4']):.5f} | {_avg(v['int2']):.4f} |")
    t = out["times_s"]
    lines += ["", f"Times ({out['threads']} threads, shared machine): capture {t['capture']:.0f} s, "
              f"OSCAR/pairwise fits {t['fit_oscar_etc']:.1f} s, OptR {t['optr']:.0f} s, total {t['total']:.0f} s"
              + (f", decode KL {t['decode_kl']:.0f} s" if "decode_kl" in t else "") + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
