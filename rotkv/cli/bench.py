"""`rotkv bench`: end-to-end generation speed and memory of rotkv against transformers' caches."""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

from rotkv import switches
from rotkv.cli.common import add_cache_args, add_model_args, cache_overrides
from rotkv.cli.errors import UsageError
from rotkv.config import PRESETS

DEFAULT_METHODS = ["hf-dynamic", "hf-static-compile", "rotkv:bf16", "rotkv:quarot-int2", "rotkv:quarot-int2+graph"]
# random-weight models of real shapes (Llama architecture): name -> LlamaConfig fields
RANDOM_SHAPES = {
    "qwen3-8b": dict(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936, rope_theta=1e6,
                     max_position_embeddings=131072),
    # SmolLM2-135M (the default model): speed and memory without its weights
    "smollm2": dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    intermediate_size=1536, vocab_size=49152, rope_theta=100000.0, max_position_embeddings=8192,
                    tie_word_embeddings=True),
}


def prefill_tokens_arg(text: str) -> int | str:
    """``--prefill-tokens``: a count, or ``auto`` (rotkv.generation.prefill_tokens_of the model)."""
    if text.strip().lower() == "auto":
        return "auto"
    from rotkv.cli import bounded_int

    try:
        return bounded_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens (at most {2**31 - 1}) or 'auto', "
                                         f"got {text!r}") from None


def register(sub) -> None:
    p = sub.add_parser("bench", help="end-to-end generation benchmark (prefill + greedy decode) against transformers' caches")
    add_model_args(p)
    add_cache_args(p, preset=False)
    p.add_argument("--methods", nargs="+", default=None,
                   help="hf-dynamic, hf-static-compile, rotkv:<preset>, rotkv:<preset>+graph, and +fold on a "
                        "rotkv method (rotkv:<preset>+fold, rotkv:<preset>+graph+fold: the cache's value rotations "
                        "folded into the model's v_proj / o_proj for that run, restored after it), and "
                        "+graph+compile (the model's own layers compiled into the captured step) "
                        f"(default: {' '.join(DEFAULT_METHODS)}; hf-static-compile and +graph need CUDA)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, nargs="+", default=[1024])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--random", choices=sorted(RANDOM_SHAPES), default=None,
                   help="a random-weight model of this real shape instead of --model")
    p.add_argument("--layers", type=int, default=None, help="with --random: fewer layers than the real model")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prefill tokens per row per model call (rotkv: also the cache's attention chunk; default: "
                        "the preset's prefill_chunk, 4096 for transformers' DynamicCache)")
    p.add_argument("--prefill-tokens", type=prefill_tokens_arg, default="auto",
                   help="at most this many prefill tokens per model call over the batch (the per-row chunk shrinks "
                        "for large batches, bounding the activations; default auto: a 2.25 GiB budget of the "
                        "model's largest per-token activation, 262144 for SmolLM2-135M, 32768 for Qwen3-8B)")
    p.add_argument("--max-batch", action="store_true",
                   help="capacity: the largest batch whose generate (real prefill + --new-tokens) fits, per method "
                        "and --context, by doubling then bisection; writes capacity-<UTC time>.json")
    p.add_argument("--start", type=int, default=1, help="with --max-batch: the first batch tried")
    p.add_argument("--limit", type=int, default=None, help="with --max-batch: the largest batch tried")
    p.add_argument("--max-tries", type=int, default=None,
                   help="with --max-batch: stop after this many tries per method (the row says exact: false)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="CUDA only: cap this process's GPU memory at this many GB (torch's per-process memory "
                        "fraction), as if the GPU were that size; with --max-batch, the capacity of a smaller card")
    p.add_argument("--out", default=None,
                   help="JSON path (default: rotkv-generate-<UTC time>.json, or rotkv-capacity-... with --max-batch, "
                        "in the current folder)")
    p.set_defaults(func=run)


