"""Where rotkv's prefill time goes: one shape, several methods, each prefilled once to
warm up, once timed, once under torch.profiler; per method the wall time, the top kernels and ops
by self device time (self CPU time on a CPU) and their grouping into categories.

Methods: rotkv presets (``bf16``, ``quarot-int2``; ``rotkv:`` prefix optional) prefilled by
:func:`rotkv.generation.prefill` as ``rotkv bench`` does (pages reserved first, calls of
``prefill_chunk_of`` tokens per row), and ``hf-static``: transformers' StaticCache prefill as
``hf-static-compile`` runs it (``model.generate``, whose prefill is an eager model call; only its
decode steps are compiled), here with one new token so nothing is compiled.

``--sweep-prefill-tokens N ...`` instead times (no profiler) every rotkv method for every token
budget and every ``--prefill-chunk`` value (hf-static once, as the one-call reference): what the
chunking itself costs.

    PYTHONPATH=. python studies/profile_prefill.py --random smollm2 --batch 64 --context 8192 \
        --methods bf16 quarot-int2 hf-static --out prefill-prof.json
    # the real model, with presets that need an artifact (artifacts/<preset>.safetensors)
    PYTHONPATH=. python studies/profile_prefill.py --model $ROTKV_GGUF --artifact-dir artifacts --batch 64 \
        --context 8192 --methods bf16 quarot-int2 oscar-mix hf-static --out prefill-prof-real.json

Writes ``--out`` (JSON) and the same path with ``.md`` (tables).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rotkv import bench  # noqa: E402
from rotkv.cli.bench import RANDOM_SHAPES, _random_model, prefill_tokens_arg  # noqa: E402
from rotkv.generation import DEFAULT_PREFILL_TOKENS, prefill, prefill_chunk_of, prefill_tokens_of, reserve  # noqa: E402

# first match wins (a dtype cast is a copy kernel, an elementwise kernel by its template)
CATEGORIES = [
    ("attention", r"flash|fmha|sdpa|attention|attn"),
    ("rotkv kernels", r"_dequant_kernel|_quant_write_kernel|_split_kernel|_merge_kernel|int2_decode|write_plain|write_rot"),
    ("matmul/gemm", r"gemm|cublas|nvjet|xmma|wgmma|cutlass|aten::(add|b)?mm$|aten::matmul|aten::linear|aten::einsum"),
    ("copies/cat/index", r"copy|memcpy|memset|cat|index|gather|scatter|take|put|fill|zero|clone|contiguous"),
    ("elementwise/norm", r"elementwise|reduce|norm|silu|mul|add|sub|div|rsqrt|pow|mean|softmax|neg|exp|sin|cos|where"),
]


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, pat in CATEGORIES if re.search(pat, low)), "other")


def _preset(method: str) -> str:
    """``rotkv:quarot-int2+graph`` -> ``quarot-int2`` (the prefill runs no graph)."""
    return method.removeprefix("rotkv:").split("+")[0]


ARTIFACT_DIR = None  # --artifact-dir (set by main)


def preset_artifact(preset: str, artifact_dir: str | None) -> str | None:
    """The artifact a preset reads from an ``--artifact-dir`` (``rotkv.config.artifact_file``: oscar-int2
    reads oscar.safetensors, oscar-mix its own file), None for a preset that needs none."""
    from rotkv.config import artifact_file, get_preset

    if not get_preset(preset).needs_artifact:
        return None
    if artifact_dir is None:
        raise SystemExit(f"preset {preset!r} needs an artifact: pass --model and --artifact-dir")
    return os.path.join(artifact_dir, artifact_file(preset))


def _sync(dev) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def run_prefill(model, method: str, ids, new_tokens: int, chunk: int | None, tokens: int | None) -> tuple[float, float]:
    """One prefill of ``ids`` into a fresh cache; returns (wall seconds, peak GB): the time without the cache set-up
    as ``rotkv bench`` times it (the pools' first allocation is inside, as there)."""
    from rotkv.cache import RotkvCache
    from rotkv.hf.compat import cache_kwarg

    dev = model.device
    bench._clean(dev)
    b, n = ids.shape
    if method == "hf-static":
        from transformers import StaticCache

        if model.config._attn_implementation != "sdpa":
            model.set_attn_implementation("sdpa")  # a RotkvCache switched it to "rotkv"
        cache = StaticCache(config=model.config, max_cache_len=n + new_tokens)
        t0 = _sync(dev)
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                       pad_token_id=0, **{cache_kwarg(model): cache})
    else:
        extra = {"prefill_chunk": chunk} if chunk else {}
        cache = RotkvCache(model, _preset(method), artifact=preset_artifact(_preset(method), ARTIFACT_DIR), check_finite=False, **extra)
        reserve(cache, b, n + new_tokens)
        t0 = _sync(dev)
        prefill(model, ids, cache, chunk=chunk, max_tokens=tokens)
    seconds = _sync(dev) - t0
    peak = bench._peak(dev)  # GB, weights and cache included: read before the clean-up resets it
    del cache
    bench._clean(dev)
    return seconds, peak


