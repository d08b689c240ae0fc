"""Levers against oscar-mix at 2K and 8K, end to end, at measured bits.

The ``rotkv eval`` nll protocol through ``diagnose_int2.run_config`` (rotkv.eval.nll.score_window): held-out
windows, the context prefilled in 512-token chunks through a RotkvCache of the preset (sink 16 / window 32
for oscar-mix), then teacher-forced decode tokens, KL per token against the fp32 plain model. The
reference log-probs are cached under ``--scratch`` (one plain forward per window, reused by every lever).
Bits per element are measured from the cache's pools (every tier, code, scale, lo and side table), plus
the per-layer grids for the grid levers.

Levers (``+``-joined tokens of one config; a config is one run):
  base                 the preset as it is
  Konly / Vonly        diagnosis: only K (V in bf16) / only V (K in bf16) quantized
  Ksp<N>[c<r>]         dense-and-sparse keys: the N largest |entries| of each 16 x 64 page and KV head in an
                       fp16 side table (N=5: 0.5%, N=10: 1%); dense clip ratio r (default: the layer's)
  Vsp<N>               the same for values
  Kgrid / Vgrid        non-uniform per-head 2-bit grids (Lloyd-Max on calibration text) for keys / values
  Kpq                  product-quantized keys in the 2-bit key layers: 4-dim sub-vectors, 256-entry codebook per
                       (layer, KV head) fitted by k-means on calibration text, fp16 row scale (2.25 bits)
  R4@<R>               (emulation) a 4-bit key tier for the recent body: the bf16 window is widened to R tokens and
                       every token written is fake-quantized on arrival (keys at 4 bits unclipped, values with the
                       preset's value codec) in the stored basis, so the R most recent tokens read 4-bit keys and
                       2-bit values, older ones the preset's body (2-bit keys quantized from the 4-bit ones). The 32
                       newest tokens are thereby 4-bit too (pessimistic against a real bf16 32 + 4-bit tier). Bits:
                       the base run's measured bits plus the analytic cost of that tier (keys of R - 32 tokens at
                       4 + 32/G bits instead of the layer's width), printed as ``bpe``; the emulation's own measured
                       bits (the tier counted as bf16) are kept as ``bpe_emulated``
  T4@<R>[m8]           (emulation) a 4-bit key tier for the recent body, read as the real format would: the bf16
                       window is widened to R tokens; at every read, the tier tokens past the sink and older than
                       the base window's newest tokens (``max(window, ceil(share * (length + new)))``) are read as
                       4-bit keys (unclipped; ``m8``: e4m3 scale and lo) and the value codec's values, the newest
                       exact; tokens leaving the R window are encoded into the body from their exact values, as
                       in the base. Bits: the base run's plus the tier's extra key bits (analytic, ``tier_bits``)
  N4V@<R>              as N4@, the tier's values refined the same way (2 more bits per value element)
  N4VO@<R>             only the tier's values refined (its keys read as the body's)
  N4@<R>               as T4@, the tier's keys read as the body's 2-bit code refined by 2 more bits (no metadata
                       of their own: ``nested_keys``), the format where a page's refinement is dropped as it ages
  K4@<layers>          4-bit keys in exactly these layers (comma-free: 4.7.14), replacing the artifact's widths
  K2@<layers>          2-bit keys (clipped at the layer's ratio) in these layers

Usage: python studies/lever_length.py --artifact A/oscar-mix.safetensors --length 2048 --windows 2 \
           --configs base Kgrid Ksp10 --out docs/results/levers_length/L2048.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diagnose_int2 as dx  # noqa: E402

from rotkv.cache import RotkvCache  # noqa: E402
from rotkv.cache.codecs import GridTokenCodec, PQCodec, SparseTokenCodec, TokenCodec  # noqa: E402
from rotkv.cache.layer import HybridLayer  # noqa: E402


def layers_of(text: str) -> set[int]:
    return {int(x) for x in text.split(".") if x}


def lever_codecs(levers: list[str], i: int, kc, vc, rot, spec, tables: dict):
    """(key codec, value codec, constant extra bytes) of layer ``i`` after the levers; ``kc``/``vc`` the preset's."""
    extra = 0
    for lever in levers:
        if lever == "base":
            continue
        if lever == "Konly":
            vc = dx.Bf16Codec()
        elif lever == "Vonly":
            kc = dx.Bf16Codec()
        elif lever.startswith(("Ksp", "Vsp")):
            n, _, c = lever[3:].partition("c")
            old = kc if lever[0] == "K" else vc
            if old.bits != 2:
                continue  # only the 2-bit layers get a side table
            new = SparseTokenCodec(old.bits, old.group_size, float(c) if c else old.clip, old.meta, int(n))
            kc, vc = (new, vc) if lever[0] == "K" else (kc, new)
        elif lever in ("Kgrid", "Vgrid"):
            old = kc if lever[0] == "K" else vc
            if old.bits != 2:
                continue
            g = tables[f"{lever[0].lower()}_grid"][i]
            new = GridTokenCodec(old.bits, old.group_size, old.clip, old.meta, g)
            kc, vc = (new, vc) if lever[0] == "K" else (kc, new)
            extra += g.numel() * 2  # fp16 levels
        elif lever == "Kpq":
            if kc.bits != 2:
                continue
            kc = PQCodec(tables["pq_book"][i], tables["pq_sigma"][i])
            extra += kc.table_bytes
        elif lever.startswith(("K4@", "K2@")):
            bits, want = int(lever[1]), layers_of(lever[3:])
            clip = rot.clip_k if rot.clip_k is not None else spec.clip_k
            if bits == 4 and i in want:
                kc = TokenCodec(4, kc.group_size, 1.0, kc.meta)
            elif bits == 4 and kc.bits == 4:  # layers not listed fall back to 2 bits
                kc = TokenCodec(2, kc.group_size, clip, kc.meta)
            elif bits == 2 and i in want:
                kc = TokenCodec(2, kc.group_size, clip, kc.meta)
        else:
            raise ValueError(f"unknown lever {lever!r}")
    return kc, vc, extra


