"""Key-quantization schemes compared on the attention-logit error, before any end-to-end run.

For each layer and KV head of the default model, post-RoPE queries and keys are captured on the
built-in calibration text; the query covariance ``C_Q`` (pooled over the query heads of the KV head),
the key mean and the eigenbasis are fitted on the first half of the tokens and every scheme is scored
on the second half by the relative logit error

    E = mean_k (dk^T C_Q dk) / mean_k (kc^T C_Q kc),     dk = k_hat - kc,  kc = k - mu,

i.e. the mean squared error of ``q . k`` over all query-key pairs, relative to the centred logits'
own power. Bits per key element are nominal: codes plus fp16 metadata per group.

Schemes (D = 64, fp16 metadata):
- ``oscar-int{2,4}``: R = U H P (OSCAR), per-token groups of 64, clip ``--clip``;
- ``eig-drop-r-b``: keep the r eigen-directions with the largest ``lambda_i * sigma_i^2`` (query energy
  times key variance), mix them with a Hadamard of size r and quantize them at b bits in one group;
  the other directions are stored as zero (the key mean);
- ``eig-split``: the top r directions at b1 bits, the rest at b2 bits, each part its own group.
"""

from __future__ import annotations

import argparse
import json

import torch

from rotkv.calibrate.capture import capturing
from rotkv.calibrate.corpus import token_chunks
from rotkv.hf.models import load_model
from rotkv.quant.quantizer import clip_rows
from rotkv.rotations.hadamard import hadamard_matrix
from rotkv.rotations.identity import random_orthogonal
from rotkv.rotations.oscar import oscar_rotation


def capture(model, chunks):
    got = ({}, {}, {}, {})

    def rec(layer, q, k, v, out, probs):
        for store, t in zip(got, (q, k, v, out)):
            store.setdefault(layer, []).append(t[0].float())

    with torch.no_grad(), capturing(model, rec):
        for c in chunks:
            model(c)
    return tuple({l: torch.cat(v, 1) for l, v in store.items()} for store in got)


