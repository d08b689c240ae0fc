"""Per-layer key-width gains under the refine tier (oscar-refine with every key layer at 2 bits as the
baseline), on calibration text: which layers' keys gain most from 4 bits once the tier is there
(rotkv.calibrate.keybits' measurement, with the preset's sink, window, tier and key fit).

usage: OMP_NUM_THREADS=1 PYTHONPATH=. python studies/keybits_refine.py LENGTH WINDOWS OUT.json
       (docs/results/levers_length/tier4/keybits-refine-2k.json: 2048 3)
"""
import dataclasses, json, sys, time
import numpy as np, torch
from rotkv.config import PRESETS
from rotkv.calibrate import keybits as kb
from rotkv.calibrate.corpus import token_chunks
from rotkv.cache import RotkvCache
from rotkv.hf.models import load_model
from rotkv.rotations.artifact import load_artifact

torch.set_num_threads(1)
length, new, windows, chunk = int(sys.argv[1]), 32, int(sys.argv[2]), 2048
PRESETS["oscar-refine-k2"] = dataclasses.replace(PRESETS["oscar-refine"], name="oscar-refine-k2", k_bits=None)
loaded = load_model(None, device="cpu", dtype=torch.float32)
model, tok = loaded.model, loaded.tokenizer
art = "artifacts/oscar-mix-long.safetensors"
span = length + new
need = -(-span // 512) * 512
stream = torch.cat(token_chunks(tok, None, windows * need, 512), 1)
starts = [w * (stream.shape[1] - span) // max(windows - 1, 1) for w in range(windows)]
ids = torch.stack([stream[0, s:s + span] for s in starts])
with torch.inference_mode():
    ref = torch.log_softmax(model(input_ids=ids[:, :span - 1], use_cache=False, logits_to_keep=new).logits[:, -new:].float(), -1)
L = model.config.num_hidden_layers
runs = [None] + list(range(L))
kw = dict(sink=4, window=32, prefill_chunk=chunk, context_length=span)
caches = [RotkvCache(model, "oscar-refine-k2", art, **kw, **({} if r is None else {"k_bits": f"{r}:4"})) for r in runs]
t = time.time()
out = kb.grouped_decode_kl(model, caches, ids, length, new, chunk, ref, first=runs, progress=True)
kl = dict(zip(runs, out))
base = kl[None].mean().item()
gains = [base - kl[i].mean().item() for i in range(L)]
old = load_artifact(art).tensors["k_gain"].tolist()
res = {"length": length, "windows": windows, "base_kl": base, "gains": gains, "artifact_k_gain": old,
       "top10": sorted(range(L), key=lambda i: -gains[i])[:10], "seconds": time.time() - t}
print(json.dumps(res))
json.dump(res, open(sys.argv[3], "w"), indent=1)
