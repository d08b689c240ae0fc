"""Offline proxy for the key scaling (rotkv.rotations.keyscale) before any end-to-end run: the relative error
of the attention output when only the keys are quantized as oscar-refine's body stores them (2 bits clipped at
the artifact's ratio, or 4 bits unclipped in its 4-bit key layers; sink 4 and the newest 32 tokens exact), over
the last 256 queries of a 2048-token window, per layer. Statistics (C_Q, C_K) from 4 x 512 tokens of the default
calibration corpus; R_K and the key mean are the artifact's. Variants: alpha 0 (OSCAR), 0.5, and "full" (the
general linear map T minimizing tr(T^T C_K T) tr(T^-1 C_Q T^-T): whitened keys, then C_Q's eigenbasis).

    OMP_NUM_THREADS=1 PYTHONPATH=. python studies/key_scale_proxy.py rotkv/data/suite/prose_dev.txt \
        rotkv/data/suite/code_dev.txt     # reads artifacts/oscar-mix-long.safetensors
"""
import sys

import torch

torch.set_num_threads(1)
from rotkv.hf.models import load_model
from rotkv.calibrate.capture import capturing
from rotkv.calibrate.corpus import token_chunks
from rotkv.rotations.artifact import load_artifact
from rotkv.quant.quantizer import quantize, dequantize

L = load_model(None)
model, tok = L.model, L.tokenizer
art = load_artifact("artifacts/oscar-mix-long.safetensors")
nl = model.config.num_hidden_layers
kbits = art.tensors["k_bits"].tolist()
clip = [float(x) for x in art.meta["clip_k"].split(",")]
RK = [art.tensors[f"R_K.{l}"].double() for l in range(nl)]
MU = [art.tensors[f"k_mean.{l}"].double() for l in range(nl)]

def capture(ids):
    got = {}
    def rec(layer, q, k, v, out, probs):
        got[layer] = (q[0].double(), k[0].double(), v[0].double())
    with torch.no_grad(), capturing(model, rec):
        model(input_ids=ids)
    return got

# stats on calibration text: 4 chunks of 512
cq = [0]*nl; ck = [0]*nl
for ids in token_chunks(tok, None, 2048, 512):
    g = capture(ids)
    for l,(q,k,v) in g.items():
        h = k.shape[0]
        qr = torch.einsum("hgtd,hde->hgte", q.reshape(h, -1, q.shape[1], 64), RK[l]).reshape(-1, 64)
        kr = torch.einsum("htd,hde->hte", k[:, 16:] - MU[l][:, None], RK[l]).reshape(-1, 64)
        cq[l] = cq[l] + qr.T @ qr / qr.shape[0]
        ck[l] = ck[l] + kr.T @ kr / kr.shape[0]

def mats(l, alpha):
    if alpha == 0: return RK[l], RK[l]
    if alpha == "full":
        e, W = torch.linalg.eigh(cq[l])
        ek, U = torch.linalg.eigh(ck[l])
        ek = ek.clamp_min(ek.max() * 1e-4)
        kh, kih = U @ torch.diag(ek.sqrt()) @ U.T, U @ torch.diag(ek.rsqrt()) @ U.T
        mu_, V = torch.linalg.eigh(kh @ cq[l] @ kh)
        d = mu_.clamp_min(mu_.max() * 1e-6) ** -0.25
        T = kih @ V @ torch.diag(d)
        s_ = (torch.einsum("di,de,ei->i", T, ck[l], T).mean()) ** 0.5
        T = T / s_
        MK = RK[l] @ T @ W.T
        MQ = RK[l] @ torch.linalg.inv(T).T @ W.T
        return MK, MQ
    e, W = torch.linalg.eigh(cq[l])           # eigenbasis of C_Q in the rotated coordinates
    lam = e.clamp_min(1e-12)
    kap = torch.einsum("di,de,ei->i", W, ck[l], W).clamp_min(1e-12)
    a = (lam / kap) ** (alpha / 4)            # a^2 ∝ (lam/kap)^(alpha/2)
    a = a / a.pow(2).mean().sqrt()
    MK = RK[l] @ W @ torch.diag(a) @ W.T
    MQ = RK[l] @ W @ torch.diag(1 / a) @ W.T
    return MK, MQ

def attn_err(q, k, v, kq, n=256):
    # q [Hq,T,D]; k,kq [H,T,D] (kq: dequantized key in original basis); last n queries, causal
    h = k.shape[0]; r = q.shape[0] // h; T = k.shape[1]
    qq = q[:, -n:]
    errs = []
    for kk in (k, kq):
        s = torch.einsum("hqd,htd->hqt", qq, kk.repeat_interleave(r, 0)) / 8
        mask = torch.ones(n, T, dtype=torch.bool).tril(T - n)
        s = s.masked_fill(~mask, float("-inf"))
        errs.append(torch.softmax(s, -1) @ v.repeat_interleave(r, 0))
    return ((errs[1] - errs[0]).norm(dim=-1) / errs[0].norm(dim=-1)).mean().item()

alphas = [0, 0.5, 1.0, 'full']
files = sys.argv[1:]
res = {a: [0.0]*nl for a in alphas}
nw = 0
for f in files:
    ids = token_chunks(tok, [f], 2048, 2048)[0]
    g = capture(ids); nw += 1
    for l,(q,k,v) in g.items():
        for a in alphas:
            MK, MQ = mats(l, a)
            kr = torch.einsum("htd,hde->hte", k - MU[l][:, None], MK)
            b = kbits[l]
            c = 1.0 if b != 2 else clip[l]
            kd = dequantize(quantize(kr.float(), b, 64, c)).double()
            # back to the original basis: k_hat = kd MQ^T + mu  (MK MQ^T = I)
            kh = torch.einsum("hte,hde->htd", kd, MQ) + MU[l][:, None]
            kh[:, :4] = k[:, :4]; kh[:, -32:] = k[:, -32:]
            res[a][l] += attn_err(q, k, v, kh)
for a in alphas:
    print(a, "mean", sum(res[a])/nl/nw, " ".join(f"{x/nw:.3f}" for x in res[a]))