def _rows(events, key, total: float, top: int) -> list[dict]:
    evs = sorted((e for e in events if key(e) > 0), key=key, reverse=True)[:top]
    return [{"name": e.key[:160], "calls": e.count, "ms": round(key(e) / 1e3, 3),
             "share": round(key(e) / total, 4) if total else 0.0, "category": category(e.key)} for e in evs]


def profile_method(model, method: str, ids, new_tokens: int, chunk, tokens, top: int) -> dict:
    """Warm-up, a timed run, a profiled run; the profile's kernels (CUDA) or ops (CPU) by self time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = model.device.type == "cuda"
    run_prefill(model, method, ids, new_tokens, chunk, tokens)
    wall, _ = run_prefill(model, method, ids, new_tokens, chunk, tokens)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        profiled, _ = run_prefill(model, method, ids, new_tokens, chunk, tokens)
    events = prof.key_averages()
    ops = [e for e in events if e.device_type == DeviceType.CPU]
    if cuda:  # kernels (and memcpy / memset) are the device events; ops are charged their kernels' time
        kernels, key = [e for e in events if e.device_type == DeviceType.CUDA], lambda e: e.self_device_time_total
    else:
        kernels, key = ops, lambda e: e.self_cpu_time_total
    total = sum(key(e) for e in kernels)
    cats: dict[str, float] = {}
    for e in kernels:
        c = category(e.key)
        cats[c] = cats.get(c, 0.0) + key(e) / 1e3
    b, n = ids.shape
    c = n if method == "hf-static" else prefill_chunk_of_method(model, method, chunk, b, tokens)
    return {"method": method, "batch": b, "context": n, "chunk": c, "model_calls": -(-n // c),
            "prefill_s": round(wall, 4), "profiled_s": round(profiled, 4),
            "device_ms": round(total / 1e3, 3), "time_kind": "device" if cuda else "cpu",
            # the profiled wall time no kernel ran in (host overhead, syncs): 0 on the CPU
            "idle_ms": round(max(profiled * 1e3 - total / 1e3, 0.0), 3) if cuda else 0.0,
            "categories": {k: round(v, 3) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top": _rows(kernels, key, total, top),
            "top_ops": _rows(ops, key, sum(key(e) for e in ops), top) if cuda else []}


def prefill_chunk_of_method(model, method: str, chunk, rows: int, tokens) -> int:
    """The per-row tokens of one model call of a rotkv method's prefill (what ``prefill`` uses)."""
    from rotkv.config import get_preset

    spec = get_preset(_preset(method))
    return prefill_chunk_of(None, chunk or spec.prefill_chunk, rows, tokens, model)


