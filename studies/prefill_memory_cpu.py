"""CPU proxy of the prefill's peak memory: the peak resident set (VmHWM) a prefill adds, measured in a
fresh process per case, on a random-weight model of a real shape (float32 on the CPU).

    python studies/prefill_memory_cpu.py --shape smollm2 --layers 4 --batch 2 --context 2048
    PYTHONPATH=/tmp/base python studies/prefill_memory_cpu.py --modes onecall   # an older checkout

Modes: ``onecall`` runs the whole prompt in one model call and takes ``logits[:, -1]`` (the prefill
of ``generate_batch`` before the prefill was chunked; the cache chunks the attention inside); ``chunked`` runs
``rotkv.generation.prefill`` (model calls of ``--chunk`` tokens, last-position logits only). The
peak counts everything the process touched during the prefill: activations, logits, the cache's
pools (float32 tiers on the CPU) and the reader's per-chunk decoding of the body. Prints one
JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set


def one_case(a) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rotkv.cache import RotkvCache
    from rotkv.cli.bench import RANDOM_SHAPES

    torch.set_num_threads(1)
    torch.manual_seed(0)
    fields = dict(RANDOM_SHAPES[a.shape], num_hidden_layers=a.layers)
    model = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    ids = torch.randint(100, fields["vocab_size"] - 1, (a.batch, a.context))
    overrides = {"prefill_chunk": a.chunk} if a.chunk else {}
    cache = RotkvCache(model, a.preset, check_finite=False, **overrides) if a.preset != "hf-dynamic" else None
    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    from rotkv.hf.compat import cache_kwarg

    base = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    with torch.no_grad():
        if a.mode == "onecall":
            last = model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache}).logits[:, -1]
        else:
            from rotkv.generation import prefill

            last = prefill(model, ids, cache, chunk=a.chunk or None)
    secs = time.perf_counter() - t0
    peak = _status("VmHWM") - base
    return {"mode": a.mode, "preset": a.preset, "shape": a.shape, "layers": a.layers, "batch": a.batch,
            "context": a.context, "chunk": a.chunk or getattr(getattr(cache, "spec", None), "prefill_chunk", None),
            "prefill_peak_mb": round(peak / 2**20, 1), "prefill_s": round(secs, 2),
            "logits_shape": list(last.shape)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="smollm2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=0, help="the cache's prefill_chunk and the model-level chunk (0: the default)")
    ap.add_argument("--presets", nargs="+", default=["quarot-int2", "hf-dynamic"])
    ap.add_argument("--modes", nargs="+", default=["onecall", "chunked"], choices=["onecall", "chunked"])
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="chunked", help=argparse.SUPPRESS)
    ap.add_argument("--preset", default="quarot-int2", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.one:
        print(json.dumps(one_case(a)), flush=True)
        return 0
    for preset in a.presets:
        for mode in a.modes:
            cmd = [sys.executable, __file__, "--one", "--mode", mode, "--preset", preset, "--shape", a.shape,
                   "--layers", str(a.layers), "--batch", str(a.batch), "--context", str(a.context), "--chunk", str(a.chunk)]
            r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
            print(lines[-1] if r.returncode == 0 and lines else
                  json.dumps({"mode": mode, "preset": preset, "error": r.stderr.strip().splitlines()[-1:]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
