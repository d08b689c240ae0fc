"""End-to-end check of the key-subspace lever (see lever_proxy.py) under the diagnosis protocol.

The preset's key codec is swapped for :class:`SplitCodec`: inside the codec, the stored key
``x = (k - mu) R_K`` is turned into the eigenbasis of the query covariance (ranked by query energy
times key variance, fitted on calibration text), mixed by a Hadamard (or a fixed random rotation) inside
each tier, and each tier is quantized with rotkv's own quantizer at its bits; directions past the last
tier are not stored. This is the same arithmetic as a calibrated rotation ``R_K' = U B`` with a codec
that quantizes channel ranges, so the measured bits are real bytes in the cache's pools.

Usage: python studies/lever_e2e.py --configs 32@4 16@4+48@2 --out docs/results/levers/e2e.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diagnose_int2 as dx  # noqa: E402

from rotkv.cache.codecs import ChannelCodec  # noqa: E402
from rotkv.cache.layer import HybridLayer  # noqa: E402
from rotkv.quant.quantizer import dequantize, quantize, QuantizedRows  # noqa: E402
from rotkv.rotations.hadamard import hadamard_matrix
from rotkv.rotations.identity import random_orthogonal  # noqa: E402


def parse(cfg: str):
    return tuple(tuple(int(v) for v in t.split("@")) for t in cfg.split("+"))


def layer_range(text: str) -> set[int]:
    out = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        out |= set(range(int(a), int(b or a) + 1))
    return out


def apply_levers(cache, levers: list[str], bases, clip: float):
    """Levers (joined by ``,``-free tokens): ``K=<split>`` (SplitCodec), ``K4@a-b`` (keys of layers a..b at
    4 bits, unclipped), ``K3@a-b`` (3 bits, bit-sliced; clip from $K3_CLIP, default none), ``meta8`` (fp8 e4m3 scale and lo for K and V), ``Kmeta8``/``Vmeta8`` (one side only), ``Kc1``/``Vc1`` (keys / values unclipped), ``Kopt``/``Vopt`` (per-row MSE-optimal clip count), ``Kchan`` (keys per channel over each page, KIVI's
    grouping, after the rotation; use with ``--page-size 64`` for 2.5 bits)."""
    for layer in cache.layers:
        if not isinstance(layer, HybridLayer):
            continue
        i = layer.layer_idx
        for lever in levers:
            kc, vc = layer.key_codec, layer.value_codec
            if lever.startswith("K=") and bases is not None:
                layer.key_codec = SplitCodec(bases[i], parse(lever[2:]), clip)
            elif lever.startswith("K4@") and i in layer_range(lever[3:].replace(".", ",")):
                layer.key_codec = MetaCodec(4, kc.group_size, 1.0, getattr(kc, "meta", None))  # 4 bits: no clip
            elif lever.startswith("K3@") and i in layer_range(lever[3:].replace(".", ",")):
                layer.key_codec = MetaCodec(3, kc.group_size, K3_CLIP, getattr(kc, "meta", None))
            elif lever in ("meta8", "Kmeta8"):
                layer.key_codec = MetaCodec(kc.bits, kc.group_size, kc.clip, "float8")
            elif lever == "Kchan":  # KIVI's key grouping (per channel over a page) after the preset's rotation
                layer.key_codec = ChannelCodec(kc.bits)
            elif lever == "Kopt":
                layer.key_codec = OptClipCodec(kc.bits, kc.group_size, getattr(kc, "meta", None))
            elif lever == "Vopt":
                layer.value_codec = OptClipCodec(vc.bits, vc.group_size, getattr(vc, "meta", None))
            elif lever == "Kc1":  # keys unclipped at the preset's width
                layer.key_codec = MetaCodec(kc.bits, kc.group_size, 1.0, getattr(kc, "meta", None))
            elif lever == "Vc1":
                layer.value_codec = MetaCodec(vc.bits, vc.group_size, 1.0, getattr(vc, "meta", None))
            if lever in ("meta8", "Vmeta8"):
                layer.value_codec = MetaCodec(vc.bits, vc.group_size, vc.clip, "float8")


class OptClipCodec:
    """Per row, the clip (0 to 8 largest |x| clamped) whose quantized row is closest to the row (MSE)."""

    COUNTS = (0, 1, 2, 3, 4, 6, 8)

    def __init__(self, bits, group_size, meta=None):
        self.bits, self.group_size, self.meta = bits, group_size, meta

    def encode(self, x):
        d = x.shape[-1]
        srt = x.abs().sort(-1).values
        best, best_err = None, None
        for c in self.COUNTS:
            t = srt[..., d - 1 - c:d - c]
            q = quantize(torch.minimum(torch.maximum(x, -t), t), self.bits, self.group_size, 1.0, self.meta)
            err = (dequantize(q) - x).pow(2).sum(-1)
            if best is None:
                best, best_err = q, err
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            for f in ("codes", "scale", "lo"):
                old, new = getattr(best, f), getattr(q, f)
                setattr(best, f, torch.where(better[..., None], new, old))
        return {"codes": best.codes, "scale": best.scale, "lo": best.lo}

    def decode(self, parts):
        return dequantize(QuantizedRows(parts["codes"], parts["scale"], parts["lo"], self.bits, self.group_size))


K3_CLIP = float(os.environ.get("K3_CLIP", "1.0"))  # the clip of 3-bit keys (the artifact's ratios are for 2 bits)


class MetaCodec:
    """rotkv's token codec with a chosen metadata dtype (the quantizer's reference path)."""

    def __init__(self, bits, group_size, clip, meta):
        self.bits, self.group_size, self.clip, self.meta = bits, group_size, clip, meta

    def encode(self, x):
        q = quantize(x, self.bits, self.group_size, self.clip, self.meta)
        return {"codes": q.codes, "scale": q.scale, "lo": q.lo}

    def decode(self, parts):
        return dequantize(QuantizedRows(parts["codes"], parts["scale"], parts["lo"], self.bits, self.group_size))


def mix(r: int) -> torch.Tensor:
    return hadamard_matrix(r) if r & (r - 1) == 0 else random_orthogonal(r, 0)


class SplitCodec:
    """Pages ``[nb, H, P, D]`` -> per tier ``codes_i, scale_i, lo_i`` (one group per tier)."""

    def __init__(self, basis: torch.Tensor, tiers, clip: float):
        self.tiers, self.clip = tiers, clip
        d = basis.shape[-1]
        blocks, at = torch.zeros(d, d), 0
        for r, _ in tiers:
            blocks[at:at + r, at:at + r] = mix(r)
            at += r
        self.used = at
        self.basis = basis @ blocks  # [H, D, D]: x @ basis = tier coordinates

    def encode(self, x):
        y = torch.einsum("nhpd,hde->nhpe", x.float(), self.basis)
        parts, at = {}, 0
        for i, (r, b) in enumerate(self.tiers):
            q = quantize(y[..., at:at + r], b, r, self.clip)
            parts.update({f"codes{i}": q.codes, f"scale{i}": q.scale, f"lo{i}": q.lo})
            at += r
        return parts

    def decode(self, parts):
        segs = [dequantize(QuantizedRows(parts[f"codes{i}"], parts[f"scale{i}"], parts[f"lo{i}"], b, r))
                for i, (r, b) in enumerate(self.tiers)]
        y = torch.cat(segs, -1)
        d = self.basis.shape[-1]
        if y.shape[-1] < d:
            y = torch.cat([y, y.new_zeros(*y.shape[:-1], d - y.shape[-1])], -1)
        return torch.einsum("nhpe,hde->nhpd", y, self.basis)


def fit_bases(model, tok, artifact, tokens: int):
    """Per layer ``[H, D, D]``: eigenvectors of C_Q in the stored (rotated, centred) basis, ranked by
    eigenvalue x key variance along them. Calibration text only."""
    from rotkv.calibrate.capture import capturing
    from rotkv.calibrate.corpus import token_chunks

    n_layers = model.config.num_hidden_layers
    rots = [artifact.layer_rotation(i) for i in range(n_layers)]
    cq, ck, n = {}, {}, {}

    def rec(layer, q, k, v, out, probs):
        r = rots[layer]
        qr = r.queries(q.float())[0]  # [Hq, T, D] in the stored basis
        kr = r.keys(k.float())[0]  # [H, T, D]
        h = kr.shape[0]
        qr = qr.reshape(h, -1, qr.shape[-1])
        cq[layer] = cq.get(layer, 0) + torch.einsum("htd,hte->hde", qr, qr)
        ck[layer] = ck.get(layer, 0) + torch.einsum("htd,hte->hde", kr[:, 16:], kr[:, 16:])
        n[layer] = n.get(layer, 0) + 1

    with torch.no_grad(), capturing(model, rec):
        for c in token_chunks(tok, None, tokens, 512):
            model(c)
    bases = []
    for layer in range(n_layers):
        e, u = torch.linalg.eigh(cq[layer].double())
        var = torch.einsum("hde,hdi,hei->hi", ck[layer].double(), u, u)
        imp = e.clamp_min(0) * var
        order = torch.argsort(imp, dim=-1, descending=True)
        bases.append(torch.gather(u, 2, order[:, None, :].expand_as(u)).float())
    return bases


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["32@4"])
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--baseline", action="store_true", help="also run oscar-int2 itself")
    ap.add_argument("--artifact", default="/work/artifacts/oscar.safetensors")
    ap.add_argument("--out", default="docs/results/levers/e2e.json")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from rotkv.eval import nll
    from rotkv.eval.config import builtin_eval_texts
    from rotkv.eval.run import read_tokens
    from rotkv.hf.models import load_model
    from rotkv.rotations.artifact import load_artifact

    loaded = load_model(None, device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    art = load_artifact(args.artifact)
    t0 = time.time()
    bases = None
    if any(c.startswith("K=") for c in args.configs):
        bases = fit_bases(model, tok, art, args.calib_tokens)
        print(f"bases fitted in {time.time() - t0:.0f} s", flush=True)
    texts = builtin_eval_texts()
    ids = torch.tensor([read_tokens(tok, texts)])
    L, N = args.length, args.new_tokens
    starts = nll.window_starts(ids.shape[1], L, N, args.windows)
    refs = [(s, nll.reference(model, ids[:, s:s + L + N], L, N)) for s in starts]
    ctx = dict(model=model, ids=ids, refs=refs, length=L, new_tokens=N, sink=args.sink, window=args.window,
               artifacts={"oscar-int2": args.artifact})
    results = json.load(open(args.out)) if os.path.exists(args.out) else {"runs": {}}
    results["settings"] = {"length": L, "new_tokens": N, "windows": args.windows, "starts": starts,
                           "sink": args.sink, "window": args.window, "clip": args.clip,
                           "calib_tokens": args.calib_tokens, "texts": texts}
    plan = (["oscar-int2"] if args.baseline else []) + args.configs
    orig = dx.build_cache
    for name in plan:
        key = f"{name}/clip{args.clip}/s{args.sink}w{args.window}" + (f"p{args.page_size}" if args.page_size != 16 else "")
        if key in results["runs"]:
            continue

        def build(ctx_, preset, chunk, mod, win, name=name):
            cache = orig(ctx_, preset, chunk, mod, win)
            if name != "oscar-int2":
                apply_levers(cache, name.split("+") if not name.startswith("K=") else [name], bases, args.clip)
            return cache

        dx.build_cache = build
        t1 = time.time()
        r = dx.run_config(ctx, "oscar-int2", 512, {"spec": {"page_size": args.page_size}})
        r["seconds"] = time.time() - t1
        results["runs"][key] = r
        print(f"{key:32s} KL {r['kl']:.4f} +- {r['kl_ci95']:.4f} top1 {r['top1']:.3f} bits {r['bpe']:.3f} "
              f"({r['seconds']:.0f} s)", flush=True)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
