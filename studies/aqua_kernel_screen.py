"""Offline screen: which inter-layer key prediction could a one-layer decode kernel afford?

oscar-aqua predicts each layer's keys from the previous layer's reconstructed keys through a dense map that acts
before RoPE (``rotkv.cache.predict``). It lowers the KL at equal bits, but a layer's read needs every earlier
layer's keys (a chain), and the map needs unRoPE / RoPE per token: no decode kernel reads it (its step:
docs/results/gpu-h100-run14). This screen measures, on held-out text, how much of
the chain's gain survives two restrictions a kernel could afford:

- **no chain**: even layers store their keys plainly; an odd layer predicts from the layer before it, a plain one
  (its kernel reads one more layer's key codes, no recursion);
- **a map per KV head** (``head``): aqua's dense map before RoPE restricted to each head from the same head, a
  ``D x D`` map per head (``H D^2`` multiply-adds a token against ``(H D)^2``);
- **a map that commutes with RoPE**: post-RoPE, per frequency pair, a complex H x H matrix across the KV heads
  (``cross``) or one complex number per head (``diag``). RoPE multiplies pair ``i`` of position ``s`` by
  ``exp(j theta_i s)``, and a complex-linear map at one frequency commutes with that, so the kernel applies it to
  the dequantized previous keys as they are, with no sine or cosine and no bias.

Metric, per layer: the score error energy ``sum_h tr(M_h C_h)`` of the stored keys, with ``M_h`` the second moment
of the post-RoPE queries that read KV head ``h`` and ``C_h`` that of the key error (stored minus true, each stored
key as the layer's body holds it: rotated by the artifact's ``R_K``, quantized at its width and clip ratio,
turned back). Reported as a ratio to the plain store of the same layer, and summed over layers.

    PYTHONPATH=. python studies/aqua_kernel_screen.py --artifact artifacts/suite8k/oscar-mix-long.safetensors \
        --out docs/results/aqua-kernel-screen/screen.json

Fit: the calibration corpus (``--fit-tokens``, chunks of 2048); evaluation: the suite's dev split, one chunk of
2048 tokens per domain. The first 16 tokens of every chunk (the sink) are left out of both.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from rotkv.cache.predict import unrope  # noqa: E402
from rotkv.calibrate.aqua import SKIP, KeyStore, _flat, apply_map  # noqa: E402

DOMAINS = ("prose", "code", "docs", "dialogue")


def capture(model, chunks):
    """Per chunk: ``(keys [L][H, T, D], queries [L][Hq, T, D])``, post-RoPE, float64 on the CPU."""
    from rotkv.calibrate.capture import capturing

    out = []
    for ids in chunks:
        got = {}
        with torch.no_grad(), capturing(model, lambda i, q, k, v, o, p: got.__setitem__(
                i, (k[0].double().cpu(), q[0].double().cpu()))):
            model(input_ids=ids)
        n = len(got)
        out.append(([got[i][0] for i in range(n)], [got[i][1] for i in range(n)]))
    return out


def to_complex(x):  # [H, T, D] real -> [T, H, D/2] complex (rotate_half's pairs: i and i + D/2)
    d = x.shape[-1] // 2
    return torch.complex(x[..., :d], x[..., d:]).permute(1, 0, 2)


def from_complex(z):  # [T, H, D/2] -> [H, T, D]
    z = z.permute(1, 0, 2)
    return torch.cat([z.real, z.imag], -1)


def fit_complex(src, dst, diag: bool, ridge: float = 1e-3):
    """Per frequency pair i: ``C_i`` with ``dst[:, :, i] ~ src[:, :, i] @ C_i`` (complex; ``diag``: one number per
    head). ``src, dst [N, H, F]``; returns ``[F, H, H]``."""
    n, h, f = src.shape
    out = torch.zeros(f, h, h, dtype=src.dtype)
    for i in range(f):
        x, y = src[:, :, i], dst[:, :, i]
        if diag:
            num = (x.conj() * y).sum(0)
            den = (x.conj() * x).sum(0).real * (1 + ridge)
            out[i] = torch.diag(num / den)
        else:
            g = x.conj().T @ x
            g = g + torch.eye(h, dtype=g.dtype) * ridge * torch.diagonal(g).real.mean()
            out[i] = torch.linalg.solve(g, x.conj().T @ y)
    return out


def apply_complex(C, prev):  # prev [H, T, D] post-RoPE -> prediction [H, T, D]
    z = to_complex(prev)  # [T, H, F]
    return from_complex(torch.einsum("thf,fhg->tgf", z, C))


def fit_dense(src, dst, cos, sin, ridge: float = 1e-3):
    """aqua's own map (pre-RoPE, with bias) from lists of [H, T, D] post-RoPE keys."""
    x = torch.cat([torch.cat([_flat(unrope(s, cos, sin))[SKIP:], torch.ones(s.shape[1] - SKIP, 1, dtype=s.dtype)], -1)
                   for s in src])
    y = torch.cat([_flat(unrope(t, cos, sin))[SKIP:] for t in dst])
    g = x.T @ x
    reg = torch.eye(g.shape[0], dtype=g.dtype) * ridge * torch.diagonal(g)[:-1].mean()
    reg[-1, -1] = 0
    return torch.linalg.solve(g + reg, x.T @ y)


