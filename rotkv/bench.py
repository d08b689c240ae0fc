"""End-to-end generation benchmark: a real model, B prompts of L tokens, prefill then greedy decode.

Every method runs in the same process on the same prompts, each once to warm up (kernel builds,
compilation) and once measured:

- ``hf-dynamic``: transformers' DynamicCache, eager, through the same loop as rotkv
  (:func:`rotkv.generation.generate_batch`);
- ``hf-static-compile``: transformers' StaticCache through ``model.generate`` with
  ``torch.compile(mode="reduce-overhead")`` (transformers' fastest bf16 decode; GPU only);
- ``rotkv:<preset>`` eager and ``rotkv:<preset>+graph`` (the decode step in a CUDA graph); ``+fold``
  (also ``+graph+fold``) folds the cache's value rotations into the model's v_proj / o_proj for the
  run (:meth:`rotkv.cache.RotkvCache.fold_values`), and restores those weights bit-exactly after it;
  ``+graph+compile`` captures the model's own layers compiled (:mod:`rotkv.cache.compiled`).

Rows: method, batch, context, prefill_s, step_ms (median decode step, the first excluded),
tok_per_s (batch / step), peak_gb (peak allocated GPU memory over the run; on the CPU the process's
peak resident memory), cache_gb (GPU memory the cache holds once it is filled; on the CPU the growth
of resident memory, which the allocator may not return: a coarse figure), kv_bytes and bits_per_element (the cache's own accounting),
gpu, commit.
"""

from __future__ import annotations

import gc
import json
import subprocess
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass

import torch

from rotkv.generation import DEFAULT_PREFILL_TOKENS, BatchRun, generate_batch


@dataclass
class Row:
    method: str
    batch: int
    context: int
    new_tokens: int
    prefill_s: float
    step_ms: float
    tok_per_s: float
    peak_gb: float
    cache_gb: float
    kv_bytes: int
    bits_per_element: float
    gpu: str
    commit: str
    model: str
    note: str = ""


def commit() -> str:
    """The checkout's commit; ``ROTKV_COMMIT`` overrides it (the device copy's .git can be stale)."""
    from rotkv import switches

    if switches.get().commit:
        return switches.get().commit
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def device_name(dev: torch.device) -> str:
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"


def prompts(vocab: int, batch: int, context: int, seed: int = 0) -> torch.Tensor:
    """Random token ids (speed does not depend on the text)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 1, (batch, context), generator=g)


def _hf_kv_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _proc_status(field: str) -> float:
    """A ``/proc/self/status`` memory field (VmRSS, VmHWM) in GB; NaN where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return float("nan")


def _mem(dev) -> float:
    """GB held: allocated GPU memory, or on the CPU the process's resident memory (VmRSS)."""
    return torch.cuda.memory_allocated(dev) / 1e9 if dev.type == "cuda" else _proc_status("VmRSS")


def _peak(dev) -> float:
    """GB at the peak since :func:`_clean`: allocated GPU memory, or on the CPU the process's peak
    resident memory (VmHWM, reset by _clean where the kernel allows it, else the process's peak)."""
    return torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else _proc_status("VmHWM")


def _clean(dev) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size (Linux >= 4.0)
        except OSError:
            pass


FLAGS = ("graph", "fold", "compile")
FOLD_MARKS = ("rotkv_values_folded", "rotkv_values_fingerprint")  # what folding sets on model.config


def parse_method(method: str) -> tuple[str, frozenset[str]] | None:
    """``rotkv:<preset>[+graph][+fold][+compile]`` -> (preset, flags); None for anything else
    (``+compile`` needs ``+graph``)."""
    if not method.startswith("rotkv:"):
        return None
    preset, *flags = method.removeprefix("rotkv:").split("+")
    if not preset or any(f not in FLAGS for f in flags) or len(set(flags)) != len(flags):
        return None
    if "compile" in flags and "graph" not in flags:
        return None
    return preset, frozenset(flags)


@contextmanager
def values_restored(model):
    """Every layer's v_proj and o_proj (and the fold marks) as they are now, restored bit-exactly after
    the block. CPU copies of those weights only: a copy of the whole model would not fit beside a
    16 GB one, and a GPU copy would count in the run's peak memory."""
    from rotkv.hf.geometry import attention_modules

    params = [p for a in attention_modules(model) for proj in (a.v_proj, a.o_proj) for p in proj.parameters()]
    saved = [p.detach().to("cpu", copy=True) for p in params]
    marks = {k: getattr(model.config, k) for k in FOLD_MARKS if hasattr(model.config, k)}
    try:
        yield
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
        for k in FOLD_MARKS:
            if k in marks:
                setattr(model.config, k, marks[k])
            elif hasattr(model.config, k):
                delattr(model.config, k)


