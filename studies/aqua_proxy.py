"""Offline proxy for inter-layer key prediction (AQUA-KV) on top of oscar-mix-long's key format, before any
end-to-end run.

Each layer's keys are stored as oscar-refine's body stores them: per token, in the artifact's OSCAR basis R_K,
2 bits clipped at the artifact's per-layer ratio (4 bits unclipped in its 4-bit key layers), one group of 64,
fp16 scale and minimum. With prediction, layer l stores instead the residual

    r_l = k_l - p_l,   p_l = RoPE(A_l unRoPE(k^_{l-1}) + b_l)     (post-RoPE keys, [tokens, kv_heads * D])

quantized the same way in the same basis (no key mean: b_l takes its place), and reads k^_l = p_l + Q(r_l).
k^_{l-1} is the previous layer's reconstruction (what its cache holds), so the fit is sequential: layer l's
map is fitted on calibration reconstructions made with the maps of layers < l. The map acts on pre-RoPE keys
(unRoPE is exact: RoPE is an orthogonal rotation per position, known from the position), because there both
keys are linear images of the residual stream at the same token and the relation does not depend on the
position; ``--space post`` fits one map on post-RoPE keys instead, for comparison. ``oracle`` predicts from
the exact previous keys (an upper bound; not storable). ``mean-pre`` is the control that reads no other layer:
``p_l = RoPE(b_l)``, the pre-RoPE key mean turned to each token's position, in place of the post-RoPE mean mu
(which averages the rotating part of the keys away). Layer 0 keeps the plain format in every variant.
``--ranks 16,48`` adds ``pred-pre-r16``, ``pred-pre-r48``: maps of rank r (192 x r and r x 192 plus the bias, in
place of 193 x 192), fitted the same way (``--only-ranks``: base and those only):

    OMP_NUM_THREADS=1 PYTHONPATH=. python studies/aqua_proxy.py rotkv/data/suite/{prose,code,docs,dialogue}_dev.txt \
        --ranks 16,48 --only-ranks --out docs/results/levers-aqua/proxy_rank.json

A_l is [192 + 1, 192] (all 3 KV heads of layer l-1 to all of layer l's), ridge least squares. Fitted on
``--calib-tokens`` of rotkv's default calibration corpus (calib_*.txt, chunks of ``--chunk``), never suite text;
the first 16 tokens of each chunk (the attention sink) are left out of the fit.

Measured on one 2048-token window of each dev file given, per layer:
- key error: ||k^ - k|| / ||k - mu|| over the body tokens (after the sink 4, before the newest 32);
- attention-output error (as studies/key_scale_proxy.py): relative error of the attention output of the last
  256 queries with only the keys quantized (sink 4 and the newest 32 tokens exact), values exact.

    OMP_NUM_THREADS=1 PYTHONPATH=. python studies/aqua_proxy.py rotkv/data/suite/{prose,code,docs,dialogue}_dev.txt \
        --out docs/results/levers-aqua/proxy.json       # reads artifacts/oscar-mix-long.safetensors
"""
import argparse
import json
import math

import torch

torch.set_num_threads(1)
from rotkv.calibrate.capture import capturing
from rotkv.calibrate.corpus import token_chunks
from rotkv.hf.models import load_model
from rotkv.quant.quantizer import fake_quantize
from rotkv.rotations.artifact import load_artifact

p = argparse.ArgumentParser()
p.add_argument("files", nargs="+")
p.add_argument("--artifact", default="artifacts/oscar-mix-long.safetensors")
p.add_argument("--calib-tokens", type=int, default=16384)
p.add_argument("--chunk", type=int, default=2048)
p.add_argument("--ridge", type=float, default=1e-3, help="ridge, relative to the mean input variance")
p.add_argument("--out", default=None)
p.add_argument("--ranks", default="", help="comma-separated ranks r: also pred-pre with rank-r maps (reduced-rank "
               "regression: the full map projected on the top r right singular vectors of its fitted values)")
p.add_argument("--only-ranks", action="store_true", help="run base and the rank-r variants only")
args = p.parse_args()

L = load_model(None)
model, tok = L.model, L.tokenizer
art = load_artifact(args.artifact)
NL = model.config.num_hidden_layers
H, D = model.config.num_key_value_heads, model.config.head_dim
KB = art.tensors["k_bits"].tolist()
CLIP = [float(x) for x in art.meta["clip_k"].split(",")]
RK = [art.tensors[f"R_K.{l}"].double().expand(H, D, D) for l in range(NL)]
MU = [art.tensors[f"k_mean.{l}"].double() for l in range(NL)]
SINK, WIN, NQ = 4, 32, 256


