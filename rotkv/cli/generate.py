"""`rotkv generate`: generate text through a rotkv cache and report its measured size."""

from __future__ import annotations

import json

from rotkv.cli.common import (add_cache_args, add_model_args, cache_overrides, cache_spec, early_artifact, early_group_check,
                              pick_preset)
from rotkv.cli.errors import UsageError, check_device, check_model, note, read_text_file, warn


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text through a quantized KV cache")
    add_model_args(p)
    add_cache_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt text")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None, help="with --sample (default 0.7)")
    p.add_argument("--top-p", type=float, default=None, help="with --sample (default 0.9)")
    p.add_argument("--allow-long", action="store_true",
                   help="run a prompt (plus --max-new-tokens) longer than the model's context instead of refusing it")
    p.add_argument("--no-chat", action="store_true", help="do not wrap the prompt in the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object with the text and the measured sizes")
    p.add_argument("--cuda-graph", action="store_true",
                   help="capture the decode step in a CUDA graph and replay it (greedy; needs CUDA; see rotkv.cache.graph)")
    p.add_argument("--compile-layers", action="store_true",
                   help="with --cuda-graph: compile the model's own layers (norms, RoPE, MLP) into the captured step "
                        "(torch.compile, about 15 s once; see rotkv.cache.compiled)")
    p.set_defaults(func=run)


def check_args(args):
    """Every check that needs no model; returns the prompt text and the artifact the preset reads (or None)."""
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens has to be >= 1 but got {args.max_new_tokens}")
    for flag, value in (("--temperature", args.temperature), ("--top-p", args.top_p)):
        if value is not None and not args.sample:
            raise UsageError(f"{flag} {value} has no effect without --sample (greedy decoding): add --sample or drop {flag}")
    args.temperature = 0.7 if args.temperature is None else args.temperature
    args.top_p = 0.9 if args.top_p is None else args.top_p
    if args.sample and not args.temperature > 0:
        raise UsageError(f"--temperature has to be > 0 but got {args.temperature}")
    if args.sample and not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p has to be in (0, 1] but got {args.top_p}")
    check_device(args.device)
    if args.cuda_graph and args.sample:
        raise UsageError("--cuda-graph decodes greedily: drop --sample")
    if args.compile_layers and not args.cuda_graph:
        raise UsageError("--compile-layers compiles the captured decode step: add --cuda-graph")
    if args.cuda_graph and (args.device == "cpu" or not _cuda()):
        raise UsageError("--cuda-graph needs a CUDA device")
    check_model(args.model)
    from rotkv.hf.models import peek_context

    # the prompt's length is known once tokenized (check_length); --max-new-tokens alone can be refused now
    ctx = peek_context(args.model) if args.max_new_tokens >= 1024 and not args.allow_long else None
    if ctx and args.max_new_tokens >= ctx:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} is longer than the model's context of {ctx} tokens "
                         "with any prompt; lower it, or pass --allow-long to run it anyway")
    flag = "--prompt-file" if args.prompt_file else "--prompt"
    prompt = read_text_file(args.prompt_file, flag) if args.prompt_file else args.prompt
    if not prompt.strip():
        raise UsageError(f"{flag} is empty: give some text to continue")
    args.preset, default = pick_preset(args.preset, args.artifact)
    spec = cache_spec(args.preset, cache_overrides(args))
    art = early_artifact("generate", spec, args.artifact)
    if args.group_size is not None:
        early_group_check(spec, args.model, art)
    if default:
        note("generate", default)
    return prompt, art


def check_length(model, prompt_tokens: int, new_tokens: int, allow_long: bool) -> None:
    """Refuse a prompt that with its new tokens runs past the model's context (max_position_embeddings),
    or with --allow-long say once that it does (the model's output degrades there)."""
    ctx = getattr(getattr(model.config, "get_text_config", lambda: model.config)(), "max_position_embeddings", None)
    total = prompt_tokens + new_tokens
    if not ctx or total <= ctx:
        return
    msg = (f"the prompt ({prompt_tokens} tokens) plus --max-new-tokens {new_tokens} is {total} tokens, "
           f"longer than the model's context of {ctx} tokens")
    if not allow_long:
        raise UsageError(f"{msg}; shorten it, or pass --allow-long to run it anyway")
    warn("generate", f"{msg}: running it (--allow-long); expect degraded output past {ctx}")


def run(args) -> int:
    prompt, art = check_args(args)
    from rotkv.cache import RotkvCache
    from rotkv.generation import encode_prompt, generate
    from rotkv.hf.models import load_model

    loaded = load_model(args.model, device=args.device)
    ids = encode_prompt(loaded.tokenizer, prompt, chat=not args.no_chat)
    if ids.shape[-1] == 0:
        raise UsageError("--prompt encodes to 0 tokens")
    check_length(loaded.model, ids.shape[-1], args.max_new_tokens, args.allow_long)
    # the row's whole length: an artifact with several key fits serves the one nearest it
    cache = RotkvCache(loaded.model, args.preset, art, context_length=ids.shape[-1] + args.max_new_tokens,
                       **cache_overrides(args))
    if args.cuda_graph:
        g = _generate_graph(loaded, ids, cache, args.max_new_tokens, args.compile_layers)
    else:
        g = generate(loaded.model, loaded.tokenizer, ids, cache, args.max_new_tokens,
                     do_sample=args.sample, temperature=args.temperature, top_p=args.top_p)
    st = cache.stats()
    if args.json:
        print(json.dumps({
            "text": g.text, "prompt_tokens": g.prompt_tokens, "new_tokens": len(g.new_tokens),
            "preset": cache.spec.name, "model": loaded.model_id,
            "kv_bytes": int(st["kv_bytes"]), "kv_bytes_bf16": int(st["kv_bytes_bf16"]),
            "resident_bytes": int(st["resident_bytes"]),
            "artifact_bytes": int(st["artifact_bytes"]), "rotation_bytes": int(st["rotation_bytes"]),
            "bits_per_element": round(st["bits_per_element"], 4),
            "body_bits_per_element": round(st["body_bits_per_element"], 4),
            "prefill_s": round(g.prefill_s, 3), "decode_tokens_per_s": round(g.decode_tokens_per_s, 2),
            "key_fit_length": st["key_fit_length"],
        }))
    else:
        print(g.text)
    return 0


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _generate_graph(loaded, ids, cache, max_new_tokens: int, compile_layers: bool = False):
    """Greedy generation with the decode step replayed from a CUDA graph; stops at the EOS token."""
    from rotkv.generation import Generated, generate_batch

    run = generate_batch(loaded.model, ids, cache, max_new_tokens, cuda_graph=True, compile_layers=compile_layers)
    new = run.tokens[0].tolist()
    eos = loaded.tokenizer.eos_token_id
    if eos in new:
        new = new[: new.index(eos)]
    rate = 1000 / run.step_ms if run.step_ms else 0.0
    text = loaded.tokenizer.decode(new, skip_special_tokens=True)
    return Generated(text, new, ids.shape[1], run.prefill_s, rate)