def run_method(model, method: str, ids: torch.Tensor, new_tokens: int, artifact: str | None = None,
               overrides: dict | None = None, prefill_chunk: int | None = None,
               prefill_tokens: int | str | None = DEFAULT_PREFILL_TOKENS) -> tuple[BatchRun, dict]:
    """One measured run; returns the timings and the memory / size figures. ``prefill_chunk``:
    tokens per row per prefill call (rotkv's caches: also their attention chunk; default: the
    preset's, 4096 for transformers' DynamicCache), at most ``prefill_tokens`` per call over the
    batch (:func:`rotkv.generation.prefill_chunk_of`; ``"auto"``: from the model's config,
    :func:`rotkv.generation.prefill_tokens_of`); hf-static-compile prefills through
    ``model.generate`` in one call (transformers' own path, unchanged). A ``+fold`` method runs
    on the model with its cache's R_V folded in, restored afterwards (:func:`values_restored`,
    whose copies are taken before the memory baseline)."""
    parsed = parse_method(method)
    fold = parsed is not None and "fold" in parsed[1]
    with values_restored(model) if fold else nullcontext():
        return _run_method(model, method, ids, new_tokens, artifact, overrides, prefill_chunk, prefill_tokens)


def _run_method(model, method, ids, new_tokens, artifact, overrides, prefill_chunk, prefill_tokens):
    from transformers import DynamicCache

    from rotkv.cache import RotkvCache

    dev = model.device
    _clean(dev)
    base = _mem(dev)
    if method.startswith("hf-") and model.config._attn_implementation != "sdpa":
        model.set_attn_implementation("sdpa")  # a RotkvCache switched it to "rotkv" earlier
    if method == "hf-static-compile":
        run, cache = _static_compiled(model, ids, new_tokens)
        kv = _hf_kv_bytes(cache)
        bpe = 16.0
    else:
        if method == "hf-dynamic":
            cache = DynamicCache(config=model.config)
            graph = compile_layers = False
        else:
            if parse_method(method) is None:
                raise ValueError(f"unknown method {method!r}: hf-dynamic, hf-static-compile or "
                                 "rotkv:<preset>[+graph][+fold][+compile]")
            preset, flags = parse_method(method)
            extra = dict(overrides or {})
            if prefill_chunk:
                extra["prefill_chunk"] = prefill_chunk
            cache = RotkvCache(model, preset, artifact, check_finite=False,
                               context_length=ids.shape[-1] + new_tokens, **extra)
            if "fold" in flags:
                cache.fold_values(model)
                _clean(dev)  # the fold's float64 scratch is not the run's peak
            graph, compile_layers = "graph" in flags, "compile" in flags
        run = generate_batch(model, ids, cache, new_tokens, cuda_graph=graph, prefill_chunk=prefill_chunk,
                             prefill_tokens=prefill_tokens,
                             compile_layers=compile_layers)
        if method == "hf-dynamic":
            kv, bpe = _hf_kv_bytes(cache), 16.0
        else:
            st = cache.stats()
            kv, bpe = int(st["kv_bytes"]), float(st["bits_per_element"])
    held = _mem(dev) - base
    peak = _peak(dev)
    del cache
    _clean(dev)
    return run, {"peak_gb": peak, "cache_gb": held, "kv_bytes": kv, "bits_per_element": bpe}


def _static_compiled(model, ids: torch.Tensor, new_tokens: int):
    """transformers' StaticCache decode compiled with reduce-overhead, timed per step."""
    from transformers import LogitsProcessorList

    from rotkv.generation import _StepClock

    if model.device.type != "cuda":
        raise ValueError("hf-static-compile needs a CUDA model")
    try:
        from transformers import CompileConfig

        extra = {"compile_config": CompileConfig(mode="reduce-overhead", fullgraph=False)}
    except ImportError:
        extra = {}
    clock = _StepClock()
    ids = ids.to(model.device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         do_sample=False, cache_implementation="static", logits_processor=LogitsProcessorList([clock]),
                         return_dict_in_generate=True, pad_token_id=0, **extra)
    times = clock.times
    steps = [b - a for a, b in zip(times, times[1:])]
    run = BatchRun(out.sequences[:, ids.shape[1]:], times[0] - t0 if times else 0.0, steps)
    return run, getattr(out, "past_key_values", None) or getattr(out, "cache", None)


