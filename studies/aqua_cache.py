"""Inter-layer key prediction (AQUA-KV) simulated inside rotkv's own cache, scored by ``rotkv eval``.

The study patches, in this process only, the key codec of every paged layer (``HybridLayer.key_codec``) with
:class:`AquaCodec`; everything else is rotkv as it is: the preset's tiers (sink, window and its share, pages of
16, the refine tier), its chunked prefill, its decode steps, the artifact's R_K, key means, clip ratios and
4-bit key layers, and the eval harness (windows, reference, KL, suite summary).

``AquaCodec`` encodes a body page of layer l's rotated keys ``x = (k - mu_l) R_K`` as the token codec's
per-token INT2 (or INT4) grid of the residual ``x - p``, where ``p = (pred_l(k^_{l-1}) - mu_l) R_K`` and
``k^_{l-1}`` is what layer l-1's body holds of the same tokens (its own prediction plus its decoded residual:
the 2-bit reading, without the refine tier's extra bits, which a page loses when it ages). It reads
``p + dequant(codes)``; the refine tier refines the residual's code (its 2 more bits place ``x`` in the bucket
of ``p + dequant``). ``pred_l(k) = RoPE(A_l unRoPE(k) + b_l)`` over all KV heads at once (pre-RoPE: both layers'
keys are linear images of the residual stream at the same token, so one map serves every position; unRoPE is
exact given the position). Layer 0 keeps the plain codec (nothing before it). The map is kept in the pages as
a float32 part ``pred`` (a simulation shortcut: a real cache would recompute it from layer l-1's page when
reading), left out of the cache's byte count: the measured bits are the format's, the preset's per-token bytes
(codes, fp16 scale and minimum of the residual, the tiers); the maps are per model (``--maps``: 29 x 193 x 192, kept
in fp16 and used as such).

``--mode mean`` is the control that reads no other layer: ``p = (RoPE(b_l) - mu_l) R_K``, layer l's pre-RoPE key
mean turned to each token's position (``--maps`` then holds the means).
``--mode base`` runs the same patched codec with no prediction (``p = 0``): it has to give rotkv's own KL.
``--check`` first runs a 600-token prefill and checks the positions the codec assigns to body pages against
layer 0's exact keys.

The maps are fitted on rotkv's default calibration corpus (``calib_*.txt``; never suite text), sequentially:
layer l's on the reconstructions of layer l-1 made with the maps of the layers before it (the same fit as
studies/aqua_proxy.py's ``pred-pre``), by ridge least squares on pre-RoPE keys.

    OMP_NUM_THREADS=1 PYTHONPATH=. python studies/aqua_cache.py --mode aqua --maps runs/aqua_maps.pt --check -- \
        --suite mixed --split dev --profile full --lengths 2048 --windows 2 --new-tokens 64 --threads 1 \
        --methods oscar-refine --artifact-dir artifacts --out runs/aqua/dev-aqua
"""
import argparse
import math
import os
import sys
from collections import deque

import torch

from rotkv.cache.codecs import TokenCodec
from rotkv.cache.layer import HybridLayer
from rotkv.quant.quantizer import QuantizedRows, dequantize, fake_quantize, quantize

p = argparse.ArgumentParser()
p.add_argument("--mode", choices=("base", "aqua", "mean"), required=True)
p.add_argument("--maps", default="runs/aqua_maps.pt", help="fitted maps (made here if missing)")
p.add_argument("--artifact", default="artifacts/oscar-mix-long.safetensors")
p.add_argument("--calib-tokens", type=int, default=16384)
p.add_argument("--chunk", type=int, default=2048)
p.add_argument("--ridge", type=float, default=1e-3)
p.add_argument("--check", action="store_true")
p.add_argument("eval_args", nargs=argparse.REMAINDER, help="after --: the rotkv eval arguments")
args = p.parse_args()
eval_args = args.eval_args[1:] if args.eval_args[:1] == ["--"] else args.eval_args
torch.set_num_threads(1)

_model = None


def model_and_tok():
    global _model
    if _model is None:
        from rotkv.hf.models import load_model
        L = load_model(None)
        _model = (L.model, L.tokenizer)
    return _model


def rope_tables(model, n):
    d = model.config.head_dim
    cos, sin = model.model.rotary_emb(torch.zeros(1, n, d), torch.arange(n)[None])
    return cos[0].double(), sin[0].double()


def rot_half(x):
    d = x.shape[-1]
    return torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)


def rope(x, cos, sin):  # x [H, T, D]; cos, sin [T, D]
    return x * cos + rot_half(x) * sin


def unrope(x, cos, sin):
    return x * cos - rot_half(x) * sin


def flat(x):  # [H, T, D] -> [T, H * D]
    return x.permute(1, 0, 2).reshape(x.shape[1], -1)


def unflat(x, h):
    return x.reshape(x.shape[0], h, -1).permute(1, 0, 2)