def fit_head_dense(src, dst, cos, sin, ridge: float = 1e-3):
    """aqua's map restricted to one KV head at a time (``[D + 1, D]`` per head, before RoPE, with bias), as the
    block-diagonal ``[H D + 1, H D]`` that :func:`apply_map` applies: each head predicted from the same head of
    the previous layer, ``H D^2`` multiply-adds a token where the dense map costs ``(H D)^2``."""
    h, _, d = src[0].shape
    out = torch.zeros(h * d + 1, h * d, dtype=src[0].dtype)
    for i in range(h):
        A = fit_dense([s[i:i + 1] for s in src], [t[i:i + 1] for t in dst], cos, sin, ridge)
        out[i * d:(i + 1) * d, i * d:(i + 1) * d] = A[:-1]
        out[-1, i * d:(i + 1) * d] = A[-1]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--artifact", required=True, help="an oscar-mix-long artifact (R_K, k_mean, k_bits, clip_k)")
    ap.add_argument("--fit-tokens", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)

    from rotkv.calibrate.corpus import token_chunks
    from rotkv.hf.models import load_model
    from rotkv.rotations.artifact import load_artifact

    torch.manual_seed(0)
    m = load_model(a.model)
    model, tok = m.model, m.tokenizer
    art = load_artifact(a.artifact)
    ks = KeyStore(model.config, art)
    nl, h, d, kb, store = ks.layers, model.config.num_key_value_heads, ks.head_dim, ks.k_bits, ks.store
    mu = [m[:, None] for m in ks.mu]

    fit = capture(model, token_chunks(tok, None, a.fit_tokens, a.chunk))
    here = os.path.join(os.path.dirname(__file__), "..", "rotkv", "data", "suite")
    ev = capture(model, [token_chunks(tok, [os.path.join(here, f"{dm}_dev.txt")], a.chunk, a.chunk)[0]
                         for dm in DOMAINS])
    rot = next(mod for name, mod in model.named_modules() if name.endswith("rotary_emb"))
    with torch.no_grad():
        cos, sin = rot(torch.zeros(1, a.chunk, d), torch.arange(a.chunk)[None])
    cos, sin = cos[0].double(), sin[0].double()

    def moment(qs):  # queries [Hq, T, D] per chunk -> M [H, D, D] (the query heads of each KV head pooled)
        acc = torch.zeros(h, d, d, dtype=torch.float64)
        n = 0
        for q in qs:
            q = q[:, SKIP:]
            qq = q.reshape(h, -1, q.shape[1], d).reshape(h, -1, d)
            acc += torch.einsum("htd,hte->hde", qq, qq)
            n += qq.shape[1]
        return acc / n

    def energy(err, M):  # err [H, T, D] -> sum_h tr(M_h C_h)
        e = err[:, SKIP:]
        c = torch.einsum("htd,hte->hde", e, e) / e.shape[1]
        return float(torch.einsum("hde,hed->", M, c))

    plain_fit = [[ks.plain(k[i], i) for i in range(nl)] for k, _ in fit]
    plain_ev = [[ks.plain(k[i], i) for i in range(nl)] for k, _ in ev]
    rows = []
    chain_fit, chain_ev = [p[0] for p in plain_fit], [p[0] for p in plain_ev]
    for i in range(1, nl):
        M = moment([q[i] for _, q in ev])
        true = [k[i] for k, _ in ev]
        row = {"layer": i, "k_bits": kb[i],
               "plain": sum(energy(p[i] - t, M) for p, t in zip(plain_ev, true))}

        # aqua's chain: a dense pre-RoPE map from the previous layer's reconstruction (itself predicted)
        A = fit_dense(chain_fit, [k[i] for k, _ in fit], cos, sin)
        row["chain_dense"] = 0.0
        new_fit, new_ev = [], []
        for src, (k, _) in zip(chain_fit, fit):
            p = apply_map(A, src, cos, sin)
            new_fit.append(p + store(k[i] - p, i))
        for src, t in zip(chain_ev, true):
            p = apply_map(A, src, cos, sin)
            rec = p + store(t - p, i)
            row["chain_dense"] += energy(rec - t, M)
            new_ev.append(rec)
        chain_fit, chain_ev = new_fit, new_ev
        # no chain: from the previous layer's plain reconstruction (centred), three map classes
        pf = [p[i - 1] - mu[i - 1] for p in plain_fit]
        pe = [p[i - 1] - mu[i - 1] for p in plain_ev]
        src = torch.cat([to_complex(x[:, SKIP:]) for x in pf])
        dst = torch.cat([to_complex((k[i] - mu[i])[:, SKIP:]) for k, _ in fit])
        for name, diag in (("plain_cross", False), ("plain_diag", True)):
            C = fit_complex(src, dst, diag=diag)
            row[name] = sum(energy(p + store(t - mu[i] - p, i) + mu[i] - t, M)
                            for p, t in ((apply_complex(C, x), t) for x, t in zip(pe, true)))
        for name, fitter in (("plain_dense", fit_dense), ("plain_head", fit_head_dense)):
            A = fitter([p[i - 1] for p in plain_fit], [k[i] for k, _ in fit], cos, sin)
            row[name] = sum(energy(p + store(t - p, i) - t, M)
                            for p, t in ((apply_map(A, x[i - 1], cos, sin), t) for x, t in zip(plain_ev, true)))
        rows.append(row)
        print(f"layer {i:2d} ({kb[i]} bits): " + ", ".join(
            f"{k} {row[k] / row['plain']:.3f}" for k in ("chain_dense", "plain_dense", "plain_head", "plain_cross",
                                                          "plain_diag")),
            flush=True)

    keys = ("chain_dense", "plain_dense", "plain_head", "plain_cross", "plain_diag")
    tot = {k: sum(r[k] for r in rows) / sum(r["plain"] for r in rows) for k in keys}
    odd = [r for r in rows if r["layer"] % 2 == 1]
    alt = {k: (sum(r[k] for r in odd) + sum(r["plain"] for r in rows if r["layer"] % 2 == 0))
           / sum(r["plain"] for r in rows) for k in keys[1:]}
    two = [r for r in rows if r["k_bits"] == 2]
    tot2 = {k: sum(r[k] for r in two) / sum(r["plain"] for r in two) for k in keys}
    print("all layers 1..L-1, every layer predicted:", {k: round(v, 3) for k, v in tot.items()})
    print("the 2-bit key layers only:", {k: round(v, 3) for k, v in tot2.items()})
    print("odd layers predicted from the plain layer before (even layers plain):",
          {k: round(v, 3) for k, v in alt.items()})
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"artifact": os.path.basename(a.artifact), "artifact_id": art.meta.get("artifact_id"),
                   "fit_tokens": a.fit_tokens, "chunk": a.chunk, "eval": "suite dev, one chunk per domain",
                   "rows": rows, "every_layer": tot, "two_bit_layers": tot2, "odd_layers": alt}, f, indent=1)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
