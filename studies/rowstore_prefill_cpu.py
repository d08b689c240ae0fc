"""Prefill time of the per-row (PM-KVQ) layers on the CPU as a GPU runs them: without the kept float32 read view.

On a GPU the per-row layers keep no read view (``RowStoreLayer.read_view`` False); the CPU keeps one. This study
turns the CPU's off, so the code path a GPU runs (the call's own view, the budget's byte count) is timed where no GPU
is: real SmolLM2, a ``--batch`` x ``--context`` prefill in one call, the default prefill chunk, one thread.

    PYTHONPATH=. python studies/rowstore_prefill_cpu.py --batch 16 --context 2048 --preset pmkvq
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    from rotkv.cache import RotkvCache
    from rotkv.hf.compat import cache_kwarg
    from rotkv.hf.models import load_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--preset", default="pmkvq")
    p.add_argument("--view", action="store_true", help="keep the read view (the CPU's default) instead")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    m = load_model(device="cpu")
    ids = torch.randint(100, 20000, (a.batch, a.context), generator=torch.Generator().manual_seed(0))
    cache = RotkvCache(m.model, a.preset)
    for layer in cache.layers:
        layer.read_view = a.view
    t0 = time.perf_counter()
    with torch.inference_mode():
        m.model(input_ids=ids, **{cache_kwarg(m.model): cache})
    sec = time.perf_counter() - t0
    st = cache.stats()
    print(json.dumps({"preset": a.preset, "batch": a.batch, "context": a.context, "view": a.view,
                      "prefill_s": round(sec, 2), "scratch_bytes": st.get("scratch_bytes"),
                      "bits_per_element": st.get("bits_per_element")}))


if __name__ == "__main__":
    main()