def bench(model, model_id: str, methods: list[str], batches: list[int], contexts: list[int], new_tokens: int = 32,
          artifact: str | None = None, overrides: dict | None = None, progress=None, on_row=None,
          prefill_chunk: int | None = None, prefill_tokens: int | str | None = DEFAULT_PREFILL_TOKENS) -> list[Row]:
    """Every (batch, context) with every method; each measured after one warm-up run of the same
    shape (the whole prompt and ``new_tokens``: a static cache's size is part of its compiled graph).
    ``on_row(rows)`` is called after every cell (the CLI writes its JSON there, so a crash keeps
    what was measured)."""
    from tqdm.auto import tqdm

    dev = model.device
    rows = []
    vocab = model.config.vocab_size
    cells = [(b, c, m) for b in batches for c in contexts for m in methods]
    warmed: set = set()
    for b, c, m in tqdm(cells, desc="bench", disable=progress is False):
        ids = prompts(vocab, b, c)
        try:
            if (m, b, c) not in warmed:  # at the measured shape: a prefill chunk of a new shape builds
                # kernels and cuDNN plans on its first call, which is not part of what is measured
                run_method(model, m, ids, new_tokens, artifact, overrides, prefill_chunk, prefill_tokens)
                warmed.add((m, b, c))
            run, mem = run_method(model, m, ids, new_tokens, artifact, overrides, prefill_chunk, prefill_tokens)
        except Exception as e:  # noqa: BLE001 - one failing method must not lose the others' rows
            _clean(dev)
            why = "out of memory" if isinstance(e, torch.cuda.OutOfMemoryError) else f"failed: {type(e).__name__}: {e}"
            rows.append(Row(m, b, c, new_tokens, float("nan"), float("nan"), float("nan"), float("nan"), float("nan"),
                            0, float("nan"), device_name(dev), commit(), model_id, why[:300]))
            if on_row:
                on_row(rows)
            continue
        step = run.step_ms
        rows.append(Row(m, b, c, new_tokens, round(run.prefill_s, 4), round(step, 3),
                        round(1000 * b / step, 1) if step else 0.0, round(mem["peak_gb"], 3), round(mem["cache_gb"], 3),
                        mem["kv_bytes"], round(mem["bits_per_element"], 3), device_name(dev), commit(), model_id))
        if on_row:
            on_row(rows)
    return rows


def is_oom(e: BaseException | None) -> bool:
    """An out-of-memory error of the GPU: the allocator's, or one that a library (a CUDA call, the
    compiler) raised with its message or as the cause of its own error."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


@dataclass
class Capacity:
    """The outcome of :func:`max_batch`: the largest batch that ran (0: none), the smallest that ran
    out of memory (None: none did), every try ``(batch, ok)`` in order, and the successful run's result."""

    max_batch: int
    failed_at: int | None
    tries: list
    result: object = None

    @property
    def exact(self) -> bool:
        """True when the search closed: ``failed_at == max_batch + 1``."""
        return self.failed_at is not None and self.failed_at == self.max_batch + 1


def max_batch(try_batch, start: int = 1, limit: int | None = None, max_tries: int | None = None,
              on_try=None) -> Capacity:
    """The largest batch for which ``try_batch(batch)`` returns without running out of memory: from
    ``start``, doubling while it succeeds, then bisecting between the largest success and the
    smallest failure. ``limit``: never try more than this (reaching it ends the search);
    ``max_tries``: stop after this many tries (then ``exact`` may be False: the answer lies in
    ``[max_batch, failed_at)``). Any other error propagates. ``on_try(batch, ok, result)`` is called
    after every try (the caller frees memory there)."""
    if start < 1:
        raise ValueError(f"start has to be >= 1 but got {start}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit has to be >= 1 but got {limit}")
    lo, hi, tries, best = 0, None, [], None
    b = min(start, limit) if limit else start
    while True:
        try:
            result, ok = try_batch(b), True
        except Exception as e:  # noqa: BLE001 - only an out-of-memory error is an answer
            if not is_oom(e):
                raise
            result, ok = None, False
        tries.append((b, ok))
        if on_try:
            on_try(b, ok, result)
        if ok:
            lo, best = b, result
        else:
            hi = b
        if hi is None and limit is not None and lo >= limit:
            break
        if hi is not None and hi - lo <= 1:
            break
        if max_tries is not None and len(tries) >= max_tries:
            break
        b = lo * 2 if hi is None else (lo + hi) // 2
        if limit is not None:
            b = min(b, limit)
    return Capacity(lo, hi, tries, best)


