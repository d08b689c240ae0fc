"""`rotkv demo`: a fact hidden in ~2.5K tokens of text, asked about through the quantized cache."""

from __future__ import annotations

import os

from rotkv.cli.common import add_model_args, cache_spec, check_artifact_dir, early_artifact
from rotkv.cli.errors import UsageError, check_device, check_model, note, warn
from rotkv.config import PRESETS, RECOMMENDED_PRESET, artifact_file, artifact_kind, calibration_preset

DEFAULT_PRESETS = ["bf16", "int4", "kivi-2", "naive-int2", "quarot-int2"]
NEEDLE = "The secret code of the blue vault is {code}."
QUESTION = "\n\nWhat is the secret code of the blue vault? Answer with the number only."
ANSWER_PREFIX = "The secret code of the blue vault is"  # starts the reply, so the next tokens are the digits
ANSWER_TOKENS = 10  # tokens generated for the answer


def register(sub) -> None:
    p = sub.add_parser("demo", help="needle-in-a-haystack retrieval through bf16 and INT2 caches, side by side")
    add_model_args(p)
    p.add_argument("--presets", default=None,
                   help=f"comma-separated presets to compare, run as named (default: {','.join(DEFAULT_PRESETS)}, "
                        "plus the calibrated presets whose artifact is in --artifact-dir)")
    p.add_argument("--artifact-dir", default=None,
                   help="folder of artifacts (oscar-mix.safetensors, ...): a calibrated preset in --presets whose "
                        "artifact is missing is calibrated into it first")
    p.add_argument("--tokens", type=int, default=2500, help="approximate context length in tokens (default 2500)")
    p.add_argument("--depth", type=float, default=0.4, help="where the fact sits in the context, 0-1 (default 0.4)")
    p.add_argument("--code", default="4718293", help="the 7-digit fact to retrieve (default 4718293)")
    p.add_argument("--sink", type=int, default=None, help="bf16 sink tokens of every preset (default: the preset's)")
    p.add_argument("--window", type=int, default=None, help="bf16 window tokens of every preset (default: the preset's)")
    p.set_defaults(func=run)


def haystack_text() -> str:
    here = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "eval_python_reference.txt")
    with open(here, encoding="utf-8") as f:
        return f.read()


def build_prompt(tokenizer, tokens: int, depth: float, code: str):
    """(context ids, full ids): the context ends with the haystack; the question is its own chunk."""
    import torch

    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"--depth has to be in [0, 1] but got {depth}")
    words = haystack_text().split(" ")
    # about 1.3 tokens per word in this text; trim by tokens below
    body = " ".join(words[: int(tokens / 1.1)])
    ids = tokenizer(body, add_special_tokens=False).input_ids[: max(64, tokens - 120)]
    body = tokenizer.decode(ids)
    cut = body.rfind(". ", 0, int(len(body) * depth)) + 2
    text = body[:cut] + NEEDLE.format(code=code) + " " + body[cut:]
    marker = "\x00QUESTION\x00"
    templ = [{"role": "user", "content": text + marker}]
    full = tokenizer.apply_chat_template(templ, tokenize=False, add_generation_prompt=True) \
        if getattr(tokenizer, "chat_template", None) else text + marker
    head, tail = full.split(marker)
    ctx = tokenizer(head, add_special_tokens=False, return_tensors="pt").input_ids
    rest = tokenizer(QUESTION + tail + ANSWER_PREFIX, add_special_tokens=False, return_tensors="pt").input_ids
    return ctx, torch.cat([ctx, rest], 1)


