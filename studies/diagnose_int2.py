"""Diagnose where the INT2 decode KL comes from.

Protocol (as ``rotkv eval``'s nll task): windows of held-out text, the first L tokens prefilled in
``--chunk``-token calls through a RotkvCache (sink/window overridden), then ``--new-tokens``
teacher-forced decode steps; per scored token KL(fp32 plain model || cache). The scoring is
``rotkv.eval.nll.score_window`` itself; only the cache handed to it is modified.

How a part of the cache is kept out of the quantizer without touching ``rotkv/cache``: after
``RotkvCache(model, preset, artifact, sink=, window=, prefill_chunk=)`` is built, this script swaps
the per-layer block codecs (``HybridLayer.key_codec`` / ``value_codec``, the objects that encode a page
leaving the recent window) for wrappers:

- :class:`Bf16Codec`: stores the page as bfloat16 (counted as such by ``cache.stats()``), i.e. that
  layer's K (or V) body is bf16;
- :class:`KeepCodec`: quantizes the page with the preset's codec as usual (dense part) and keeps
  selected (head, token) rows in bf16 beside it (sparse part, KVQuant's dense-and-sparse); the
  sparse part's bytes (bf16 row + a 32-bit index per row) are added to the measured bytes.

Experiments (``--exp``): ``base`` (the preset; plus bf16 and int4 for scale), ``kv`` (K-only and
V-only quantization, the other kept bf16), ``layers`` (one layer's K+V back in bf16 at a time),
``heads`` (KV head h of the ``--head-layers`` layers back in bf16, one run per h; measured
bits then count the dense codes too), ``chunk`` (prefill in one
L-token chunk instead of ``--chunk``), ``tokens`` (top-k body tokens per layer and KV head kept
bf16, ranked by decode attention mass, prefill attention mass, key norm, or at random), ``lever``
(K/V group sizes at equal measured bits). Results go to ``--out`` (JSON, written after every run,
so an interrupted run resumes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch
from tqdm.auto import tqdm

from rotkv.cache import RotkvCache
from rotkv.cache.codecs import TokenCodec
from rotkv.cache.layer import HybridLayer
from rotkv.eval import nll
from rotkv.eval.config import builtin_eval_texts
from rotkv.eval.stats import mean_ci


# ---- codec wrappers -----------------------------------------------------------------------------
class Bf16Codec:
    """A page stored as bfloat16: ``[nb, H, P, D]`` -> {"x": bf16}."""

    def encode(self, x):
        return {"x": x.to(torch.bfloat16)}

    def decode(self, parts):
        return parts["x"].float()


class KeepCodec:
    """The wrapped codec's pages, plus bf16 copies of the (head, token) rows ``keep`` selects.

    keep(pos [nb, P] absolute token positions) -> bool [nb, H, P]. Pages arrive in token order for one
    row (batch 1), starting right after the sink, which is how positions are known. The sparse rows
    are applied only to the decode of the page just encoded (the CPU reader's read buffer is written
    once per page); their bytes are counted in ``side_bytes``.
    """

    def __init__(self, inner, keep, start: int):
        self.inner, self.keep, self.pos = inner, keep, start
        self.side_bytes, self.kept_rows, self._last = 0, 0, None

    def encode(self, x):
        nb, h, p, d = x.shape
        pos = self.pos + torch.arange(nb * p).reshape(nb, p)
        self.pos += nb * p
        parts = self.inner.encode(x)
        mask = self.keep(pos)
        n = int(mask.sum())
        if n:
            self._last = (parts, mask, x.to(torch.bfloat16))
            self.side_bytes += n * (d * 2 + 4)
            self.kept_rows += n
        return parts

    def decode(self, parts):
        y = self.inner.decode(parts)
        if self._last is not None and self._last[0] is parts:
            _, mask, xb = self._last
            y = torch.where(mask[..., None], xb.float(), y)
            self._last = None
        return y


def position_mask(sel: dict[int, torch.Tensor], heads: int, length: int):
    """keep() for per-head sets of positions: sel[h] = LongTensor of positions."""
    table = torch.zeros(heads, length + 4096, dtype=torch.bool)
    for h, p in sel.items():
        table[h, p] = True

    def keep(pos):  # [nb, P] -> [nb, H, P]
        return table[:, pos].permute(1, 0, 2)
    return keep


# ---- one configuration ----------------------------------------------------------------------------
class Prepared:
    """The Method interface of rotkv.eval (build, measure) around a cache this script prepared."""

    def __init__(self, make):
        self.make, self.cache = make, None

    def build(self, model, context_length=None):  # the cache is this script's: it sets its own context length
        self.cache = self.make()
        return self.cache

    def measure(self, cache, model):
        st = cache.stats()
        side = sum(c.side_bytes for layer in cache.layers if isinstance(layer, HybridLayer)
                   for c in (layer.key_codec, layer.value_codec) if isinstance(c, KeepCodec))
        kept = sum(c.kept_rows for layer in cache.layers if isinstance(layer, HybridLayer)
                   for c in (layer.key_codec, layer.value_codec) if isinstance(c, KeepCodec))
        return {"kv_bytes": int(st["kv_bytes"]) + side, "side_bytes": side, "kept_rows": kept,
                "elements": int(st["elements"])}


def build_cache(ctx, preset: str, chunk: int, mod: dict, win: int):
    """A RotkvCache of ``preset`` with the modification ``mod`` applied to its codecs."""
    art = ctx["artifacts"].get(preset)
    kw = dict(sink=ctx["sink"], window=ctx["window"], prefill_chunk=chunk)
    kw.update(mod.get("spec", {}))
    cache = RotkvCache(ctx["model"], preset, art, **kw)
    layers = [l for l in cache.layers if isinstance(l, HybridLayer)]
    for layer in layers:
        i = layer.layer_idx
        if "codec" in mod:  # lever: own K and V codecs (bits, group, clip or None = the layer's clip)
            for part, (bits, g, clip) in mod["codec"].items():
                old = getattr(layer, f"{part}_codec")
                setattr(layer, f"{part}_codec", TokenCodec(bits, g, old.clip if clip is None else clip))
        for part in ("key", "value"):
            if (i, part[0]) in mod.get("bf16", set()) or ("*", part[0]) in mod.get("bf16", set()):
                setattr(layer, f"{part}_codec", Bf16Codec())
        sel = mod.get("keep", {}).get(i)
        if sel is not None:
            for part in ("key", "value"):
                if part[0] in mod.get("keep_parts", "kv"):
                    keep = position_mask(sel, layer.kv_heads, ctx["length"] + ctx["new_tokens"])
                    setattr(layer, f"{part}_codec", KeepCodec(getattr(layer, f"{part}_codec"), keep, ctx["sink"]))
    return cache


def run_config(ctx, preset: str, chunk: int, mod: dict, keep_for_window=None) -> dict:
    """Pooled per-token KL / top-1 / NLL over the windows, and measured bits per element."""
    per = {"kl": [], "top1": [], "nll": []}
    bpe, side_bpe, kept = [], [], []
    for w, (start, ref) in enumerate(ctx["refs"]):
        m = dict(mod)
        if keep_for_window is not None:
            m["keep"] = keep_for_window(w)
        ids = ctx["ids"][:, start:start + ctx["length"] + ctx["new_tokens"]]
        method = Prepared(lambda: build_cache(ctx, preset, chunk, m, w))
        scores, mem = nll.score_window(ctx["model"], method, ids, ctx["length"], ctx["new_tokens"], chunk, ref)
        for k in per:
            per[k] += scores[k]
        bpe.append(8 * mem["kv_bytes"] / mem["elements"])
        side_bpe.append(8 * mem["side_bytes"] / mem["elements"])
        kept.append(mem["kept_rows"])
    kl, kl_ci = mean_ci(per["kl"])
    top1, _ = mean_ci(per["top1"])
    return {"preset": preset, "chunk": chunk, "kl": kl, "kl_ci95": kl_ci, "top1": top1,
            "nll": sum(per["nll"]) / len(per["nll"]), "bpe": sum(bpe) / len(bpe),
            "side_bpe": sum(side_bpe) / len(side_bpe), "kept_rows": sum(kept) / len(kept), "per_token_kl": per["kl"]}


# ---- token statistics from the plain model --------------------------------------------------------
def token_stats(ctx, artifact_means: list[torch.Tensor] | None) -> list[dict]:
    """Per window and layer: decode attention mass, mean prefill attention received, key norm; each [H, L].

    One plain fp32 forward over the window with rotkv's capture attention (eager softmax): decode mass
    is the attention the N-1 scored decode queries give each of the first L tokens (summed over the
    query heads of a KV head, averaged over queries); prefill mass is the mean attention a token gets
    from the prefill queries that see it; last mass is the attention the last ``window`` prefill queries
    (those of the recent window when decoding starts) give it, averaged over them; key norm is ``||k - mu||`` (the stored key's norm: the
    rotation is orthogonal; mu the artifact's key mean, or 0).
    """
    from rotkv.calibrate.capture import capturing
    from rotkv.eval.protocol import forward

    L, N = ctx["length"], ctx["new_tokens"]
    out = []
    for start, _ in ctx["refs"]:
        ids = ctx["ids"][:, start:start + L + N - 1]
        st: dict = {"dec": {}, "pre": {}, "last": {}, "norm": {}}

        def rec(layer, q, k, v, o, probs):
            hq, h = probs.shape[1], k.shape[1]
            p = probs[0].float()
            dec = p[:, L:, :L].mean(1).reshape(h, hq // h, L).sum(1)
            seen = torch.arange(L, 0, -1, dtype=torch.float32)  # queries 0..L-1 that see token j: L - j
            pre = p[:, :L, :L].sum(1).reshape(h, hq // h, L).sum(1) / seen
            last = p[:, L - ctx["window"]:L, :L].mean(1).reshape(h, hq // h, L).sum(1)
            kk = k[0, :, :L].float()
            if artifact_means is not None and artifact_means[layer] is not None:
                kk = kk - artifact_means[layer][:, None, :]
            st["dec"][layer], st["pre"][layer], st["last"][layer] = dec, pre, last
            st["norm"][layer] = kk.norm(dim=-1)

        with capturing(ctx["model"], rec):
            forward(ctx["model"], ids, None)
        out.append(st)
    return out


def select(stats_w: dict, by: str, k: int, lo: int, hi: int, seed: int) -> dict[int, dict[int, torch.Tensor]]:
    """Per layer and KV head, the top-k positions in [lo, hi) (the body at decode time) by ``by``."""
    sel = {}
    g = torch.Generator().manual_seed(seed)
    for layer, score in stats_w["dec"].items():
        sel[layer] = {}
        for h in range(score.shape[0]):
            if by == "random":
                pos = lo + torch.randperm(hi - lo, generator=g)[:k]
            else:
                s = stats_w[by][layer][h, lo:hi]
                pos = lo + s.topk(k).indices
            sel[layer][h] = pos
    return sel


# ---- driver ---------------------------------------------------------------------------------------
def paired(a: list[float], b: list[float]) -> tuple[float, float]:
    return mean_ci([x - y for x, y in zip(a, b)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (rotkv.hf.models.load_model)")
    ap.add_argument("--text", nargs="+", default=None, help="held-out text files (default: rotkv/data/eval_*.txt)")
    ap.add_argument("--presets", nargs="+", default=["quarot-int2", "oscar-int2"])
    ap.add_argument("--artifact-dir", default="/work/artifacts", help="holds oscar.safetensors (rotkv calibrate)")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--exp", nargs="+", default=["base", "kv", "chunk", "layers", "tokens"],
                    choices=["base", "kv", "chunk", "layers", "layer-groups", "heads", "tokens", "lever"])
    ap.add_argument("--layers", type=int, nargs="*", default=None, help="layers `layers` tries (default: all)")
    ap.add_argument("--layer-group", type=int, default=5, help="consecutive layers per group for `layer-groups`")
    ap.add_argument("--token-by", nargs="+", default=["dec", "pre", "norm", "random"],
                    choices=["dec", "pre", "last", "norm", "random"],
                    help="rankings `tokens` tries: decode mass (oracle), mean prefill mass, mass from the last "
                         "--window prefill queries, key norm, random")
    ap.add_argument("--head-layers", type=int, nargs="*", default=[],
                    help="`heads` keeps KV head h of these layers (default: all) in bf16, one run per h")
    ap.add_argument("--topk", type=int, nargs="+", default=[16], help="tokens per layer and KV head for `tokens`")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="docs/results/diagnosis/diagnosis.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from rotkv.eval.run import read_tokens
    from rotkv.hf.models import load_model
    from rotkv.rotations.artifact import load_artifact

    t0 = time.time()
    loaded = load_model(args.model, device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    texts = args.text or builtin_eval_texts()
    ids = torch.tensor([read_tokens(tok, texts)])
    L, N = args.length, args.new_tokens
    starts = nll.window_starts(ids.shape[1], L, N, args.windows)
    refs = [(s, nll.reference(model, ids[:, s:s + L + N], L, N)) for s in starts]
    artifacts = {}
    for p in args.presets:
        if p.startswith(("oscar", "optr")):
            artifacts[p] = os.path.join(args.artifact_dir, f"{p.rsplit('-', 1)[0]}.safetensors")
    ctx = dict(model=model, ids=ids, refs=refs, length=L, new_tokens=N, sink=args.sink, window=args.window,
               artifacts=artifacts)

    results = json.load(open(args.out)) if os.path.exists(args.out) else {}
    results["settings"] = {"model": loaded.model_id if hasattr(loaded, "model_id") else args.model, "texts": texts,
                           "length": L, "new_tokens": N, "windows": args.windows, "starts": starts,
                           "chunk": args.chunk, "sink": args.sink, "window": args.window,
                           "artifacts": artifacts, "threads": args.threads}
    runs = results.setdefault("runs", {})

    def save():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, args.out)

    # the plan: (key, preset, chunk, mod, keep_for_window)
    plan = []
    layers_n = model.config.num_hidden_layers
    kv_heads = model.config.num_key_value_heads
    if "base" in args.exp:
        plan += [("bf16", "bf16", args.chunk, {}, None), ("int4", "int4", args.chunk, {}, None)]
    for p in args.presets:
        plan.append((f"{p}", p, args.chunk, {}, None))  # every delta is taken against the preset itself
        if "kv" in args.exp:
            plan.append((f"{p}/K-only", p, args.chunk, {"bf16": {("*", "v")}}, None))
            plan.append((f"{p}/V-only", p, args.chunk, {"bf16": {("*", "k")}}, None))
        if "chunk" in args.exp:
            plan.append((f"{p}/chunk={L}", p, L, {}, None))
        if "layers" in args.exp:
            for i in (range(layers_n) if args.layers is None else args.layers):
                plan.append((f"{p}/bf16-layer{i}", p, args.chunk, {"bf16": {(i, "k"), (i, "v")}}, None))
        if "layer-groups" in args.exp:
            for a in range(0, layers_n, args.layer_group):
                group = range(a, min(a + args.layer_group, layers_n))
                bf = {(i, part) for i in group for part in "kv"}
                plan.append((f"{p}/bf16-layers{group[0]}-{group[-1]}", p, args.chunk, {"bf16": bf}, None))
        if "heads" in args.exp:  # KV head h of the --head-layers (default: all) kept bf16 beside the dense codes
            hl = args.head_layers or list(range(layers_n))
            name = f"layers{hl[0]}-{hl[-1]}" if hl == list(range(hl[0], hl[-1] + 1)) else "layers" + ",".join(map(str, hl))
            for h in range(kv_heads):
                sel = {i: {h: torch.arange(0, L + N + 4096)} for i in hl}
                plan.append((f"{p}/bf16-{name}-head{h}", p, args.chunk, {"keep": sel}, None))
        if "tokens" in args.exp:
            means = None  # token statistics of the plain model, keys centred with this preset's means
            if p in artifacts:
                art = load_artifact(artifacts[p])
                means = [art.layer_rotation(i).k_mean for i in range(layers_n)]
            pstats = token_stats(ctx, means)
            results.setdefault("token_stats", {})[p] = summarize_stats(pstats, tok, ids, starts, args)
            save()
            lo, hi = args.sink, L - args.window  # tokens in the body when decoding starts
            for k in args.topk:
                for by in args.token_by:
                    fn = (lambda w, by=by, k=k, ps=pstats: select(ps[w], by, k, lo, hi, seed=w))
                    plan.append((f"{p}/keep-top{k}-{by}", p, args.chunk, {"keep_parts": "kv"}, fn))
            if "dec" in args.token_by:
                k = max(args.topk)
                fn = (lambda w, k=k, ps=pstats: select(ps[w], "dec", k, lo, hi, seed=w))
                plan.append((f"{p}/keep-top{k}-dec-Konly", p, args.chunk, {"keep_parts": "k"}, fn))
        if "lever" in args.exp:
            # keys in groups of 32 (+0.5 bit per key element), alone and paid for by a shorter bf16 window
            kg32 = {"key": (2, 32, None)}
            plan.append((f"{p}/lever-Kg32", p, args.chunk, {"codec": kg32}, None))
            plan.append((f"{p}/lever-Kg32-window32", p, args.chunk, {"codec": kg32, "spec": {"window": 32}}, None))

    todo = [x for x in plan if x[0] not in runs]
    bar = tqdm(todo, desc="diagnose", unit="run")
    for key, preset, chunk, mod, fn in bar:
        bar.set_postfix_str(key)
        t = time.time()
        r = run_config(ctx, preset, chunk, mod, fn)
        r["seconds"] = round(time.time() - t, 1)
        base = runs.get(preset)
        if base is not None and key != preset:
            r["delta_vs_preset"], r["delta_ci95"] = paired(r["per_token_kl"], base["per_token_kl"])
        runs[key] = r
        tqdm.write(f"{key:40s} KL {r['kl']:.4f} +- {r['kl_ci95']:.4f}  top1 {r['top1']:.3f}  bpe {r['bpe']:.3f}  ({r['seconds']} s)")
        save()
    results["total_s"] = round(time.time() - t0, 1)
    save()


def summarize_stats(pstats, tok, ids, starts, args) -> dict:
    """How concentrated decode attention is on body tokens, and which tokens get it."""
    L, lo, hi = args.length, args.sink, args.length - args.window
    out = {"layers": {}, "top_tokens": {}}
    counts: dict[str, int] = {}
    for w, st in enumerate(pstats):
        for layer, dec in st["dec"].items():
            body = dec[:, lo:hi]
            tot = dec.sum(1)
            rec = out["layers"].setdefault(str(layer), {"sink_mass": [], "body_mass": [], "window_mass": [],
                                                        "top8_body_mass": [], "top32_body_mass": [],
                                                        "norm_dec_spearman": []})
            rec["sink_mass"].append((dec[:, :lo].sum(1) / tot).mean().item())
            rec["body_mass"].append((body.sum(1) / tot).mean().item())
            rec["window_mass"].append((dec[:, hi:].sum(1) / tot).mean().item())
            for k in (8, 32):
                rec[f"top{k}_body_mass"].append((body.topk(k, dim=1).values.sum(1) / body.sum(1)).mean().item())
            nb = st["norm"][layer][:, lo:hi]
            rk = lambda x: x.argsort(1).argsort(1).float()  # noqa: E731
            a, b = rk(body), rk(nb)
            a, b = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
            rec["norm_dec_spearman"].append(((a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))).mean().item())
            for h in range(body.shape[0]):
                for p in (lo + body[h].topk(8).indices).tolist():
                    t = tok.decode([int(ids[0, starts[w] + p])])
                    counts[t] = counts.get(t, 0) + 1
    for rec in out["layers"].values():
        for k in list(rec):
            rec[k] = sum(rec[k]) / len(rec[k])
    total = sum(counts.values())
    out["top_tokens"] = {repr(t): round(c / total, 4) for t, c in sorted(counts.items(), key=lambda x: -x[1])[:15]}
    return out


if __name__ == "__main__":
    main()
