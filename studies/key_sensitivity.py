"""Per-layer key sensitivity on calibration text: which layers' keys to keep at 4 bits.

PM-KVQ's first-order bound (rotkv.rotations.pmkvq), keys only: for layer l,
``gain[l] = |G'_K * (K' - Q_2(K'))|_1 - |G'_K * (K' - Q_4(K'))|_1``, with K' the stored keys
(mean-centred, rotated by the artifact) and G'_K the gradient of the LM loss with respect to them,
summed over calibration chunks (never the evaluation text). Prints the layers ranked by gain and the
``k_bits`` string for the top N.

Usage: python studies/key_sensitivity.py --artifact oscar.safetensors --top 10 --out ks.json
"""

from __future__ import annotations

import argparse
import json

import torch

from rotkv.calibrate.corpus import token_chunks
from rotkv.calibrate.pmkvq import kv_with_grads
from rotkv.hf.models import load_model
from rotkv.quant.quantizer import fake_quantize
from rotkv.rotations.artifact import load_artifact


def k_bits_string(layers: list[int], bits: int = 4) -> str:
    """``[15, 16, 17, 20]`` -> ``"15-17:4,20:4"``."""
    out, run = [], []
    for i in sorted(layers):
        if run and i != run[-1] + 1:
            out.append(run)
            run = []
        run.append(i)
    if run:
        out.append(run)
    return ",".join(f"{r[0]}-{r[-1]}:{bits}" if len(r) > 1 else f"{r[0]}:{bits}" for r in out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    loaded = load_model(args.model, device="cpu")
    model = loaded.model
    model.requires_grad_(False)
    art = load_artifact(args.artifact)
    n = model.config.num_hidden_layers
    rots = [art.layer_rotation(i) for i in range(n)]
    gain = torch.zeros(n, dtype=torch.float64)
    for ids in token_chunks(loaded.tokenizer, None, args.tokens, 512):
        kv = kv_with_grads(model, ids)
        for layer, (k, _) in kv.items():
            r = rots[layer]
            kr = r.keys(k[0, :, args.sink:].detach().float())
            g = k.grad[0, :, args.sink:].float()
            gr = g if r.R_K is None else g @ r.R_K
            clip = r.clip_k if r.clip_k is not None else 0.96
            e2 = (gr * (kr - fake_quantize(kr, 2, kr.shape[-1], clip))).abs().sum()
            e4 = (gr * (kr - fake_quantize(kr, 4, kr.shape[-1], 1.0))).abs().sum()
            gain[layer] += float(e2 - e4)
    order = torch.argsort(gain, descending=True).tolist()
    share = (gain / gain.sum()).tolist()
    for rank, i in enumerate(order):
        print(f"{rank:2d}. layer {i:2d}  gain share {share[i]:.3f}")
    top = order[:args.top]
    print("k_bits:", k_bits_string(top))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "gain": gain.tolist(), "order": order, "k_bits": k_bits_string(top)}, f, indent=1)


if __name__ == "__main__":
    main()