def _random_model(name: str, layers: int | None, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(RANDOM_SHAPES[name])
    if layers:
        fields["num_hidden_layers"] = layers
    cfg = LlamaConfig(**fields)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16 if device == "cuda" else torch.float32).eval()
    return model, f"random:{name}" + (f" ({layers} layers)" if layers else "")


def random_param_count(name: str, layers: int | None) -> int:
    """Parameters of the random model (embeddings and head untied, as LlamaForCausalLM builds it)."""
    f = dict(RANDOM_SHAPES[name])
    n_layers = layers or f["num_hidden_layers"]
    h, d, kv, q, inter, vocab = (f["hidden_size"], f["head_dim"], f["num_key_value_heads"], f["num_attention_heads"],
                                 f["intermediate_size"], f["vocab_size"])
    per_layer = h * d * (2 * q + 2 * kv) + 3 * h * inter + 2 * h
    return n_layers * per_layer + 2 * vocab * h + h


def available_gb(device: str) -> float:
    """Memory a new model can take here: free GPU memory, or the CPU's MemAvailable."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0] / 1e9
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return float("inf")


def check_args(args) -> tuple[str, list[str]]:
    """Every check that needs no model: (device, methods)."""
    import torch

    from rotkv.bench import parse_method
    from rotkv.cli.common import cache_spec, early_artifact
    from rotkv.cli.errors import check_device, check_model, check_out_path

    if args.new_tokens < 2:
        raise UsageError(f"--new-tokens has to be >= 2 but got {args.new_tokens}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise UsageError(f"--prefill-chunk has to be >= 1 but got {args.prefill_chunk}")
    for name in ("start", "limit", "max_tries", "prefill_tokens"):
        v = getattr(args, name)
        if v is not None and v != "auto" and v < 1:
            raise UsageError(f"--{name.replace('_', '-')} has to be >= 1 but got {v}")
    for name in ("batch", "context"):
        if min(getattr(args, name)) < 1:
            raise UsageError(f"--{name} values have to be >= 1 but got {min(getattr(args, name))}")
    check_device(args.device)
    kind = "capacity" if args.max_batch else "generate"
    args.out = args.out or time.strftime(f"rotkv-{kind}-%Y%m%d-%H%M%S.json", time.gmtime())
    check_out_path(args.out)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    if args.memory_gb is not None:
        if not cuda:
            raise UsageError(f"--memory-gb caps GPU memory and needs CUDA (this run is on {device})")
        total = torch.cuda.get_device_properties(torch.device(device)).total_memory / 1e9
        if not 0 < args.memory_gb <= total:
            raise UsageError(f"--memory-gb has to be in (0, {total:.1f}] (this GPU's memory) but got {args.memory_gb}")
    methods = args.methods or [m for m in DEFAULT_METHODS if cuda or not
                               (m == "hf-static-compile" or m.endswith("+graph"))]
    for m in methods:
        if m in ("hf-dynamic", "hf-static-compile"):
            if m == "hf-static-compile" and not cuda:
                raise UsageError(f"--methods {m} needs CUDA (this run is on {device})")
            continue
        parsed = parse_method(m)
        if parsed is None:
            raise UsageError(f"--methods: unknown method {m!r}; use hf-dynamic, hf-static-compile, rotkv:<preset>, "
                             "rotkv:<preset>+graph, rotkv:<preset>+fold, rotkv:<preset>+graph+fold or "
                             "rotkv:<preset>+graph[+fold]+compile")
        preset, flags = parsed
        if "graph" in flags and not cuda:
            raise UsageError(f"--methods {m} needs CUDA (this run is on {device}): +graph captures a CUDA graph")
        if preset not in PRESETS:
            raise UsageError(f"--methods {m}: unknown preset {preset!r}; available: {sorted(PRESETS)}")
        spec = cache_spec(preset, cache_overrides(args))
        if spec.needs_artifact or args.artifact:
            early_artifact("bench", spec, args.artifact)
    if args.layers is not None:
        if not args.random:
            raise UsageError("--layers applies to --random models only")
        if args.layers < 1:
            raise UsageError(f"--layers has to be >= 1 but got {args.layers}")
    if args.random:
        # the model is built in float32 (then cast to bf16 on CUDA): 4 bytes a parameter at the peak
        gb = random_param_count(args.random, args.layers) * 4 / 1e9
        free = available_gb(device)
        if gb > 0.9 * free:
            layer_gb = (random_param_count(args.random, 2) - random_param_count(args.random, 1)) * 4 / 1e9
            raise UsageError(f"--random {args.random}: building it takes {gb:.1f} GB (float32 weights), more than the "
                             f"{free:.1f} GB free on {device}; pass --layers N (about {layer_gb:.2f} GB a layer)")
        ctx = RANDOM_SHAPES[args.random]["max_position_embeddings"]
    else:
        check_model(args.model)
        from rotkv.hf.models import peek_context

        ctx = peek_context(args.model)
    if ctx and max(args.context) + args.new_tokens > ctx:
        raise UsageError(f"--context {max(args.context)} plus --new-tokens {args.new_tokens} is longer than the model's "
                         f"context of {ctx} tokens; pass --context {ctx - args.new_tokens} or less")
    return device, methods


def run(args) -> int:
    from rotkv import bench
    from rotkv.generation import prefill_tokens_of
    from rotkv.hf.models import load_model

    device, methods = check_args(args)
    import torch

    if args.memory_gb is not None:
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()  # the call needs an index
        torch.cuda.set_per_process_memory_fraction(args.memory_gb * 1e9 / torch.cuda.get_device_properties(index).total_memory,
                                                   index)
    if args.random:
        model, model_id = _random_model(args.random, args.layers, device)
    else:
        loaded = load_model(args.model, device=device)
        model, model_id = loaded.model, loaded.model_id
    import transformers

    # what ran where, once for the file (each row names its commit, device and model too) and when
    meta = {"commit": bench.commit(), "gpu": bench.device_name(torch.device(device)), "model": model_id,
            "utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "methods": methods, "overrides": cache_overrides(args), "prompts": "random token ids",
            "prefill_chunk": args.prefill_chunk, "prefill_tokens": prefill_tokens_of(model) if args.prefill_tokens == "auto"
            else args.prefill_tokens, "prefill_tokens_auto": args.prefill_tokens == "auto",
            "memory_gb": args.memory_gb, "tuning": switches.tuning()}
    out = args.out  # checked before the model loaded
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    if args.max_batch:
        rows = []
        for c in args.context:
            done = list(rows)
            rows += bench.capacity(model, model_id, methods, c, args.new_tokens, args.start, args.limit, args.max_tries,
                                   args.artifact, cache_overrides(args), args.prefill_chunk,
                                   on_row=lambda r, done=done: bench.write(done + r, out, meta),
                                   prefill_tokens=args.prefill_tokens)
            bench.write(rows, out, meta)
        print(bench.capacity_table(rows))
        print(f"wrote {out}")
        return 0
    rows = bench.bench(model, model_id, methods, args.batch, args.context, args.new_tokens, args.artifact,
                       cache_overrides(args), on_row=lambda r: bench.write(r, out, meta), prefill_chunk=args.prefill_chunk,
                       prefill_tokens=args.prefill_tokens)
    bench.write(rows, out, meta)
    print(bench.table(rows))
    print(f"wrote {out}")
    failed = [r for r in rows if r.note]
    for r in failed:
        print(f"rotkv bench: error: {r.method} at batch {r.batch} x {r.context}: {r.note}", file=sys.stderr)
    if failed:
        print(f"rotkv bench: {len(failed)} of {len(rows)} runs failed (NaN rows in the table)", file=sys.stderr)
        return 1
    return 0