def check_args(args) -> tuple[list[str], dict[str, str]]:
    """(presets, artifact per preset), every check that needs no model; says which presets it skips."""
    from rotkv.config import PRESETS

    check_device(args.device)
    check_model(args.model)
    if not 0.0 <= args.depth <= 1.0:
        raise UsageError(f"--depth has to be in [0, 1] but got {args.depth}")
    if args.tokens < 200:
        raise UsageError(f"--tokens has to be >= 200 but got {args.tokens}")
    from rotkv.hf.models import peek_context

    ctx = peek_context(args.model)
    if ctx and args.tokens + ANSWER_TOKENS > ctx:
        raise UsageError(f"--tokens {args.tokens} plus the {ANSWER_TOKENS}-token answer is longer than the model's context "
                         f"of {ctx} tokens; pass --tokens {ctx - ANSWER_TOKENS} or less")
    named = args.presets is not None  # named presets run as named; the default list gains what the folder holds
    presets = [p.strip() for p in (args.presets if named else ",".join(DEFAULT_PRESETS)).split(",") if p.strip()]
    if not presets:
        raise UsageError("--presets is empty")
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        raise UsageError(f"--presets: unknown preset(s) {unknown}; available: {sorted(PRESETS)}")
    artifacts, to_make, skipped = {}, {}, []
    if not args.code.isdigit():
        raise UsageError(f"--code has to be digits (the fact the model is asked to repeat) but got {args.code!r}")
    if args.artifact_dir:
        if not os.path.isdir(args.artifact_dir):
            raise UsageError(f"--artifact-dir {args.artifact_dir} is not a folder")
        from rotkv.rotations import registry

        # the presets named that need an artifact; without --presets also every calibrated preset of fixed
        # width (oscar-int2, optr-int2, ...) whose artifact is in the folder
        for preset, spec in PRESETS.items():
            if not spec.needs_artifact or spec.start_bits is not None or spec.method not in registry.METHODS:
                continue
            if named and preset not in presets:
                continue
            method = spec.method
            path = os.path.join(args.artifact_dir, artifact_file(preset))
            kind = artifact_kind(preset)
            if os.path.exists(path):
                if preset not in presets:
                    presets.append(preset)
                artifacts[preset] = path
            elif "+aqua" in kind:  # made from an oscar-mix-long artifact by its own command, not by the demo
                from rotkv.contract import base_kind

                base = os.path.join(args.artifact_dir, f"{base_kind(kind)}.safetensors")
                how = f"rotkv calibrate --method {kind.split('+')[1]} --base-artifact {base} --out {path}"
                if preset in presets:
                    raise UsageError(f"--presets {preset} needs {path}; make it with `{how}`")
                skipped.append(f"skipping {preset}: no {os.path.basename(path)} in {args.artifact_dir} (make one with "
                               f"`{how}`)")
            elif preset not in presets:
                how = f"rotkv calibrate --method {calibration_preset(preset) if spec.k_bits == 'artifact' else method} --out {path}"
                skipped.append(f"skipping {preset}: no {os.path.basename(path)} in {args.artifact_dir} (make one with "
                               f"`{how}`, or name it in --presets to have it made)")
            else:
                artifacts[preset] = path
                to_make[preset] = path
        # what the missing ones are made from (the base beside them), and that they can be written there
        check_artifact_dir(list(to_make), args.artifact_dir, made_here=True)
    overrides = {k: v for k, v in (("sink", args.sink), ("window", args.window)) if v is not None}
    for name in presets:
        if PRESETS[name].needs_artifact and name not in artifacts:
            want = artifact_file(name)
            raise UsageError(f"--presets {name} needs {want} in --artifact-dir (not given); pass --artifact-dir DIR "
                             "(a missing artifact is calibrated into it) or make it with `rotkv calibrate`")
        if name in to_make:  # made after the model loads (rotkv calibrate's defaults), then used
            cache_spec(name, overrides)
            continue
        early_artifact("demo", cache_spec(name, overrides), artifacts.get(name))
    for line in skipped:  # said once every check has passed (a user error stays one line)
        warn("demo", line)
    if not args.artifact_dir:
        calibrated = sorted(p for p, spec in PRESETS.items()
                            if spec.needs_artifact and spec.start_bits is None and p not in presets)
        if calibrated:
            warn("demo", f"not running the calibrated presets {', '.join(calibrated)}: they need artifacts; "
                         "make them with `rotkv calibrate` (docs/calibration.md) and pass --artifact-dir")
    for name, path in to_make.items():
        method = make_method(name)
        how = (f"`rotkv calibrate --method {method}`'s defaults, but with one long key fit (the one this demo's "
               "context uses)" if method == LONG else f"`rotkv calibrate --method {method}`'s defaults")
        note("demo", f"{name}: no {os.path.basename(path)} in {args.artifact_dir}: it is calibrated into {path} first, "
                     f"with {how}")
    return presets, artifacts, to_make


LONG = "oscar-mix-long"  # the artifact kind whose long refit the demo sizes to its context


def make_method(name: str) -> str:
    """The ``rotkv calibrate --method`` that makes preset ``name``'s artifact."""
    from rotkv.config import calibration_method

    return calibration_preset(name) if PRESETS[name].k_bits == "artifact" else calibration_method(name)