def rope_tables(n):
    pos = torch.arange(n)[None]
    cos, sin = model.model.rotary_emb(torch.zeros(1, n, D), pos)
    return cos[0].double(), sin[0].double()  # [T, D]


def rot_half(x):
    return torch.cat((-x[..., D // 2:], x[..., : D // 2]), -1)


def rope(x, cs):  # x [H, T, D]
    return x * cs[0] + rot_half(x) * cs[1]


def unrope(x, cs):
    return x * cs[0] - rot_half(x) * cs[1]


def capture(ids):
    """Per layer: q [Hq, T, D], post-RoPE k [H, T, D], v [H, T, D] (float64)."""
    got = {}

    def rec(layer, q, k, v, out, probs):
        got[layer] = (q[0].double(), k[0].double(), v[0].double())

    with torch.no_grad(), capturing(model, rec):
        model(input_ids=ids)
    return got


def store(x, l):
    """What layer l's body holds of x [H, T, D] (post-RoPE, centred or residual), in the unrotated basis."""
    xr = torch.einsum("htd,hde->hte", x, RK[l])
    b = KB[l]
    xq = fake_quantize(xr.float(), b, 64, CLIP[l] if b == 2 else 1.0).double()
    return torch.einsum("hte,hde->htd", xq, RK[l])


def flat(x):  # [H, T, D] -> [T, H * D]
    return x.permute(1, 0, 2).reshape(x.shape[1], -1)


def unflat(x):
    return x.reshape(x.shape[0], H, D).permute(1, 0, 2)


def predict(A, prev, cs, space):
    """p_l [H, T, D] post-RoPE from the previous layer's post-RoPE keys prev [H, T, D] (A of one row: the
    bias alone, a pre-RoPE key mean turned to each position)."""
    src = unrope(prev, cs) if space == "pre" else prev
    x = torch.cat([flat(src), torch.ones(src.shape[1], 1, dtype=src.dtype)], -1)
    if A.shape[0] == 1:
        x = x[:, -1:]
    out = unflat(x @ A)
    return rope(out, cs) if space == "pre" else out


def fit(src_list, dst_list, bias_only=False, rank=0):
    x = torch.cat([torch.cat([s, torch.ones(s.shape[0], 1, dtype=s.dtype)], -1) for s in src_list])
    if bias_only:
        return torch.cat(dst_list).mean(0, keepdim=True)
    y = torch.cat(dst_list)
    g = x.T @ x
    lam = args.ridge * torch.diagonal(g)[:-1].mean()
    reg = torch.eye(g.shape[0], dtype=g.dtype) * lam
    reg[-1, -1] = 0
    A = torch.linalg.solve(g + reg, x.T @ y)
    if rank:  # weights projected on the top-r directions of the centred fitted values; the bias refitted
        xc = x[:, :-1] - x[:, :-1].mean(0)
        v = torch.linalg.svd(xc @ A[:-1], full_matrices=False).Vh[:rank]
        w = A[:-1] @ v.T @ v
        A = torch.cat([w, (y.mean(0) - x[:, :-1].mean(0) @ w)[None]])
    return A


def variants_reconstruct(keys, cs, maps):
    """Reconstructions per variant of a window's post-RoPE keys (list over layers of [H, T, D])."""
    out = {}
    out["base"] = [store(k - MU[l][:, None], l) + MU[l][:, None] for l, k in enumerate(keys)]
    for name, (space, oracle, *_) in VARIANTS.items():
        rec = [out["base"][0]]
        for l in range(1, NL):
            prev = keys[l - 1] if oracle else rec[l - 1]
            pr = predict(maps[name][l], prev, cs, space)
            rec.append(pr + store(keys[l] - pr, l))
        out[name] = rec
    for name, rec in out.items():  # sink and window exact
        for l in range(NL):
            rec[l][:, :SINK] = keys[l][:, :SINK]
            rec[l][:, -WIN:] = keys[l][:, -WIN:]
    return out


# name: (space of the map, predict from exact previous keys, bias only)
VARIANTS = {"mean-pre": ("pre", False, True), "pred-pre": ("pre", False, False), "pred-post": ("post", False, False),
            "oracle-pre": ("pre", True, False)}
if args.only_ranks:
    VARIANTS = {}
for r in filter(None, args.ranks.split(",")):
    VARIANTS[f"pred-pre-r{r}"] = ("pre", False, False, int(r))

# ---- calibration: sequential fit on the reconstructions
chunks = token_chunks(tok, None, args.calib_tokens, args.chunk)
print(f"calibration: {len(chunks)} chunks of {args.chunk}", flush=True)
cs = rope_tables(args.chunk)
calib = []
for ids in chunks:
    g = capture(ids)
    calib.append([g[l][1] for l in range(NL)])
maps = {name: [None] * NL for name in VARIANTS}
expl = {name: [None] * NL for name in VARIANTS}
for name, (space, oracle, bias_only, *rank) in VARIANTS.items():
    rec = [store(c[0] - MU[0][:, None], 0) + MU[0][:, None] for c in calib]
    for l in range(1, NL):
        srcs = [(c[l - 1] if oracle else r) for c, r in zip(calib, rec)]
        sx = [flat(unrope(s, cs) if space == "pre" else s)[16:] for s in srcs]
        dy = [flat(unrope(c[l], cs) if space == "pre" else c[l])[16:] for c in calib]
        A = fit(sx, dy, bias_only, *rank)
        maps[name][l] = A
        new = []
        num = den = 0.0
        for c, s in zip(calib, srcs):
            pr = predict(A, s, cs, space)
            num += (c[l] - pr)[:, 16:].pow(2).sum().item()
            den += (c[l] - MU[l][:, None])[:, 16:].pow(2).sum().item()
            new.append(pr + store(c[l] - pr, l))
        expl[name][l] = 1 - num / den
        rec = new
    print(name, "calibration: residual variance share per layer",
          " ".join(f"{1 - e:.2f}" for e in expl[name][1:]), flush=True)
del calib


def attn_err(q, k, v, kq, n=NQ):
    h = k.shape[0]
    r = q.shape[0] // h
    T = k.shape[1]
    qq = q[:, -n:]
    outs = []
    for kk in (k, kq):
        s = torch.einsum("hqd,htd->hqt", qq, kk.repeat_interleave(r, 0)) / math.sqrt(D)
        mask = torch.ones(n, T, dtype=torch.bool).tril(T - n)
        s = s.masked_fill(~mask, float("-inf"))
        outs.append(torch.softmax(s, -1) @ v.repeat_interleave(r, 0))
    return ((outs[1] - outs[0]).norm(dim=-1) / outs[0].norm(dim=-1)).mean().item()


names = ["base"] + list(VARIANTS)
res = {"key_err": {n: [[0.0] * NL for _ in args.files] for n in names},
       "attn_err": {n: [[0.0] * NL for _ in args.files] for n in names},
       "calib_residual_share": {n: [None] + [1 - e for e in expl[n][1:]] for n in VARIANTS},
       "files": args.files, "k_bits": KB, "args": vars(args)}
for fi, f in enumerate(args.files):
    ids = token_chunks(tok, [f], 2048, 2048, kind="eval")[0]
    g = capture(ids)
    cs_w = rope_tables(ids.shape[1])
    keys = [g[l][1] for l in range(NL)]
    recs = variants_reconstruct(keys, cs_w, maps)
    for n in names:
        for l in range(NL):
            k = keys[l]
            body = slice(SINK, k.shape[1] - WIN)
            e = (recs[n][l] - k)[:, body].pow(2).sum().sqrt() / (k - MU[l][:, None])[:, body].pow(2).sum().sqrt()
            res["key_err"][n][fi][l] = e.item()
            res["attn_err"][n][fi][l] = attn_err(g[l][0], k, g[l][2], recs[n][l])
    for n in names:
        print(f, n, "key err mean %.4f" % (sum(res["key_err"][n][fi]) / NL),
              "attn err mean %.4f" % (sum(res["attn_err"][n][fi]) / NL), flush=True)

print("\nper layer (mean over files): attn err")
for n in names:
    per = [sum(res["attn_err"][n][fi][l] for fi in range(len(args.files))) / len(args.files) for l in range(NL)]
    print(f"{n:11s} mean {sum(per) / NL:.4f} | " + " ".join(f"{x:.3f}" for x in per))
print("per layer (mean over files): key err")
for n in names:
    per = [sum(res["key_err"][n][fi][l] for fi in range(len(args.files))) / len(args.files) for l in range(NL)]
    print(f"{n:11s} mean {sum(per) / NL:.4f} | " + " ".join(f"{x:.3f}" for x in per))
if args.out:
    with open(args.out, "w") as fh:
        json.dump(res, fh, indent=1)
