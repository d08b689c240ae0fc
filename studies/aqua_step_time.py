"""Decode step time of oscar-aqua against oscar-refine on the CPU, interleaved (a busy shared machine's load
changes from minute to minute, so the two presets take turns): each prefills one row of ``--context`` tokens,
then ``--rounds`` rounds of ``--steps`` decode steps each; prints the median step of each preset and their ratio.

    OMP_NUM_THREADS=1 PYTHONPATH=. python studies/aqua_step_time.py --artifact artifacts/oscar-mix-long+aqua.safetensors
"""
import argparse
import statistics
import time

import torch

from rotkv.cache import RotkvCache
from rotkv.eval.protocol import forward, prefill
from rotkv.hf.models import load_model

p = argparse.ArgumentParser()
p.add_argument("--artifact", required=True, help="an oscar-mix-long+aqua artifact (it serves both presets)")
p.add_argument("--context", type=int, default=2048)
p.add_argument("--steps", type=int, default=8)
p.add_argument("--rounds", type=int, default=4)
args = p.parse_args()
torch.set_num_threads(1)
loaded = load_model(None)
model = loaded.model
ids = torch.randint(100, 20000, (1, args.context + args.steps * args.rounds), generator=torch.Generator().manual_seed(0))
presets = ("oscar-refine", "oscar-aqua")
caches = {}
with torch.no_grad():
    for name in presets:
        caches[name] = RotkvCache(model, name, args.artifact, context_length=ids.shape[1])
        prefill(model, caches[name], ids[:, :args.context], 512)
    times = {name: [] for name in presets}
    pos = {name: args.context for name in presets}
    for _ in range(args.rounds):
        for name in presets:
            for _ in range(args.steps):
                t = pos[name]
                t0 = time.perf_counter()
                forward(model, ids[:, t:t + 1], caches[name])
                times[name].append(1000 * (time.perf_counter() - t0))
                pos[name] += 1
for name in presets:
    print(f"{name}: median decode step {statistics.median(times[name]):.0f} ms over {len(times[name])} steps "
          f"(min {min(times[name]):.0f}, max {max(times[name]):.0f}) at 1 x {args.context}, one thread")
print(f"ratio oscar-aqua / oscar-refine: {statistics.median(times['oscar-aqua']) / statistics.median(times['oscar-refine']):.2f}")