def apply_map(A, prev_post, cos, sin, h=None):
    """pred [H, T, D] post-RoPE from the previous layer's post-RoPE keys ``prev_post [H, T, D]``; a map of one
    row (``--mode mean``) is the bias alone, the pre-RoPE key mean turned to each position (``prev_post`` None)."""
    if A.shape[0] == 1:
        return rope(unflat(A.expand(cos.shape[0], -1), h), cos, sin)
    src = flat(unrope(prev_post, cos, sin))
    x = torch.cat([src, torch.ones(src.shape[0], 1, dtype=src.dtype)], -1)
    return rope(unflat(x @ A, prev_post.shape[0]), cos, sin)


def fit_maps(path, bias_only=False):
    """Sequential ridge fit of A_1 .. A_{L-1} on the calibration corpus; saves {"A": [None, A_1, ...]} (fp16).
    ``bias_only``: each A_l is the pre-RoPE key mean of layer l alone ([1, H * D])."""
    from rotkv.calibrate.capture import capturing
    from rotkv.calibrate.corpus import token_chunks
    from rotkv.rotations.artifact import load_artifact

    model, tok = model_and_tok()
    art = load_artifact(args.artifact)
    nl, h, d = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    kb = art.tensors["k_bits"].tolist()
    clip = [float(x) for x in art.meta["clip_k"].split(",")]
    rk = [art.tensors[f"R_K.{l}"].double().expand(h, d, d) for l in range(nl)]
    mu = [art.tensors[f"k_mean.{l}"].double() for l in range(nl)]

    def store(x, l):  # what layer l's body holds of x [H, T, D] (centred key or residual), unrotated
        xr = torch.einsum("htd,hde->hte", x, rk[l])
        xq = fake_quantize(xr.float(), kb[l], 64, clip[l] if kb[l] == 2 else 1.0).double()
        return torch.einsum("hte,hde->htd", xq, rk[l])

    calib = []
    for ids in token_chunks(tok, None, args.calib_tokens, args.chunk):
        got = {}
        with torch.no_grad(), capturing(model, lambda l, q, k, v, o, pr: got.__setitem__(l, k[0].double())):
            model(input_ids=ids)
        calib.append([got[l] for l in range(nl)])
    cos, sin = rope_tables(model, args.chunk)
    rec = [store(c[0] - mu[0][:, None], 0) + mu[0][:, None] for c in calib]
    maps = [None]
    for l in range(1, nl):
        x = torch.cat([torch.cat([flat(unrope(r, cos, sin))[16:], torch.ones(args.chunk - 16, 1, dtype=torch.float64)], -1)
                       for r in rec])
        y = torch.cat([flat(unrope(c[l], cos, sin))[16:] for c in calib])
        if bias_only:
            maps.append(y.mean(0, keepdim=True).half())
            continue
        g = x.T @ x
        reg = torch.eye(g.shape[0], dtype=g.dtype) * args.ridge * torch.diagonal(g)[:-1].mean()
        reg[-1, -1] = 0
        A = torch.linalg.solve(g + reg, x.T @ y).half()
        maps.append(A)
        Ad = A.double()
        new = []
        for c, r in zip(calib, rec):
            pr = apply_map(Ad, r, cos, sin)
            new.append(pr + store(c[l] - pr, l))
        rec = new
        print(f"fit layer {l}", flush=True)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torch.save({"A": maps, "bias_only": bias_only, "artifact": args.artifact, "calib_tokens": args.calib_tokens, "chunk": args.chunk,
                "ridge": args.ridge}, path)


class Chain:
    """What the layers' key codecs share within one forward: layer l-1's reconstructions, oldest first."""

    def __init__(self, maps, cos, sin, sink):
        self.maps, self.cos, self.sin, self.sink = maps, cos, sin, sink
        self.queue: dict[int, deque] = {}
        self.check = None  # (layer-0 exact keys [H, T, D], max error list) in --check