def make_artifacts(loaded, to_make: dict[str, str], context_length: int) -> list[str]:
    """Calibrate the missing artifacts of the requested presets, as ``rotkv eval`` does, except that an
    oscar-mix-long artifact gets only the long key fit a row of ``context_length`` tokens uses (of
    ``rotkv calibrate``'s default lengths): the demo's caches are the same as with the full artifact.
    Returns a line per file written (what it is, how long it took)."""
    import sys
    import time

    from rotkv.calibrate.longfit import DEFAULT_FIT_LENGTHS
    from rotkv.eval.run import calibrator
    from rotkv.rotations.artifact import pick_key_fit

    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    fit = pick_key_fit(list(DEFAULT_FIT_LENGTHS), context_length)
    make = calibrator(loaded, log, fit_lengths=[fit])
    made = []
    for name, path in to_make.items():
        if os.path.exists(path):  # made for a preset that shares it (oscar-mix-long, oscar-refine)
            continue
        if make_method(name) == LONG:
            others = ", ".join(str(n) for n in DEFAULT_FIT_LENGTHS if n != fit)
            log(f"{name}: the long key refit runs at {fit} tokens only, the fit a {context_length}-token row uses "
                f"(`rotkv calibrate --method {LONG}` also fits {others} tokens, for other context lengths)")
        folder = os.path.dirname(os.path.abspath(path))
        before, t0 = set(os.listdir(folder)), time.time()
        why = make(make_method(name), path)
        if why:
            raise RuntimeError(f"cannot make the artifact of {name}: {why}")
        new = sorted(f for f in set(os.listdir(folder)) - before if f.endswith(".safetensors"))
        line = f"{', '.join(os.path.join(os.path.dirname(path), f) for f in new)}: for {name}, {time.time() - t0:.0f} s"
        if make_method(name) == LONG:
            mix = os.path.join(os.path.dirname(path), artifact_file("oscar-mix"))
            line += (f"; key fit of {fit}-token sequences only (`rotkv calibrate --method {LONG} --base-artifact {mix} "
                     f"--out {path}` makes it with every default fit)")
        made.append(line)
    return made


def run(args) -> int:
    presets, artifacts, to_make = check_args(args)
    from rotkv.cache import RotkvCache
    from rotkv.generation import generate
    from rotkv.hf.models import load_model

    print(f"loading {args.model or 'SmolLM2-135M-Instruct'} ...", flush=True)
    loaded = load_model(args.model, device=args.device)
    ctx, ids = build_prompt(loaded.tokenizer, args.tokens, args.depth, args.code)
    length = ids.shape[1] + ANSWER_TOKENS  # the row's whole length: an artifact with several key fits serves the nearest
    made = make_artifacts(loaded, to_make, length)
    print(f"context: {ctx.shape[1]} tokens with the fact at depth {args.depth:.0%}; "
          f"question: {ids.shape[1] - ctx.shape[1]} tokens, prefilled after the context so it reads the stored cache\n")
    rows, reference, used = [], None, []
    for name in presets:
        overrides = {k: v for k, v in (("sink", args.sink), ("window", args.window)) if v is not None}
        cache = RotkvCache(loaded.model, name, artifacts.get(name), context_length=length, **overrides)
        if name in artifacts:
            used.append(f"{name}: {artifacts[name]}{key_fit_note(cache)}")
        g = generate(loaded.model, loaded.tokenizer, ids, cache, max_new_tokens=ANSWER_TOKENS, context=ctx)
        st = cache.stats()
        answer = g.text.strip().splitlines()[0] if g.text.strip() else ""
        reference = reference if reference is not None else (answer if name == "bf16" else None)
        rows.append((name, answer, args.code in answer, st["kv_bytes"], st["kv_bytes_bf16"], st["bits_per_element"],
                     st["resident_bytes"]))
        print(f"  {name:<12} -> {answer!r}", flush=True)
    print()
    print(f"{'preset':<12} {'answer':<14} {'correct':<8} {'same as bf16':<13} {'KV MB':>7} {'vs bf16':>8} {'bits/elem':>9} "
          f"{'held MB':>8}")
    for name, answer, ok, kv, kv16, bpe, held in rows:
        same = "-" if reference is None else ("yes" if answer == reference else "no")
        print(f"{name:<12} {answer[:14]:<14} {'yes' if ok else 'NO':<8} {same:<13} {kv / 1e6:>7.2f} "
              f"{kv16 / kv:>7.1f}x {bpe:>9.2f} {held / 1e6:>8.2f}")
    print("\nKV MB counts codes, metadata and the bf16 sink/window as resident; bits/elem is measured over all tiers; "
          "held MB is what the process holds for the cache (its pools, free pages included).")
    if used:
        print("\nartifacts read:\n" + "\n".join(f"  {line}" for line in used))
    if made:
        print("calibrated by this run (later runs reuse them):\n" + "\n".join(f"  {line}" for line in made))
    print(f"\nrecommended preset: {RECOMMENDED_PRESET} (README, 'Choosing a preset'; its artifact: "
          f"`rotkv calibrate --method {calibration_preset(RECOMMENDED_PRESET)}`)")
    return 0


def key_fit_note(cache) -> str:
    """`` (key fit N tokens)`` for a cache whose artifact's key side was refitted on long sequences, else ``""``."""
    meta = cache.artifact.meta if cache.artifact is not None else {}
    fit = cache.key_fit_length or meta.get("longfit_seq_len")
    return f" (key fit of {fit}-token sequences)" if fit else ""
