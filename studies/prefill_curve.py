"""CPU prefill time against context length: transformers' DynamicCache and a rotkv cache, same model,
same random prompt, one forward over the whole prompt (rotkv chunks it by its ``prefill_chunk``).

    OMP_NUM_THREADS=1 python studies/prefill_curve.py --lengths 1024 2048 4096 8192 \\
        --out benchmarks/results/prefill_curve_cpu.json --plot docs/results/prefill_curve_cpu.png

Each (length, cache) runs ``--repeats`` times, interleaved, and keeps the fastest (the machine is
shared); the JSON holds every time. Also splits rotkv's time: attention (``HybridLayer.attend``)
vs the rest of the forward, to say where the time above DynamicCache's goes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def prefill(model, ids, cache) -> float:
    from rotkv.hf.compat import cache_kwarg

    t0 = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, logits_to_keep=1, **{cache_kwarg(model): cache})
    return time.perf_counter() - t0


def main() -> int:
    from transformers import DynamicCache

    from rotkv.cache import RotkvCache
    from rotkv.cache.layer import HybridLayer
    from rotkv.hf.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--preset", default="quarot-int2")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/prefill_curve_cpu.json")
    ap.add_argument("--plot", default=None, help="PNG of prefill seconds against tokens")
    args = ap.parse_args()
    loaded = load_model(dtype=torch.float32)
    model = loaded.model
    g = torch.Generator().manual_seed(0)
    ids_all = torch.randint(100, model.config.vocab_size - 1, (1, max(args.lengths)), generator=g)
    attend = {"s": 0.0}
    real = HybridLayer.attend

    def timed(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return real(self, *a, **k)
        finally:
            attend["s"] += time.perf_counter() - t0

    HybridLayer.attend = timed
    rows = []
    for n in args.lengths:
        ids = ids_all[:, :n]
        times = {"hf-dynamic": [], f"rotkv:{args.preset}": []}
        attn = []
        for _ in range(args.repeats):
            model.set_attn_implementation("sdpa")
            times["hf-dynamic"].append(prefill(model, ids, DynamicCache(config=model.config)))
            attend["s"] = 0.0
            times[f"rotkv:{args.preset}"].append(prefill(model, ids, RotkvCache(model, args.preset)))
            attn.append(attend["s"])
        best = {k: min(v) for k, v in times.items()}
        row = {"tokens": n, **{f"{k}_s": round(v, 3) for k, v in best.items()},
               "ratio": round(best[f"rotkv:{args.preset}"] / best["hf-dynamic"], 3),
               "rotkv_attend_s": round(min(attn), 3), "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {"model": loaded.model_id, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "preset": args.preset, "repeats": args.repeats, "device": "cpu",
            "note": "fastest of --repeats interleaved runs on a shared machine; one forward over the prompt"}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.4))
        x = [r["tokens"] for r in rows]
        for key, label in (("hf-dynamic_s", "DynamicCache"), (f"rotkv:{args.preset}_s", f"rotkv {args.preset}")):
            ax.plot(x, [r[key] for r in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prefill seconds")
        ax.set_title(f"CPU prefill, {loaded.model_id.split('.')[0]}, {meta['threads']} thread(s)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