def fake_quantize(x, bits, group, clip):
    """Asymmetric min/max quantization per group of ``group`` dims after per-row quantile clipping
    (the quantizer of METHODS section 1, any bit width, metadata kept in float32)."""
    x = clip_rows(x, clip)
    g = x.reshape(*x.shape[:-1], -1, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = ((hi - lo) / ((1 << bits) - 1)).clamp_min(1e-12)
    return (torch.round((g - lo) / s).clamp(0, (1 << bits) - 1) * s + lo).reshape(x.shape)


def quant_part(x, bits, clip):
    """Per-row: Hadamard-mix x [N, r] then quantize as one group."""
    r = x.shape[-1]
    h = hadamard_matrix(r) if r & (r - 1) == 0 else random_orthogonal(r, 0)
    y = fake_quantize(x @ h, bits, r, clip)
    return y @ h.T


SPLITS = {  # name -> tiers of (directions, bits); bits 0 = not stored, 1 = sign x mean |x|
    "eig-32@4": ((32, 4),),
    "eig-32@3": ((32, 3),),
    "eig-24@5": ((24, 5),),
    "eig-40@3": ((40, 3),),
    "eig-48@3": ((48, 3),),
    "eig-16@6+16@3": ((16, 6), (16, 3)),
    "eig-16@5+16@3": ((16, 5), (16, 3)),
    "eig-32@4+32@1": ((32, 4), (32, 1)),
    "eig-16@4+48@2": ((16, 4), (48, 2)),
    "eig-32@3+32@1": ((32, 3), (32, 1)),
    "eig-32@4+16@2": ((32, 4), (16, 2)),
    "eig-64@2": ((64, 2),),
}


def split_quant(y, tiers, clip):
    hat, at, bits = torch.zeros_like(y), 0, 0.0
    for r, b in tiers:
        part = y[:, at:at + r]
        if b == 1:
            hat[:, at:at + r], bits = _int1(part), bits + r + 16
        elif b > 1:
            hat[:, at:at + r], bits = quant_part(part, b, clip), bits + r * b + 32
        at += r
    return hat, bits / y.shape[-1]


def schemes(fit, x, weight, rot, clip, splits):
    """Yields (name, x_hat, bits per element): ``rot`` (OSCAR) at 2 and 4 bits, then the eigen splits
    of ``weight`` ranked by eigenvalue x variance of ``fit`` along the eigenvector."""
    d = x.shape[-1]
    for b in (2, 4):
        yield f"oscar-int{b}", fake_quantize(x @ rot, b, d, clip) @ rot.T, b + 32 / d
    e, u = torch.linalg.eigh(weight.double())
    u = u.float()
    imp = e.float().clamp_min(0) * ((fit @ u) ** 2).mean(0)
    order = torch.argsort(imp, descending=True)
    ub = u[:, order]
    y = x @ ub
    for name in splits:
        hat, bits = split_quant(y, SPLITS[name], clip)
        yield name, hat @ ub.T, bits
    yield "imp-share-top32", None, float(imp[order[:32]].sum() / imp.sum())


def _int1(x):
    """1 bit per element with a Hadamard mix: sign times the row's mean |x| (one fp16 scale, lo = -scale)."""
    r = x.shape[-1]
    h = hadamard_matrix(r)
    z = x @ h
    s = z.abs().mean(-1, keepdim=True)
    return (torch.sign(z) * s) @ h.T


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--clip", type=float, default=0.96)
    ap.add_argument("--splits", nargs="+", default=list(SPLITS), choices=list(SPLITS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    loaded = load_model(None)
    model, tok = loaded.model, loaded.tokenizer
    chunks = token_chunks(tok, None, args.tokens, 512)
    half = len(chunks) // 2
    qf, kf, vf, of = capture(model, chunks[:half])
    qe, ke, ve, oe = capture(model, chunks[half:])
    n_rep = qf[0].shape[0] // kf[0].shape[0]
    d = kf[0].shape[-1]
    rows = []
    for layer in sorted(kf):
        w_o = model.model.layers[layer].self_attn.o_proj.weight.detach().float()
        for h in range(kf[layer].shape[0]):
            heads = range(h * n_rep, (h + 1) * n_rep)
            qfit = qf[layer][h * n_rep:(h + 1) * n_rep].reshape(-1, d)
            cq = qfit.T @ qfit / qfit.shape[0]
            ofit = of[layer][h * n_rep:(h + 1) * n_rep].reshape(-1, d)
            cs = ofit.T @ ofit / ofit.shape[0]
            m = sum(w_o[:, j * d:(j + 1) * d].T @ w_o[:, j * d:(j + 1) * d] for j in heads)
            mu = kf[layer][h].mean(0)
            for kind, fit, x, weight, rot in (
                ("k", kf[layer][h] - mu, ke[layer][h][16:] - mu, cq, oscar_rotation(cq)),
                ("v", vf[layer][h], ve[layer][h][16:], m, oscar_rotation(cs)),
            ):
                base = (x @ weight * x).sum(-1).mean()
                for name, hat, bits in schemes(fit, x, weight, rot, args.clip, args.splits):
                    if hat is None:
                        rows.append({"layer": layer, "head": h, "kv": kind, "scheme": name, "value": bits})
                        continue
                    dx = hat - x
                    err = float((dx @ weight * dx).sum(-1).mean() / base)
                    rows.append({"layer": layer, "head": h, "kv": kind, "scheme": name, "rel_err": err, "bits": bits})
    for kind in ("k", "v"):
        print(f"--- {kind}: relative error of q.k ({kind}=k) or of o W_O^T (v)")
        report([r for r in rows if r["kv"] == kind])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


def report(rows):
    names = list(dict.fromkeys(r["scheme"] for r in rows))
    print(f"{'scheme':28s} {'bits':>5s} {'mean rel err':>12s} {'L15-24':>8s} {'max':>8s}")
    for n in names:
        rs = [r for r in rows if r["scheme"] == n]
        if "rel_err" not in rs[0]:
            print(f"{n:28s} share of lambda*sigma^2 in the top 32: {sum(r['value'] for r in rs) / len(rs):.3f}")
            continue
        mid = [r["rel_err"] for r in rs if 15 <= r["layer"] <= 24]
        print(f"{n:28s} {rs[0]['bits']:5.2f} {sum(r['rel_err'] for r in rs) / len(rs):12.4f} "
              f"{sum(mid) / len(mid):8.4f} {max(r['rel_err'] for r in rs):8.4f}")


if __name__ == "__main__":
    main()