def sweep(model, methods, ids, new_tokens: int, chunks, budgets, repeat: int) -> list[dict]:
    rows = []
    b, n = ids.shape
    dev = model.device
    for m in methods:
        cells = [(None, None)] if m == "hf-static" else [(c, t) for t in budgets for c in chunks]
        for c, t in cells:
            try:
                run_prefill(model, m, ids, new_tokens, c, t)  # warm-up (kernel builds, autotuning)
                runs = sorted(run_prefill(model, m, ids, new_tokens, c, t) for _ in range(repeat))
                (s, peak), note = runs[len(runs) // 2], ""
            except Exception as e:  # noqa: BLE001 - one failing cell must not lose the others
                bench._clean(dev)
                s, note, peak = float("nan"), f"{type(e).__name__}: {e}"[:200], float("nan")
            per = n if m == "hf-static" else prefill_chunk_of_method(model, m, c, b, t)
            tok = prefill_tokens_of(model) if t == "auto" else t  # the budget's tokens for this model
            rows.append({"method": m, "batch": b, "context": n, "prefill_tokens": tok if tok else b * n,
                         "prefill_chunk": c, "chunk": per, "model_calls": -(-n // per), "prefill_s": round(s, 4),
                         "peak_gb": round(peak, 3), "note": note})
            print(f"sweep {m} tokens={t} chunk={c}: {s:.4f} s", flush=True)
    return rows


def markdown(rows: list[dict], swept: bool) -> str:
    if swept:
        out = ["| method | B x L | token budget | --prefill-chunk | chunk / calls | prefill s | peak GB | note |",
               "|---|---|---|---|---|---|---|---|"]
        out += [f"| {r['method']} | {r['batch']} x {r['context']} | {r['prefill_tokens']} | {r['prefill_chunk']} | "
                f"{r['chunk']} / {r['model_calls']} | {r['prefill_s']} | {r['peak_gb']} | {r['note']} |" for r in rows]
        return "\n".join(out) + "\n"
    cats = [c for c, _ in CATEGORIES] + ["other"]
    out = ["| method | B x L | chunk / calls | prefill s | profiled s | "
           f"{rows[0]['time_kind'] if rows else 'device'} ms | idle ms | " + " | ".join(cats) + " |",
           "|---|---|---|---|---|---|---|" + "---|" * len(cats)]
    for r in rows:
        out.append(f"| {r['method']} | {r['batch']} x {r['context']} | {r['chunk']} / {r['model_calls']} | "
                   f"{r['prefill_s']} | {r['profiled_s']} | {r['device_ms']} | {r['idle_ms']} | "
                   + " | ".join(f"{r['categories'].get(c, 0.0):.1f}" for c in cats) + " |")
    for r in rows:
        for title, key in (("kernels", "top"), ("ops", "top_ops")) if r["top_ops"] else (("ops", "top"),):
            out += ["", f"### {r['method']}: top {title} by self {r['time_kind']} time", "",
                    "| name | category | calls | ms | share |", "|---|---|---|---|---|"]
            out += [f"| `{t['name'][:100]}` | {t['category']} | {t['calls']} | {t['ms']} | {t['share']:.3f} |"
                    for t in r[key]]
    return "\n".join(out) + "\n"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--random", choices=sorted(RANDOM_SHAPES), help="random weights of a real shape")
    src.add_argument("--model", help="a real model (GGUF file or model directory)")
    p.add_argument("--artifact-dir", default=None, help="the artifacts of presets that need one, as rotkv eval names them (with --model)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32, help="pages reserved / static cache sized for this many more")
    p.add_argument("--methods", nargs="+", default=["bf16", "quarot-int2", "hf-static"])
    p.add_argument("--prefill-chunk", type=int, nargs="+", default=None,
                   help="tokens per row per call (also the cache's chunk); one value to profile, several to sweep")
    p.add_argument("--prefill-tokens", type=prefill_tokens_arg, default=DEFAULT_PREFILL_TOKENS,
                   help="token budget per call (profile); default auto: from the model (rotkv.generation.prefill_tokens_of)")
    p.add_argument("--sweep-prefill-tokens", type=prefill_tokens_arg, nargs="+", default=None,
                   help="time (no profiler) every rotkv method at each of these token budgets per call")
    p.add_argument("--repeat", type=int, default=1, help="sweep: timed runs per cell (the median is kept)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse(argv)
    chunks = a.prefill_chunk or [None]
    if not a.sweep_prefill_tokens and len(chunks) > 1:
        raise SystemExit("profiling takes one --prefill-chunk; several are for --sweep-prefill-tokens")
    global ARTIFACT_DIR
    ARTIFACT_DIR = a.artifact_dir
    if a.model:
        from rotkv.hf.models import load_model

        if a.layers:
            raise SystemExit("--layers is for --random shapes")
        model, model_id = load_model(a.model, device=a.device).model, a.model
    else:
        model, model_id = _random_model(a.random, a.layers, a.device)
    ids = bench.prompts(model.config.vocab_size, a.batch, a.context).to(model.device)
    import transformers

    meta = {"model": model_id, "device": bench.device_name(model.device), "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": bench.commit(), "args": vars(a)}
    if a.sweep_prefill_tokens:
        rows = sweep(model, a.methods, ids, a.new_tokens, chunks, a.sweep_prefill_tokens, a.repeat)
    else:
        rows = []
        for m in a.methods:
            rows.append(profile_method(model, m, ids, a.new_tokens, chunks[0], a.prefill_tokens, a.top))
            print(f"{m}: prefill {rows[-1]['prefill_s']} s, {rows[-1]['time_kind']} {rows[-1]['device_ms']} ms, "
                  f"{rows[-1]['categories']}", flush=True)
    result = {"meta": meta, "rows": rows}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    md = os.path.splitext(a.out)[0] + ".md"
    with open(md, "w") as f:
        f.write(f"# prefill profile: {model_id}, {a.batch} x {a.context} ({meta['device']}, {meta['commit']})\n\n")
        f.write(markdown(rows, bool(a.sweep_prefill_tokens)))
    print(f"wrote {a.out} and {md}")
    return result


if __name__ == "__main__":
    main()