def _partial_capacity(seen: list) -> Capacity:
    """The search's answer from the tries that finished before a try failed with an error other than
    out-of-memory: the largest batch that ran and the smallest that ran out of memory."""
    oks = [(b, r) for b, ok, r in seen if ok]
    fails = [b for b, ok, _ in seen if not ok]
    lo, best = max(oks, key=lambda t: t[0]) if oks else (0, None)
    return Capacity(lo, min(fails) if fails else None, [(b, ok) for b, ok, _ in seen], best)


@dataclass
class CapacityRow:
    method: str
    model: str
    layers: int
    context: int
    new_tokens: int
    max_batch: int
    failed_at: int | None
    exact: bool
    tries: list
    peak_gb: float
    prefill_s: float
    step_ms: float
    prefill_chunk: int | None
    gpu: str
    commit: str
    note: str = ""


def capacity(model, model_id: str, methods: list[str], context: int, new_tokens: int = 256, start: int = 1,
             limit: int | None = None, max_tries: int | None = None, artifact: str | None = None,
             overrides: dict | None = None, prefill_chunk: int | None = None, on_row=None,
             prefill_tokens: int | str | None = DEFAULT_PREFILL_TOKENS) -> list[CapacityRow]:
    """:func:`max_batch` of every method at ``context``: each try is a full ``generate`` (real
    prefill of random prompts + ``new_tokens`` greedy tokens); memory is freed between tries."""
    dev = model.device
    rows = []
    for m in methods:
        def attempt(b, m=m):
            try:
                return run_method(model, m, prompts(model.config.vocab_size, b, context), new_tokens, artifact, overrides,
                                  prefill_chunk, prefill_tokens)
            finally:
                _clean(dev)

        seen = []  # (batch, ok, result) of every try so far: kept when a later try fails otherwise

        def log(b, ok, result, m=m, seen=seen):
            _clean(dev)  # after the except clause: the failed try's frames (and tensors) are gone
            seen.append((b, ok, result))
            print(f"capacity {m} @ {context}: batch {b} {'ok' if ok else 'out of memory'}", flush=True)

        try:
            cap = max_batch(attempt, start, limit, max_tries, on_try=log)
            note = ""
        except Exception as e:  # noqa: BLE001 - one failing method must not lose the others' rows
            _clean(dev)
            cap, note = _partial_capacity(seen), f"failed: {type(e).__name__}: {e}"[:300]
        run, mem = cap.result if cap.result is not None else (None, {"peak_gb": float("nan")})
        rows.append(CapacityRow(m, model_id, model.config.num_hidden_layers, context, new_tokens, cap.max_batch,
                                cap.failed_at, cap.exact, cap.tries, round(mem["peak_gb"], 3),
                                round(run.prefill_s, 4) if run else float("nan"), round(run.step_ms, 3) if run else float("nan"),
                                prefill_chunk, device_name(dev), commit(), note))
        if on_row:
            on_row(rows)
    return rows


def capacity_table(rows: list[CapacityRow]) -> str:
    out = ["| method | context | max batch | exact | peak GB | prefill s | step ms | tries |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tries = " ".join(f"{b}{'+' if ok else 'x'}" for b, ok in r.tries)
        out.append(f"| {r.method} | {r.context} | {r.max_batch} | {r.exact} | {r.peak_gb} | {r.prefill_s} | {r.step_ms} | "
                   f"{tries} |")
    return "\n".join(out)


def write(rows: list[Row], path: str, meta: dict) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)


def table(rows: list[Row]) -> str:
    """A markdown table with each method's step and prefill as a ratio of hf-dynamic's."""
    base = {(r.batch, r.context): r for r in rows if r.method == "hf-dynamic"}
    out = ["| B x L | method | prefill s | step ms | tok/s | cache GB | peak GB | bits/elem | step vs hf-dynamic |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = base.get((r.batch, r.context))
        ratio = f"{r.step_ms / b.step_ms:.3f}" if b and b.step_ms and r.step_ms == r.step_ms else "-"
        out.append(f"| {r.batch} x {r.context} | {r.method} | {r.prefill_s} | {r.step_ms} | {r.tok_per_s} | "
                   f"{r.cache_gb} | {r.peak_gb} | {r.bits_per_element} | {ratio} |")
    return "\n".join(out)