class AquaCodec(TokenCodec):
    def __init__(self, base: TokenCodec, layer: int, rotation, chain: Chain):
        super().__init__(base.bits, base.group_size, base.clip, base.meta)
        self.layer, self.chain = layer, chain
        self.R = rotation.R_K.float()  # [H or 1, D, D]
        self.mu = rotation.k_mean.float()  # [H, D]
        self.pages = 0

    def empty_parts(self, kv_heads, page, head_dim, device=None):
        parts = super().empty_parts(kv_heads, page, head_dim, device)
        parts["pred"] = torch.zeros(0, kv_heads, page, head_dim, dtype=torch.float32, device=device)
        return parts

    def _unrotate(self, xr):  # [H, T, D] rotated centred -> post-RoPE keys
        return torch.einsum("hte,hde->htd", xr, self.R.expand(xr.shape[0], -1, -1)) + self.mu[:, None]

    def _rotate(self, k):
        return torch.einsum("htd,hde->hte", k - self.mu[:, None], self.R.expand(k.shape[0], -1, -1))

    def encode(self, x):
        nb, h, pg, d = x.shape
        ch = self.chain
        pos = (ch.sink + pg * (self.pages + torch.arange(nb))[:, None] + torch.arange(pg)[None]).reshape(-1)
        self.pages += nb
        xs = x.float().permute(1, 0, 2, 3).reshape(h, nb * pg, d)  # [H, T, D]
        if ch.check is not None and self.layer == 0:
            exact, errs = ch.check
            errs.append(((self._unrotate(xs) - exact[:, pos]).abs().max() / exact.abs().max()).item())
        if ch.maps is None or self.layer == 0:
            pred = torch.zeros_like(xs)
        elif ch.maps[self.layer].shape[0] == 1:
            pred = self._rotate(apply_map(ch.maps[self.layer], None, ch.cos[pos], ch.sin[pos], h).float())
        else:
            ppos, prev = ch.queue[self.layer - 1].popleft()
            if not torch.equal(ppos, pos):
                raise RuntimeError(f"layer {self.layer}: the previous layer's pages are at other positions")
            pp = apply_map(ch.maps[self.layer], prev.double(), ch.cos[pos], ch.sin[pos])
            pred = self._rotate(pp.float())
        q = quantize(xs - pred, self.bits, self.group_size, self.clip, self.meta)
        if ch.maps is not None and self.layer + 1 < len(ch.maps) and ch.maps[self.layer + 1].shape[0] > 1:
            recon = pred + dequantize(q)
            ch.queue.setdefault(self.layer, deque()).append((pos, self._unrotate(recon)))
        to_pages = lambda t: t.reshape(t.shape[0], nb, pg, t.shape[-1]).permute(1, 0, 2, 3).contiguous()  # noqa: E731
        return {"codes": to_pages(q.codes), "scale": to_pages(q.scale), "lo": to_pages(q.lo), "pred": to_pages(pred)}

    def decode(self, parts):
        x = dequantize(QuantizedRows(parts["codes"], parts["scale"], parts["lo"], self.bits, self.group_size))
        return x + parts["pred"]


def install(chain):
    orig = HybridLayer.lazy_initialization

    def lazy_initialization(self, key_states, value_states):
        if isinstance(self.key_codec, TokenCodec) and not isinstance(self.key_codec, AquaCodec):
            self.key_codec = AquaCodec(self.key_codec, self.layer_idx, self.rotation_cpu, chain)
        out = orig(self, key_states, value_states)
        if isinstance(self.key_codec, AquaCodec):  # the cache's bytes: the format's, without the simulation's part
            pred = self.pools.body[0]["pred"]
            self.pools.body_page_bytes -= math.prod(pred.shape[1:]) * pred.element_size()
        return out

    HybridLayer.lazy_initialization = lazy_initialization


def main():
    from rotkv.config import PRESETS

    maps = None
    if args.mode != "base":
        if not os.path.exists(args.maps):
            fit_maps(args.maps, bias_only=args.mode == "mean")
        saved = torch.load(args.maps)
        if saved["bias_only"] != (args.mode == "mean"):
            raise SystemExit(f"--maps {args.maps} was fitted for the other mode")
        maps = [None if a is None else a.double() for a in saved["A"]]
    model, _ = model_and_tok()
    cos, sin = rope_tables(model, 16384)
    chain = Chain(maps, cos, sin, PRESETS["oscar-refine"].sink)
    install(chain)
    if args.check:
        from rotkv.cache import RotkvCache
        from rotkv.calibrate.capture import capturing
        from rotkv.eval.protocol import forward, prefill

        model, tok = model_and_tok()
        with open("rotkv/data/calib_licenses.txt") as f:
            ids = tok(f.read(), return_tensors="pt").input_ids[:, :600]
        got = {}
        with torch.no_grad(), capturing(model, lambda l, q, k, v, o, pr: got.__setitem__(l, k[0].float())):
            model(input_ids=ids)
        errs = []
        chain.check = (got[0], errs)
        cache = RotkvCache(model, "oscar-refine", args.artifact, context_length=600)
        prefill(model, cache, ids[:, :560], 512)
        for t in range(560, 599):
            forward(model, ids[:, t:t + 1], cache)
        chain.check = None
        chain.queue.clear()
        print(f"check: {len(errs)} key encodes of layer 0, max relative error of the assigned positions' keys "
              f"{max(errs):.2e} (bf16 tier rounding ~4e-3)", flush=True)
        if max(errs) > 1e-2:
            raise SystemExit("check failed: the codec's positions are not the body pages' positions")
    from rotkv.cli import main as cli_main

    sys.exit(cli_main(["eval", *eval_args]))


if __name__ == "__main__":
    main()
