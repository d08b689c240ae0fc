"""Bits per element of rotkv's own layers (Gemma3-270M: its 3 full-attention layers), apart from
transformers' sliding layers, after a 2048-token prefill of the evaluation text plus 63 decode steps
(the state an nll window at 2K ends in, as in `rotkv eval --tasks nll --lengths nll=2048 --new-tokens 64`).

usage: OMP_NUM_THREADS=1 python studies/layer_bits.py MODEL ARTIFACT_DIR METHODS OUT.json

METHODS: comma-separated; every rotkv preset runs at sink 16 / window 32 as in the evaluations, unless a
method names its sink (``oscar-refine:4``, as `rotkv eval --sink preset` runs that preset; `rotkv eval`
without --sink runs every preset at the profile's 16).
"""
import json
import sys

import torch

from rotkv.eval.methods import resolve
from rotkv.eval.protocol import forward, prefill
from rotkv.hf.models import load_model

model_path, adir, methods, out = sys.argv[1], sys.argv[2], sys.argv[3].split(","), sys.argv[4]
torch.set_num_threads(1)
loaded = load_model(model_path, device="cpu", dtype=torch.float32)
model, tok = loaded.model, loaded.tokenizer
text = open("rotkv/data/eval_python_reference.txt").read()
ids = torch.tensor([tok(text, add_special_tokens=False).input_ids[: 2048 + 64]])
rows = {}
with torch.inference_mode():
    for item in methods:
        name, _, sink = item.partition(":")
        m, why = resolve(name, int(sink) if sink else 16, 32, adir)
        assert m is not None, why
        cache = m.build(model)
        prefill(model, cache, ids[:, :2048], 512)
        for t in range(2048, 2048 + 63):
            forward(model, ids[:, t:t + 1], cache)
        tot = {"body_bytes": 0, "tier_bytes": 0, "elements": 0, "body_elements": 0}
        per_layer = {}
        for i, layer in enumerate(cache.layers):
            if hasattr(layer, "stats"):
                st = layer.stats()
                for k in tot:
                    tot[k] += st[k]
                per_layer[i] = round(8 * (st["body_bytes"] + st["tier_bytes"]) / st["elements"], 3)
        allst = cache.stats()
        rows[name] = {
            "rotkv_layers": list(per_layer),
            "bits_rotkv_layers": 8 * (tot["body_bytes"] + tot["tier_bytes"]) / tot["elements"],
            "bits_rotkv_layers_per_layer": per_layer,
            "body_bits_rotkv_layers": 8 * tot["body_bytes"] / max(tot["body_elements"], 1),
            "bits_all_layers": allst["bits_per_element"],
            "tokens": 2048 + 63,
        }
        print(name, json.dumps(rows[name]), flush=True)
json.dump(rows, open(out, "w"), indent=1)
