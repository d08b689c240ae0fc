"""OSCAR's key rotation refitted on long sequences (issue 24 lever "calibration on long sequences").

``rotkv calibrate --method oscar`` fits R_K from the query covariance C_Q of 512-token chunks, so it sees
RoPE phases of at most 512 positions and short-context queries. This refit keeps an artifact's values side
(R_V), clip ratios and key widths, and replaces, per layer, the key mean and ``R_K = U_Q H P_br`` by the
same fit over calibration sequences of ``--seq-len`` tokens (default 4096): each sequence is prefilled in
512-token calls through a DynamicCache with rotkv's capture attention, so every query at positions
0..seq_len-1 enters C_Q (summed over the query heads of a KV head, pooled over the layer's heads as the
base artifact's ``layer`` granularity) and every key past the sink enters the mean. Calibration text only.

    python benchmarks/calibrate_long.py --base oscar-mix.safetensors --seq-len 4096 --sequences 2 --out oscar-mix-long.safetensors
"""

from __future__ import annotations

import argparse
import time

import torch


@torch.no_grad()
def long_stats(model, tok, seq_len: int, sequences: int, sink: int = 16, call: int = 512):
    """Per layer: (C_Q ``[H, D, D]`` summed over the group's query heads, key sum ``[H, D]``, key count)."""
    from transformers import DynamicCache

    from rotkv.calibrate.capture import capturing
    from rotkv.calibrate.corpus import token_chunks
    from rotkv.hf import compat

    cq, ks, kn = {}, {}, {}
    pos = [0]

    def rec(layer, q, k, v, out, probs):
        q0, k0 = q[0].float(), k[0].float()  # [Hq, t, D], [H, S, D]
        h, t = k0.shape[0], q0.shape[1]
        g = q0.reshape(h, -1, q0.shape[-1])  # the query heads of KV head i are rows i*n_rep .. (i+1)*n_rep-1
        cq[layer] = cq.get(layer, 0) + torch.einsum("htd,hte->hde", g, g).double()
        new = k0[:, -t:]
        skip = max(0, sink - pos[0])
        ks[layer] = ks.get(layer, 0) + new[:, skip:].sum(1).double()
        kn[layer] = kn.get(layer, 0) + (t - skip)

    chunks = token_chunks(tok, None, seq_len * sequences, seq_len)
    with capturing(model, rec):
        for ids in chunks:
            cache = DynamicCache()
            for c0 in range(0, ids.shape[1], call):
                pos[0] = c0
                model(input_ids=ids[:, c0:c0 + call], use_cache=True, logits_to_keep=1,
                      **{compat.cache_kwarg(model): cache})
    return cq, ks, kn, sum(c.shape[1] for c in chunks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the artifact whose R_V, clips and key widths are kept")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from rotkv.hf.models import load_model
    from rotkv.rotations.artifact import load_artifact, save_artifact
    from rotkv.rotations.base import pooled
    from rotkv.rotations.oscar import oscar_rotation

    loaded = load_model(None, device="cpu")
    base = load_artifact(args.base)
    t0 = time.time()
    cq, ks, kn, n = long_stats(loaded.model, loaded.tokenizer, args.seq_len, args.sequences, int(base.meta.get("sink", 16)))
    tensors = dict(base.tensors)
    for layer in cq:
        r = oscar_rotation(pooled(cq[layer], base.meta.get("granularity", "layer")))
        old = tensors[f"R_K.{layer}"]
        tensors[f"R_K.{layer}"] = r[:old.shape[0]].contiguous()
        tensors[f"k_mean.{layer}"] = (ks[layer] / kn[layer]).float()
    meta = dict(base.meta) | {"long_refit_seq_len": str(args.seq_len), "long_refit_tokens": str(n),
                              "long_refit_seconds": f"{time.time() - t0:.0f}"}
    save_artifact(args.out, tensors, meta)
    print(f"wrote {args.out}: R_K and key means refitted on {n} tokens in sequences of {args.seq_len} "
          f"({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
