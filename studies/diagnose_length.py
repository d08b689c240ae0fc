"""Why the INT2 error grows with context: attention-output error at 2K, 4K, 8K, split.

For each window of held-out text (``rotkv/data/eval_*.txt``) and context length L, the plain fp32 model
prefills L tokens (a DynamicCache, no quantization) and then runs N teacher-forced tokens through rotkv's
capture attention, which records every layer's post-RoPE decode queries ``[Hq, N, D]`` and all keys and
values ``[H, L + N, D]``. These are cached under ``--scratch``; everything after is offline arithmetic:

Each layer's cache is emulated exactly as rotkv stores it (the artifact's key mean and rotations, the
preset's per-layer key width, clip ratio and metadata dtype, the same codec): decode query t (position
L + t) reads a bf16 sink of S tokens, a bf16 window holding the last W..W+P-1 tokens (pages of P leave it),
and the quantized body in between. Per layer, the relative error of the attention output after W_O,
``||O_q - O_ref|| / ||O_ref||`` over the N queries, with every layer fed its own reference q, k, v (no drift),
as ``rotkv eval --tasks attn-error`` does. Splits (``--exp``):

- ``kv``: both K and V quantized, K only, V only;
- ``buckets``: only the keys (K-only) in one bucket of query distance quantized, the rest exact;
- ``tiers``: the bf16 tiers sized to the share they have at 2K (``--share-of``) instead of fixed S, W;
- ``stats``: attention mass on sink / body / window, the effective number of attended body tokens
  (exp of the entropy of the body-restricted attention), and the per-key logit error of the quantized
  keys, ``(q' . (k'_hat - k')) * scaling``, attention-weighted and uniform, by query-distance bucket;
- ``rot``: the same errors with a second artifact's rotations (``--alt-artifact``, e.g. one fitted on
  4K-token chunks) to tell whether the short-text fit is what degrades at long range.

Usage:
  python studies/diagnose_length.py --artifact A/oscar-mix.safetensors --lengths 2048 4096 8192 \
      --windows 2 --new-tokens 32 --out docs/results/diagnosis_length/length.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import sys

import torch

from rotkv.cache.codecs import make_codecs
from rotkv.cache.widths import resolve_widths
from rotkv.config import get_preset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

BUCKETS = (0, 64, 256, 1024, 2048, 4096, 8192, 1 << 30)  # query-distance bucket edges (tokens)


def bucket_names():
    return [f"{a}-{b}" if b < 1 << 30 else f"{a}+" for a, b in zip(BUCKETS[:-1], BUCKETS[1:])]


# ---- capture -------------------------------------------------------------------------------------
@torch.inference_mode()
def capture(model, ids: torch.Tensor, length: int, chunk: int = 2048) -> list[dict]:
    """Per layer: q ``[Hq, N, D]`` of the N decode positions, k, v ``[H, L + N, D]`` (post-RoPE, fp32)."""
    from transformers import DynamicCache

    from rotkv.calibrate.capture import capturing

    cache = DynamicCache()
    for c0 in range(0, length, chunk):
        model(input_ids=ids[:, c0:min(c0 + chunk, length)], past_key_values=cache, use_cache=True, logits_to_keep=1)
    out: dict[int, dict] = {}

    def rec(layer, q, k, v, o, probs):
        out[layer] = {"q": q[0].float().clone(), "k": k[0].float().clone(), "v": v[0].float().clone()}

    with capturing(model, rec):
        model(input_ids=ids[:, length:], past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [out[i] for i in sorted(out)]


# ---- the emulated cache --------------------------------------------------------------------------
def body_mask(length: int, n: int, total: int, sink: int, window: int, page: int) -> torch.Tensor:
    """bool ``[N, total]``: keys of decode query t (position length + t) that sit in the quantized body."""
    m = torch.zeros(n, total, dtype=torch.bool)
    for t in range(n):
        seen = length + t + 1
        body = max(0, seen - sink - window) // page * page
        m[t, sink:sink + body] = True
    return m


class LayerQuant:
    """One layer's stored-basis transform and codecs, as rotkv's cache does it."""

    def __init__(self, spec, rotation, head_dim: int, key_bits: int):
        g = spec.resolved_group(head_dim)
        ck = rotation.clip_k if rotation.clip_k is not None else spec.clip_k
        cv = rotation.clip_v if rotation.clip_v is not None else spec.clip_v
        self.kc, self.vc = make_codecs(spec.codec, spec.bits, g, ck, cv, key_bits, spec.meta_k, spec.meta_v)
        self.rot = rotation

    def roundtrip(self, codec, x: torch.Tensor, start: int = 0, page: int = 16) -> torch.Tensor:
        """``x [H, T, D]`` through the codec in pages of ``page`` tokens from ``start`` (the body's first token);
        tokens before ``start`` and a last partial page are returned unchanged (they are never body tokens)."""
        h, t, d = x.shape
        n = (t - start) // page
        out = x.clone()
        if n > 0:
            pages = x[:, start:start + n * page].reshape(h, n, page, d).transpose(0, 1)  # [nb, H, P, D]
            y = codec.decode(codec.encode(pages)).transpose(0, 1).reshape(h, n * page, d)
            out[:, start:start + n * page] = y
        return out


def attend(q, k, v, mask_body, kq, vq, scaling, quant_k: torch.Tensor | None, n_rep: int):
    """Attention outputs ``[Hq, N, D]`` (stored value basis) with ``quant_k`` [N, T] selecting which keys read the
    quantized copy (``kq``) and ``mask_body`` which values do; causal over the last N keys."""
    hq, n, d = q.shape
    t = k.shape[1]
    kx, kqx = k.repeat_interleave(n_rep, 0), kq.repeat_interleave(n_rep, 0)
    vx, vqx = v.repeat_interleave(n_rep, 0), vq.repeat_interleave(n_rep, 0)
    s_ref = (q @ kx.transpose(-1, -2)) * scaling  # [Hq, N, T]
    s_q = (q @ kqx.transpose(-1, -2)) * scaling
    s = torch.where(quant_k[None], s_q, s_ref)
    causal = torch.ones(n, t, dtype=torch.bool).tril(t - n)
    s = s.masked_fill(~causal[None], float("-inf"))
    p = torch.softmax(s, -1)
    return p @ vx + (p * mask_body[None]) @ (vqx - vx), p, s_ref, s_q


def layer_outputs(o_stored: torch.Tensor, rot, w_o: torch.Tensor) -> torch.Tensor:
    """``[Hq, N, D]`` in the stored value basis -> ``[N, hidden]`` after R_V^T and W_O."""
    o = rot.outputs(o_stored[None])[0]  # [Hq, N, D]
    hq, n, d = o.shape
    return o.permute(1, 0, 2).reshape(n, hq * d) @ w_o.T


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm())


def analyse_layer(cap: dict, lq: LayerQuant, w_o, scaling, length, n, sink, window, page, exps, share_window=None):
    q = lq.rot.queries(cap["q"][None])[0]
    k, v = lq.rot.keys(cap["k"][None])[0], lq.rot.values(cap["v"][None])[0]
    kq, vq = lq.roundtrip(lq.kc, k, sink, page), lq.roundtrip(lq.vc, v, sink, page)
    hq, h = q.shape[0], k.shape[0]
    n_rep, total = hq // h, k.shape[1]
    bm = body_mask(length, n, total, sink, window, page)
    none = torch.zeros_like(bm)
    ref, p_ref, s_ref, _ = attend(q, k, v, none, k, v, scaling, none, n_rep)
    s_q = (q @ kq.repeat_interleave(n_rep, 0).transpose(-1, -2)) * scaling  # every key read quantized
    o_ref = layer_outputs(ref, lq.rot, w_o)
    res: dict = {}

    def err(qk, qv_mask):
        o, *_ = attend(q, k, v, qv_mask, kq, vq, scaling, qk, n_rep)
        return rel(layer_outputs(o, lq.rot, w_o), o_ref)

    if "kv" in exps:
        res["both"], res["k_only"], res["v_only"] = err(bm, bm), err(bm, none), err(none, bm)
    if "policy" in exps:  # deployable policies for the recent body: a larger bf16 window, or 4-bit recent keys
        for w2 in (64, 128):
            bm2 = body_mask(length, n, total, sink, w2, page)
            res[f"both_window{w2}"] = err(bm2, bm2)
        from rotkv.cache.codecs import TokenCodec
        kc4 = TokenCodec(4, lq.kc.group_size, 1.0, getattr(lq.kc, "meta", None))
        k4 = lq.roundtrip(kc4, k, sink, page)
        qpos_ = torch.arange(length, length + n)[:, None]
        dist_ = qpos_ - torch.arange(total)[None]
        for r in (128, 256, 512):
            recent = bm & (dist_ < r)
            o, *_ = attend(q, k, v, bm, torch.where(recent.any(0)[None, :, None], k4, kq), vq, scaling, bm, n_rep)
            res[f"both_recent4_{r}"] = rel(layer_outputs(o, lq.rot, w_o), o_ref)
    if "tiers" in exps and share_window is not None:
        bm2 = body_mask(length, n, total, sink, share_window, page)
        res["both_share"], res["k_only_share"] = err(bm2, bm2), err(bm2, none)
    qpos = torch.arange(length, length + n)[:, None]
    dist = qpos - torch.arange(total)[None]  # [N, T]
    if "buckets" in exps:
        for name, a, b in zip(bucket_names(), BUCKETS[:-1], BUCKETS[1:]):
            sel = bm & (dist >= a) & (dist < b)
            if sel.any():
                res[f"k_bucket_{name}"] = err(sel, none)
        half = length // 2
        for name, lo, hi in (("early", 0, half), ("late", half, total)):
            sel = bm.clone()
            sel[:, :lo] = False
            sel[:, hi:] = False
            res[f"k_{name}_body"] = err(sel, none)
    if "stats" in exps:
        p = p_ref.reshape(h, n_rep, n, total).sum(1) / n_rep  # per KV head, mean over its query heads [H, N, T]
        sinkm = p[..., :sink].sum(-1)
        bodym = (p * bm[None]).sum(-1)
        res["mass_sink"], res["mass_body"] = float(sinkm.mean()), float(bodym.mean())
        res["mass_window"] = float((1 - sinkm - bodym).mean())
        pb = p * bm[None] / bodym.clamp_min(1e-12)[..., None]
        ent = -(pb * pb.clamp_min(1e-30).log()).sum(-1)
        res["eff_body_tokens"] = float(ent.exp().mean())
        res["body_tokens"] = float(bm.sum(1).float().mean())
        delta = (s_q - s_ref).reshape(h, n_rep, n, total)  # logit error of every key, per query head
        pr = p_ref.reshape(h, n_rep, n, total)
        for name, a, b in zip(bucket_names(), BUCKETS[:-1], BUCKETS[1:]):
            sel = (bm & (dist >= a) & (dist < b))[None, None]
            if not sel.any():
                continue
            d2 = delta.pow(2) * sel
            res[f"logit_mse_{name}"] = float(d2.sum() / (sel.sum() * h * n_rep))
            res[f"mass_{name}"] = float((pr * sel).sum() / (h * n_rep * n))
        # uniform per-key squared logit error over the body, and the share of the logit variance it is
        body = bm[None, None].expand_as(delta)
        res["logit_mse_body"] = float(delta.pow(2)[body].mean())
        sr = s_ref.reshape(h, n_rep, n, total)
        mu = (sr * body).sum(-1, keepdim=True) / body.sum(-1, keepdim=True)
        res["logit_var_body"] = float((((sr - mu) ** 2) * body).sum() / body.sum())
        # per key position: is a key far from the calibration's positions (> 512) quantized worse?
        kerr = (kq - k).pow(2).sum(-1) / k.pow(2).sum(-1).clamp_min(1e-12)  # [H, T] relative key MSE
        for name, lo, hi in (("pos0-512", sink, 512), ("pos512-2048", 512, 2048), ("pos2048-4096", 2048, 4096),
                             ("pos4096+", 4096, length)):
            if hi > lo and lo < length:
                res[f"key_relmse_{name}"] = float(kerr[:, lo:min(hi, length)].mean())
                res[f"logit_mse_{name}"] = float(delta[..., lo:min(hi, length)].pow(2).mean())
    return res


def merge(a: dict, b: dict) -> dict:
    """``a`` updated by ``b`` recursively (dicts merged, other values from ``b``)."""
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="oscar-mix")
    ap.add_argument("--artifact", default=None)
    ap.add_argument("--alt-artifact", default=None, help="a second artifact for the `rot` experiment")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--sink", type=int, default=None, help="default: the preset's")
    ap.add_argument("--window", type=int, default=None, help="default: the preset's")
    ap.add_argument("--share-of", type=int, default=2048, help="`tiers`: size the window to its bf16 share at this length")
    ap.add_argument("--exp", nargs="+", default=["kv", "buckets", "tiers", "stats", "rot"],
                    choices=["kv", "buckets", "tiers", "stats", "rot", "policy"])
    ap.add_argument("--levers", nargs="*", default=[],
                    help="lever configs of lever_length.py (e.g. Kgrid Kpq Ksp10): K+V and K-only error per layer with them")
    ap.add_argument("--grid-tokens", type=int, default=4096)
    ap.add_argument("--add", action="store_true", help="compute --exp into existing records (merged per layer)")
    ap.add_argument("--capture-only", action="store_true", help="only capture (no artifact needed)")
    ap.add_argument("--scratch", default=".scratch/diag_length")
    ap.add_argument("--out", default="docs/results/diagnosis_length/length.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from rotkv.eval.config import builtin_eval_texts
    from rotkv.eval.run import read_tokens
    from rotkv.hf.models import attention_modules, load_model
    from rotkv.rotations.artifact import load_artifact

    loaded = load_model(None, device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    texts = builtin_eval_texts()
    ids_all = torch.tensor([read_tokens(tok, texts)])
    attn = attention_modules(model)
    w_os = [m.o_proj.weight.detach().float() for m in attn]
    scalings = [float(getattr(m, "scaling", m.head_dim ** -0.5)) for m in attn]
    cfg = model.config
    head_dim = cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads
    arts = {} if args.capture_only else {"main": load_artifact(args.artifact)}
    if args.alt_artifact and "rot" in args.exp and not args.capture_only:
        arts["alt"] = load_artifact(args.alt_artifact)
    spec = get_preset(args.preset)
    sink = spec.sink if args.sink is None else args.sink
    window = spec.window if args.window is None else args.window
    page = spec.page_size
    n = args.new_tokens
    os.makedirs(args.scratch, exist_ok=True)
    results = json.load(open(args.out)) if os.path.exists(args.out) else {}
    results["settings"] = {"preset": args.preset, "artifact": args.artifact, "alt_artifact": args.alt_artifact,
                           "sink": sink, "window": window, "page": page, "new_tokens": n, "texts": texts,
                           "share_of": args.share_of, "buckets": bucket_names()}
    runs = results.setdefault("runs", {})
    t0 = time.time()
    share = (sink + window) / args.share_of
    def screen_levers(key, rec, caps, L):
        """K+V and K-only error per layer of each --levers config, added to ``rec["levers"]``."""
        import lever_length as ll
        art = arts["main"]
        tables = ll.load_tables(args.levers, model, tok, art, spec, args.grid_tokens, ".scratch/levers",
                                os.path.basename(args.artifact))
        bits = [w.key for w in resolve_widths(spec, len(caps), art)]
        for cfg_name in args.levers:
            if cfg_name in rec.get("levers", {}):
                continue
            per, extra = {}, 0
            for i, cap in enumerate(caps):
                lq = LayerQuant(spec, art.layer_rotation(i), head_dim, bits[i])
                lq.kc, lq.vc, e = ll.lever_codecs(cfg_name.split("+"), i, lq.kc, lq.vc, lq.rot, spec, tables)
                extra += e
                per[i] = analyse_layer(cap, lq, w_os[i], scalings[i], L, n, sink, window, page, {"kv"})
            rec.setdefault("levers", {})[cfg_name] = {"layers": per, "table_bytes": extra}
            print(f"{key} lever {cfg_name}: mean both {sum(r['both'] for r in per.values()) / len(per):.4f} "
                  f"k_only {sum(r['k_only'] for r in per.values()) / len(per):.4f}", flush=True)

    def save():
        """Merge into the file as it is on disk now (other runs of this script may have added to it)."""
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        disk = json.load(open(args.out)) if os.path.exists(args.out) else {}
        merged = merge(disk, json.loads(json.dumps(results)))
        with open(args.out + ".tmp", "w") as f:
            json.dump(merged, f, indent=1)
        os.replace(args.out + ".tmp", args.out)

    from rotkv.eval import nll
    for L in args.lengths:
        starts = nll.window_starts(ids_all.shape[1], L, n, args.windows)
        for w, s in enumerate(starts):
            key = f"L{L}/w{w}"
            path = os.path.join(args.scratch, f"cap_L{L}_s{s}_n{n}.pt")
            need_alt = key in runs and "alt" in arts and "layers_alt" not in runs[key]
            if key in runs and args.add:
                if os.path.exists(path):
                    caps = torch.load(path)
                art = arts["main"]
                bits = [w.key for w in resolve_widths(spec, len(caps), art)]
                for i, cap in enumerate(caps):
                    lq = LayerQuant(spec, art.layer_rotation(i), head_dim, bits[i])
                    extra = analyse_layer(cap, lq, w_os[i], scalings[i], L, n, sink, window, page, set(args.exp))
                    runs[key]["layers"][str(i) if str(i) in runs[key]["layers"] else i].update(extra)
                save()
                print(f"{key}: added {args.exp}", flush=True)
            if key in runs and not args.levers and not need_alt:
                continue
            if os.path.exists(path):
                caps = torch.load(path)
            else:
                t1 = time.time()
                caps = capture(model, ids_all[:, s:s + L + n], L)
                torch.save(caps, path)
                print(f"captured {key} in {time.time() - t1:.0f} s", flush=True)
            if args.capture_only:
                continue
            if key not in runs:
                share_window = max(window, round(share * L) - sink)
                rec = {"start": s, "share_window": share_window, "layers": {}}
                for name, art in arts.items():
                    bits = [w.key for w in resolve_widths(spec, len(caps), art)]
                    per = {}
                    for i, cap in enumerate(caps):
                        lq = LayerQuant(spec, art.layer_rotation(i), head_dim, bits[i])
                        exps = set(args.exp) if name == "main" else {"kv"}
                        per[i] = analyse_layer(cap, lq, w_os[i], scalings[i], L, n, sink, window, page, exps, share_window)
                    rec["layers" if name == "main" else "layers_alt"] = per
                runs[key] = rec
                print(f"{key}: mean both {sum(r['both'] for r in rec['layers'].values()) / len(caps):.4f} "
                      f"k_only {sum(r['k_only'] for r in rec['layers'].values()) / len(caps):.4f} ({time.time() - t0:.0f} s)",
                      flush=True)
                save()
            if need_alt:
                art = arts["alt"]
                bits = [w.key for w in resolve_widths(spec, len(caps), art)]
                runs[key]["layers_alt"] = {
                    i: analyse_layer(cap, LayerQuant(spec, art.layer_rotation(i), head_dim, bits[i]),
                                     w_os[i], scalings[i], L, n, sink, window, page, {"kv"})
                    for i, cap in enumerate(caps)}
                save()
            if args.levers:
                screen_levers(key, runs[key], caps, L)
                save()

if __name__ == "__main__":
    main()
