"""Artifacts with a key scaling (``k_scale``, rotkv.rotations.keyscale) for several exponents, from one pass of
statistics: the oscar-mix-long refit's own sequences (``--long-seq-len 4096``, 2 sequences, the default corpus),
so that every artifact differs from its base only by ``k_scale`` (the script checks that the refitted R_K equals
the base's). What ``rotkv calibrate --method oscar-mix-long --key-scale ALPHA`` writes, for several ALPHA at the
cost of one.

    PYTHONPATH=. OMP_NUM_THREADS=1 python studies/key_scale.py --base artifacts/oscar-mix-long.safetensors \
        --alphas 0.25,0.5,1 --out /tmp/ks     # writes /tmp/ks/a0.5/oscar-mix-long.safetensors, ...
    (--granularity kv-head: one scaling per KV head, folders a0.5-head, ...; --stats FILE keeps the statistics;
    --key-layers 13: 4-bit keys in the 13 layers of largest k_gain, folders a0.5-k13, ...)
"""

from __future__ import annotations

import argparse
import os

import torch

from rotkv.calibrate.corpus import token_chunks
from rotkv.calibrate.longfit import long_stats
from rotkv.hf.models import load_model
from rotkv.rotations.artifact import load_artifact, save_artifact
from rotkv.rotations.base import pooled
from rotkv.rotations.keyscale import key_scale
from rotkv.rotations.oscar import oscar_rotation


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="an oscar-mix-long artifact with one key fit")
    ap.add_argument("--alphas", default="0.5,1")
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--granularity", default=None, choices=["layer", "kv-head"],
                    help="how the scaling pools the KV heads' statistics (default: the base's, as the refit does)")
    ap.add_argument("--key-layers", type=int, default=None,
                    help="also give 4-bit keys to this many layers by the base's k_gain (what rotkv calibrate "
                         "--method oscar-mix-long --key-layers N does); folders get a -kN suffix")
    ap.add_argument("--stats", default=None, help="a .pt file: read the statistics from it if it exists, else save them")
    a = ap.parse_args()
    torch.set_num_threads(1)
    art = load_artifact(a.base)
    seq_len = int(art.meta["longfit_seq_len"])
    if "key_fit_lengths" in art.meta:
        raise SystemExit("give an artifact with one key fit (--long-seq-len N)")
    if a.stats and os.path.exists(a.stats):
        cq, ks, kn, kk = torch.load(a.stats)
    else:
        loaded = load_model(None)
        chunks = token_chunks(loaded.tokenizer, None, seq_len * a.sequences, seq_len)
        cq, ks, kn, kk = long_stats(loaded.model, chunks, int(art.meta.get("sink", 16)), key_moments=True)
        if a.stats:
            torch.save((cq, ks, kn, kk), a.stats)
    gran = art.meta.get("granularity", "layer")
    sgran = a.granularity or gran
    worst = 0.0
    scales = {}
    for layer in cq:
        r = oscar_rotation(pooled(cq[layer], gran))[:art.tensors[f"R_K.{layer}"].shape[0]]
        worst = max(worst, (r - art.tensors[f"R_K.{layer}"]).abs().max().item())
        mu = ks[layer] / kn[layer]
        scales[layer] = (pooled(cq[layer], sgran), pooled(kk[layer] / kn[layer] - torch.einsum("hd,he->hde", mu, mu), sgran))
    print(f"max |R_K refitted - base R_K| = {worst:.2e}")
    extra, suffix = {}, ""
    if a.key_layers is not None:
        gain = art.tensors["k_gain"].double()
        bits = torch.full_like(art.tensors["k_bits"], 2)
        bits[torch.argsort(-gain)[:a.key_layers]] = 4
        extra = {"k_bits": bits}
        meta_bits = {"keybits_layers": ",".join(str(i) for i in torch.nonzero(bits == 4).flatten().tolist())}
        suffix = f"-k{a.key_layers}"
        print("4-bit key layers:", meta_bits["keybits_layers"])
    for alpha in [float(x) for x in a.alphas.split(",")]:
        tensors = dict(art.tensors) | extra
        for layer, (c_q, c_k) in scales.items():
            s = key_scale(c_q, c_k, alpha)
            tensors[f"k_scale.{layer}"] = (s if sgran == "kv-head" else s[:art.tensors[f"R_K.{layer}"].shape[0]]).contiguous()
        out = os.path.join(a.out, f"a{alpha:g}" + ("-head" if sgran == "kv-head" else "") + suffix)
        os.makedirs(out, exist_ok=True)
        meta = dict(art.meta) | {"key_scale": f"{alpha:g}"} | (meta_bits if extra else {})
        save_artifact(os.path.join(out, "oscar-mix-long.safetensors"), tensors, meta)
        print("wrote", out)


if __name__ == "__main__":
    main()