def fake_tier(layer, spec):
    """Wrap ``layer.update``: keys fake-quantized at 4 bits and values by the value codec, in the stored basis."""
    from rotkv.quant.quantizer import fake_quantize
    from rotkv.rotations.base import _per_head

    rot, vc = layer.rotation_cpu, layer.value_codec
    g = layer.key_codec.group_size
    orig = layer.update

    def update(k, v, *a, **kw):
        kr = fake_quantize(rot.keys(k), 4, g, 1.0, spec.meta_k)
        k2 = kr if rot.R_K is None else _per_head(kr, rot.R_K.transpose(-1, -2))
        if rot.k_mean is not None:
            k2 = k2 + rot.k_mean.unsqueeze(-2)
        vr = rot.values(v)
        shape = vr.shape
        vq = vc.decode(vc.encode(vr.reshape(-1, *shape[-3:]))).reshape(shape)
        v2 = vq if rot.R_V is None else _per_head(vq, rot.R_V.transpose(-1, -2))
        return orig(k2.to(k.dtype), v2.to(v.dtype), *a, **kw)

    layer.update = update


def nested_keys(x: torch.Tensor, kc) -> torch.Tensor:
    """Keys read through a 2-bit refinement of the layer's own 2-bit code: the code ``h`` and its metadata
    are the body's (clipped), two more bits ``j`` place the key inside its bucket, ``h + (j - 1.5) / 4``."""
    from rotkv.quant.packing import unpack
    from rotkv.quant.quantizer import quantize

    q = quantize(x, kc.bits, kc.group_size, kc.clip, kc.meta)
    d, g = x.shape[-1], kc.group_size
    h = unpack(q.codes, kc.bits).float().reshape(*x.shape[:-1], d // g, g)
    s, lo = q.scale.float().unsqueeze(-1), q.lo.float().unsqueeze(-1)
    base = h * s + lo
    xs = x.float().reshape(base.shape)
    j = torch.round((xs - base) / torch.where(s > 0, s, torch.ones_like(s)) * 4 + 1.5).clamp(0, 3)
    return (base + (j - 1.5) / 4 * s).reshape(x.shape)


def recent_tier(pools, sink: int, exact: int, meta: str | None, nested: bool = False, values: bool = False,
                keys: bool = True):
    """Wrap ``pools.tier_dense`` (one row): tier tokens past the sink and older than the ``exact`` newest are
    returned as 4-bit keys (``nested``: the 2-bit code refined by 2 bits, :func:`nested_keys`) and the value
    codec's values (the stored basis), the rest as stored."""
    from rotkv.quant.quantizer import fake_quantize

    kc, vc = pools.codecs
    orig = pools.tier_dense

    def tier_dense(pg, off, dtype):
        tk, tv = orig(pg, off, dtype)
        if tk.shape[0] != 1:
            raise SystemExit("T4@ emulates one row")
        a, b = sink, tk.shape[2] - exact
        if b > a:
            tk, tv = tk.clone(), tv.clone()
            x = tk[:, :, a:b].float()
            if nested and kc.bits == 2 and keys:
                tk[:, :, a:b] = nested_keys(x, kc).to(dtype)
            elif nested:  # a 4-bit key layer: its body's own codec
                tk[:, :, a:b] = kc.decode(kc.encode(x)).to(dtype)
            else:
                tk[:, :, a:b] = fake_quantize(x, 4, kc.group_size, 1.0, meta).to(dtype)
            xv = tv[:, :, a:b].float()
            tv[:, :, a:b] = (nested_keys(xv, vc) if values else vc.decode(vc.encode(xv))).to(dtype)
        return tk, tv

    pools.tier_dense = tier_dense


def tier_bits(cache, r: int, tokens: int, values: bool = False, keys: bool = True) -> float:
    """Analytic extra bits per element of a 4-bit key tier for the R - window newest body tokens
    (``values``: 2 more bits for their 2-bit values too)."""
    layers = [l for l in cache.layers if isinstance(l, HybridLayer)]
    n = min(max(r - cache.spec.window, 0), max(tokens - cache.spec.sink - cache.spec.window, 0))
    g = layers[0].key_codec.group_size
    extra = sum((4 + 32 / g) - (l.key_codec.bits + 32 / g) for l in layers) if keys else 0  # per token and head dim
    if values:
        extra += 2 * sum(l.value_codec.bits == 2 for l in layers)
    return n * extra / (2 * tokens * len(layers))


def apply(cache, levers: list[str], tables: dict) -> int:
    """Swap the codecs of ``cache``'s layers for the levers; returns constant extra bytes (grids, codebooks)."""
    extra = 0
    for layer in cache.layers:
        if isinstance(layer, HybridLayer):
            layer.key_codec, layer.value_codec, e = lever_codecs(levers, layer.layer_idx, layer.key_codec,
                                                                 layer.value_codec, layer.rotation_cpu, cache.spec, tables)
            extra += e
    return extra


def load_tables(configs, model, tok, art, spec, tokens: int, scratch: str, art_name: str) -> dict:
    """The calibrated grids / PQ codebooks the configs need, fitted once on calibration text and cached."""
    tables = {}
    for what, fn in (("grid", "fit_grids"), ("pq", "fit_pq_books")):
        if not any(what in c for c in configs):
            continue
        path = os.path.join(scratch, f"{what}_{art_name}_{tokens}.pt")
        if not os.path.exists(path):
            from rotkv.calibrate import grids as g
            t0 = time.time()
            torch.save(getattr(g, fn)(model, tok, art, spec, tokens), path)
            print(f"{what} tables fitted in {time.time() - t0:.0f} s", flush=True)
        tables.update(torch.load(path))
    return tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="oscar-mix")
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--configs", nargs="+", default=["base"])
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--window", type=int, default=None, help="the bf16 window (default: the preset's)")
    ap.add_argument("--sink", type=int, default=None, help="the bf16 sink (default: the preset's)")
    ap.add_argument("--text", choices=["eval", "calib"], default="eval",
                    help="score on the held-out texts (default) or on the calibration texts (to choose a lever "
                         "without looking at the held-out ones)")
    ap.add_argument("--window-share", type=float, default=None,
                    help="CacheSpec.window_share: the window grows to this share of each row (default: the preset's)")
    ap.add_argument("--refine-tokens", type=int, default=None,
                    help="CacheSpec.refine_tokens: 2 more key bits for each row's newest body tokens (default: the preset's)")
    ap.add_argument("--refine-values", action=argparse.BooleanOptionalAction, default=None,
                    help="CacheSpec.refine_values: the refine tier's values too, or not (default: the preset's)")
    ap.add_argument("--refine-every", type=int, default=None,
                    help="CacheSpec.refine_every: one refined page per this many body pages (default: the preset's)")
    ap.add_argument("--meta-k", choices=["float16", "float8"], default=None,
                    help="CacheSpec.meta_k: the key groups' scale and lo dtype (default: the preset's)")
    ap.add_argument("--grid-tokens", type=int, default=4096, help="calibration tokens for the grids")
    ap.add_argument("--context-length", default=None, metavar="N|auto",
                    help="the cache's expected tokens per row, which picks the key fit of an artifact with several "
                         "(rotkv calibrate --long-seq-len 4096,8192); auto: the window's, --length + --new-tokens; "
                         "default: none, the artifact's primary fit")
    ap.add_argument("--tag", default="", help="a label added to the run keys (e.g. the artifact's name)")
    ap.add_argument("--scratch", default=".scratch/levers")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)

    from rotkv.config import get_preset
    from rotkv.eval import nll
    from rotkv.eval.config import builtin_eval_texts
    from rotkv.eval.run import read_tokens
    from rotkv.hf.models import load_model
    from rotkv.rotations.artifact import load_artifact

    loaded = load_model(None, device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    spec = get_preset(args.preset)
    art = load_artifact(args.artifact)
    if args.text == "calib":
        from rotkv.calibrate.corpus import default_files

        texts = default_files("calib")
    else:
        texts = builtin_eval_texts()
    ids = torch.tensor([read_tokens(tok, texts)])
    L, N = args.length, args.new_tokens
    ctx_len = None if args.context_length is None else L + N if args.context_length == "auto" else int(args.context_length)
    starts = nll.window_starts(ids.shape[1], L, N, args.windows)
    os.makedirs(args.scratch, exist_ok=True)
    refs = []
    for s in starts:
        path = os.path.join(args.scratch, f"ref{'' if args.text == 'eval' else '_' + args.text}_L{L}_s{s}_n{N}.pt")
        if not os.path.exists(path):
            torch.save(nll.reference(model, ids[:, s:s + L + N], L, N), path)
        refs.append((s, torch.load(path)))
    grids = load_tables(args.configs, model, tok, art, spec, args.grid_tokens, args.scratch, os.path.basename(args.artifact))
    sink = spec.sink if args.sink is None else args.sink
    ctx = dict(model=model, ids=ids, refs=refs, length=L, new_tokens=N, sink=sink, window=spec.window,
               artifacts={})
    results = json.load(open(args.out)) if os.path.exists(args.out) else {"runs": {}}
    results["settings"] = {"preset": args.preset, "artifact": args.artifact, "length": L, "new_tokens": N,
                           "windows": args.windows, "starts": starts, "sink": sink, "window": args.window or spec.window,
                           "chunk": args.chunk, "texts": texts, "grid_tokens": args.grid_tokens,
                           "window_share": args.window_share, "context_length": ctx_len, "refine_tokens": args.refine_tokens,
                           "refine_values": args.refine_values, "refine_every": args.refine_every,
                           "meta_k": args.meta_k,
                           "key_fit_lengths": art.key_fit_lengths}
    for name in args.configs:
        key = name + (f"/{args.tag}" if args.tag else "") + (f"/w{args.window}" if args.window is not None else "") + (
            f"/sink{args.sink}" if args.sink is not None else "") + (f"/{args.text}" if args.text != "eval" else "") + (
            f"/s{args.window_share:g}" if args.window_share is not None else "") + (
            f"/refine{args.refine_tokens}" if args.refine_tokens is not None else "") + (
            "/kv" if args.refine_values else "/k" if args.refine_values is False else "") + (
            f"/every{args.refine_every}" if args.refine_every is not None else "") + (
            f"/mk{args.meta_k}" if args.meta_k is not None else "") + (
            f"/ctx{ctx_len}" if ctx_len is not None else "")
        if key in results["runs"]:
            continue
        extra = [0]

        levers = name.split("+")
        r4 = [int(x[3:]) for x in levers if x.startswith("R4@")]
        tiers = ("T4@", "N4@", "N4V@", "N4VO@")
        t4 = [x.split("@")[1] for x in levers if x.startswith(tiers)]
        nested = any(x.startswith(tiers[1:]) for x in levers)
        nested_v = any(x.startswith(("N4V@", "N4VO@")) for x in levers)
        nested_k = not any(x.startswith("N4VO@") for x in levers)
        levers = [x for x in levers if not x.startswith(("R4@",) + tiers)] or ["base"]
        if r4 and levers != ["base"]:
            raise SystemExit("R4@ is measured alone (its bits are the base run's plus the tier's)")
        holder = {}

        t4_r = int(t4[0].removesuffix("m8")) if t4 else None
        t4_meta = "float8" if t4 and t4[0].endswith("m8") else None
        base_window = args.window or spec.window
        share_ = spec.window_share if args.window_share is None else args.window_share
        exact = max(base_window, math.ceil((share_ or 0) * (L + N))) if t4 else None

        def build(ctx_, preset, chunk, mod, win, levers=levers, r4=r4):
            window = r4[0] if r4 else t4_r if t4 else args.window
            share = {} if args.window_share is None else {"window_share": args.window_share}
            if args.refine_tokens is not None:
                share["refine_tokens"] = args.refine_tokens
            if args.refine_values is not None:
                share["refine_values"] = args.refine_values
            if args.refine_every is not None:
                share["refine_every"] = args.refine_every
            if args.meta_k is not None:
                share["meta_k"] = args.meta_k
            cache = RotkvCache(model, args.preset, art, prefill_chunk=chunk, window=window, sink=sink,
                               context_length=ctx_len, **share)
            holder["fit"] = cache.key_fit_length
            extra[0] = apply(cache, levers, grids)
            if t4:  # the pools' reads wrapped once per config (LayerPools.__init__ patched below)
                holder["ref"] = RotkvCache(model, args.preset, art, prefill_chunk=chunk, window=exact, sink=sink,
                                           context_length=ctx_len)
            if r4:
                for layer in cache.layers:
                    if isinstance(layer, HybridLayer):
                        fake_tier(layer, cache.spec)
                holder["ref"] = RotkvCache(model, args.preset, art, prefill_chunk=chunk, window=args.window,
                                           context_length=ctx_len)
            return cache

        dx.build_cache = build
        if t4:  # every layer's pools of this config's caches read the tier as the emulated format
            from rotkv.cache.pools import LayerPools
            init = LayerPools.__init__

            def wrapped(self_, *a, _init=init, **kw):
                _init(self_, *a, **kw)
                recent_tier(self_, sink, exact, t4_meta, nested, nested_v, nested_k)
            holder["restore"] = (LayerPools, init)
            LayerPools.__init__ = wrapped
        t1 = time.time()
        r = dx.run_config(ctx, args.preset, args.chunk, {})
        elements = None
        r["grid_bytes"] = extra[0]
        r["key_fit_length"] = holder.get("fit")
        if extra[0]:  # constant per-layer grids: add them to the measured bits (at this length)
            elements = 2 * (L + N - 1) * model.config.num_key_value_heads * (model.config.hidden_size //
                                                                             model.config.num_attention_heads) * model.config.num_hidden_layers
            r["bpe"] += 8 * extra[0] / elements
        if r4:  # the emulated tier is counted as bf16 by the pools: the real format's bits are the base run's
            # measured bits (same length and windows; levers_length_table.py adds them) plus the tier's
            r["bpe_emulated"] = r["bpe"]
            r["tier_bits"] = tier_bits(holder["ref"], r4[0], L + N - 1)
            r["bpe"] = None
        if t4:
            cls, init = holder.pop("restore")
            cls.__init__ = init
            r["bpe_emulated"] = r["bpe"]
            tb = tier_bits(holder["ref"], t4_r, L + N - 1, values=nested_v, keys=nested_k)
            r["tier_bits"] = tb * (1.75 / 2 if t4_meta else 1)  # e4m3 metadata: 4.25 bits a key element, not 4.5
            r["bpe"] = None
            r["exact_window"] = exact
        r["seconds"] = round(time.time() - t1, 1)
        results["runs"][key] = r
        bits = r["bpe"] if r["bpe"] is not None else float("nan")
        fit = f" key fit {r['key_fit_length']}" if r["key_fit_length"] else ""
        print(f"L{L} {key:36s} KL {r['kl']:.4f} +- {r['kl_ci95']:.4f} top1 {r['top1']:.3f} bits {bits:.3f}{fit} "
              f"({r['seconds']:.0f} s)", flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
