"""`rotkv eval`: decode-regime quality, attention error and RULER-style retrieval, methods and peers side by side."""

from __future__ import annotations

import argparse
import os
import sys

from rotkv.cli.common import check_artifact_dir, with_flags
from rotkv.cli.errors import UsageError, check_out_dir, resolve_device, warn
from rotkv.config import PRESETS, CacheSpec


def _tokens_or_preset(text: str):
    """``--sink`` / ``--window``: a token count, or ``preset`` (each preset keeps its own)."""
    if text == "preset":
        return text
    from rotkv.cli import bounded_int

    try:
        return bounded_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens (at most {2**31 - 1}) or 'preset', "
                                         f"got {text!r}") from None


def _list(s: str | None) -> list[str] | None:
    return None if s is None else [x.strip() for x in s.split(",") if x.strip()]


MIN_LENGTH = 256  # the smallest context the tasks are tested at (the smoke profile's)
# EvalConfig's fields as the flags that set them (its errors name the field)
EVAL_FLAGS = {"methods": "--methods", "tasks": "--tasks", "niah_variants": "--variants", "lengths": "--lengths",
              "niah_samples": "--samples", "nll_windows": "--windows", "new_tokens": "--new-tokens",
              "window_batch": "--window-batch",
              "threads": "--threads", "device": "--device", "seed": "--seed"}


def parse_lengths(items: list[str] | None, tasks: list[str]) -> dict[str, list[int]] | None:
    """``["2048,8192"]`` (every task) or ``["nll=2048,8192", "niah=1024,2048"]`` (per task); 1K/2K suffixes allowed.
    A value that is not a whole number of tokens >= MIN_LENGTH, or an unknown task, is a UsageError naming --lengths."""
    from rotkv.eval.config import TASKS

    if not items:
        return None

    def num(x: str) -> int:
        x = x.strip().lower()
        try:
            n = float(x[:-1]) * 1024 if x.endswith("k") else float(x)
        except ValueError:
            raise UsageError(f"--lengths: {x!r} is not a number of tokens (e.g. 2048 or 2K)") from None
        if n != int(n) or n < MIN_LENGTH:
            raise UsageError(f"--lengths values have to be whole numbers of tokens >= {MIN_LENGTH} but got {x!r}")
        return int(n)

    def nums(vals: str) -> list[int]:
        out = [num(v) for v in vals.split(",") if v.strip()]
        if not out:
            raise UsageError(f"--lengths: no length in {vals!r}")
        return out

    out: dict[str, list[int]] = {}
    bare: list[int] = []  # "--lengths 4096 8192" and "--lengths 4096,8192" alike: every value kept
    for item in items:
        if "=" in item:
            task, vals = item.split("=", 1)
            if task.strip() not in TASKS:
                raise UsageError(f"--lengths: unknown task {task.strip()!r} in {item!r}; tasks: {', '.join(TASKS)}")
            out.setdefault(task.strip(), []).extend(n for n in nums(vals) if n not in out.get(task.strip(), []))
        else:
            bare.extend(n for n in nums(item) if n not in bare)
    for t in tasks:
        if bare and t not in out:  # a task named with "=" keeps its own lengths
            out[t] = list(bare)
    return out


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate methods and peers: nll / attn-error / niah, report and plots")
    p.add_argument("--model", default=None, help="smollm2 (default), a .gguf file or a local HF model directory")
    p.add_argument("--methods", default=None, help="comma-separated rotkv presets and peers "
                   f"(presets: {', '.join(PRESETS)}; peers: those of rotkv.eval.peers, e.g. hf-quanto-int4); "
                   "default: the profile's")
    p.add_argument("--tasks", default=None, help="comma-separated: nll, attn-error, niah (default: all)")
    p.add_argument("--lengths", nargs="+", default=None,
                   help="context lengths: '2048,8192' for every task or per task: 'nll=2K,8K niah=1K,2K,3K'")
    p.add_argument("--out", required=True, help="output folder (results.json, report.md, plots, cache)")
    p.add_argument("--text", nargs="+", default=None, help="evaluation text files for nll and attn-error "
                   "(default: rotkv/data/eval_*.txt)")
    p.add_argument("--haystack", nargs="+", default=None, help="text files for the essay haystack of niah")
    p.add_argument("--artifact-dir", default=None, help="calibration artifacts, one per method: oscar.safetensors, "
                   "optr.safetensors, ...; a missing one is calibrated with the defaults and stored there")
    p.add_argument("--sink", type=_tokens_or_preset, default=None,
                   help="bf16 sink tokens of every rotkv preset (profile: 16), or 'preset': each preset's own (oscar-refine's "
                        "4, which pays for its refine tier)")
    p.add_argument("--window", type=_tokens_or_preset, default=None,
                   help="bf16 window tokens of every rotkv preset (full: 64), or 'preset': each preset's own")
    p.add_argument("--window-share", type=float, default=None,
                   help="the window of every rotkv preset grows to this share of each row (0: fixed; default: the "
                        "presets' own, 1/64 for oscar-mix)")
    p.add_argument("--profile", default="smoke", choices=["smoke", "full"])
    p.add_argument("--variants", default=None, help="niah variants: noise, essay, multikey, multivalue (default: all)")
    p.add_argument("--depths", default=None, help="needle depths of the single-needle variants, e.g. 0.1,0.5,0.9")
    p.add_argument("--samples", type=int, default=None, help="haystacks per niah cell")
    p.add_argument("--seed", type=int, default=None,
                   help="seed of the niah haystacks and needles (default 0): another seed asks other questions")
    p.add_argument("--windows", type=int, default=None, help="nll windows at 2K (fewer at longer contexts)")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens teacher-forced after each nll context")
    p.add_argument("--window-batch", type=int, default=None,
                   help="nll windows scored together as the rows of one cache (default 1; on a GPU, 8-16 make "
                        "fewer, larger calls; results equal to float rounding, cached apart)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is fastest on a busy machine)")
    p.add_argument("--device", default="cpu",
                   help="cpu (default), cuda, cuda:N, or auto (cuda when available); the model runs in float32 "
                        "there, as the KL reference and under every cache")
    p.add_argument("--suite", default=None, help="a multi-domain evaluation suite (mixed: prose, code, docs, "
                   "dialogue; rotkv/data/suite): nll on each domain's text in OUT/<domain>/, then OUT/suite.md with "
                   "the mean over domains and paired intervals; its defaults: --lengths 2048,8192, --windows 16, "
                   "--new-tokens 128 at every length, --sink preset --window preset")
    p.add_argument("--split", default=None, choices=["dev", "test"],
                   help="the suite's part: dev (default; choose levers on it) or test (report it)")
    p.add_argument("--report-only", action="store_true",
                   help="rebuild results.json, report and plots from --out's cache under the settings its run "
                        "recorded (config.json); --methods, --tasks and --variants may pick a subset")
    p.set_defaults(func=run)


def run(args) -> int:
    _suite_defaults(args)
    if args.report_only:  # the run's own settings (config.json); nothing loads, so no device is needed
        return _report_only(args)
    device = resolve_device(args.device)  # a bad device is a one-line error before anything loads
    check_out_dir(args.out)
    if args.window_share is not None:  # CacheSpec's own check, worded with the flag
        try:
            CacheSpec(window_share=args.window_share)
        except ValueError as e:
            raise UsageError(with_flags(str(e))) from None
    for flag in ("sink", "window"):
        value = getattr(args, flag)
        if isinstance(value, int) and value < 0:
            raise UsageError(f"--{flag} has to be >= 0 or 'preset' but got {value}")
    for flag in ("threads", "samples", "windows", "new_tokens", "window_batch"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UsageError(f"--{flag.replace('_', '-')} has to be >= 1 but got {value}")
    if args.depths:
        try:
            [float(x) for x in _list(args.depths)]
        except ValueError:
            raise UsageError(f"--depths has to be numbers in [0, 1] like 0.1,0.5 but got {args.depths!r}") from None
    from rotkv.eval.config import TASKS, make_config

    tasks = _list(args.tasks)
    try:
        cfg = make_config(
            args.profile, model=args.model, methods=_list(args.methods), tasks=tasks,
            lengths=parse_lengths(args.lengths, tasks or list(TASKS)), texts=args.text, haystacks=args.haystack,
            artifact_dir=args.artifact_dir, sink=args.sink, window=args.window, window_share=args.window_share,
            niah_variants=_list(args.variants),
            niah_depths=[float(x) for x in _list(args.depths)] if args.depths else None, niah_samples=args.samples,
            nll_windows=args.windows, new_tokens=args.new_tokens, window_batch=args.window_batch,
            threads=args.threads, device=device, seed=args.seed,
        )
    except UsageError:
        raise
    except FileNotFoundError as e:
        raise UsageError(f"--text / --haystack: {e}") from None
    except ValueError as e:
        msg = str(e).replace("needle depths", "--depths")
        for field, flag in EVAL_FLAGS.items():
            msg = msg.replace(f"`{field}`", flag)
        raise UsageError(msg) from None
    if args.artifact_dir is not None:
        if not os.path.isdir(args.artifact_dir):
            raise UsageError(f"--artifact-dir {args.artifact_dir} is not a folder")
        check_artifact_dir([m for m in cfg.methods if m in PRESETS], args.artifact_dir, made_here=True)
    _check_context(cfg)
    for name in cfg.methods:  # a refine preset's small sink pays for its tier: say when the run overrides it
        spec = PRESETS.get(name)
        if spec is not None and spec.refine_tokens and isinstance(cfg.sink, int) and cfg.sink != spec.sink:
            warn("eval", f"{name} runs with sink {cfg.sink}, not its own {spec.sink} (its smaller sink pays for its "
                         "refine tier); pass --sink preset to keep each preset's own")
    if args.suite:
        return _suite(args, cfg)
    from rotkv.eval.run import evaluate

    records = evaluate(cfg, args.out, log=lambda s: print(s, file=sys.stderr, flush=True))
    if not records:
        raise RuntimeError("no method could run (each one's reason is above); nothing was evaluated")
    return _wrote(args.out, records)


def _check_context(cfg) -> None:
    """Refuse a context length past the model's (read from its config; the model's answers degrade there)."""
    from rotkv.hf.models import peek_context

    ctx = peek_context(cfg.model)
    lengths = [n for v in list(cfg.lengths.values()) + list(cfg.niah_variant_lengths.values()) for n in v]
    if ctx and lengths and max(lengths) > ctx:
        raise UsageError(f"--lengths {max(lengths)} is longer than the model's context of {ctx} tokens; "
                         f"pass lengths up to {ctx}")


def _wrote(out: str, records: list) -> int:
    """Write the report of ``out`` (results.json is there) and say what was written."""
    from rotkv.eval.report import write_report

    paths = write_report(out)
    print(f"{len(records)} records; wrote {os.path.join(out, 'results.json')}, " + ", ".join(paths))
    return 0


def _suite_defaults(args) -> None:
    """``--suite``: its checks and its protocol's defaults where the flags give none (``--split dev``, nll only)."""
    if args.suite is None:
        if args.split is not None:
            raise UsageError("--split picks a part of a --suite: pass --suite NAME too")
        return
    from rotkv.eval.suite import SUITE_NEW_TOKENS, SUITE_WINDOWS, SUITES

    if args.suite not in SUITES:
        raise UsageError(f"--suite has to be one of {', '.join(SUITES)} but got {args.suite!r}")
    if args.text:
        raise UsageError("--suite brings its own texts: pass --suite or --text, not both")
    if _list(args.tasks) not in (None, ["nll"]):
        raise UsageError(f"--suite runs the nll task only but got --tasks {args.tasks}")
    if args.report_only:
        return
    args.split = args.split or "dev"
    args.tasks = "nll"
    args.lengths = args.lengths or ["2048,8192"]
    args.windows = args.windows or SUITE_WINDOWS
    args.new_tokens = args.new_tokens or SUITE_NEW_TOKENS
    args.sink = "preset" if args.sink is None else args.sink
    args.window = "preset" if args.window is None else args.window


def _suite(args, cfg) -> int:
    """The suite's domains, one eval folder each under --out, and the summary over them."""
    from rotkv.eval.suite import evaluate_suite

    summary = evaluate_suite(cfg, args.suite, args.split, args.out,
                             log=lambda s: print(s, file=sys.stderr, flush=True))
    if not any(b["methods"] for b in summary["lengths"].values()):
        raise RuntimeError("no method could run in every domain (each one's reason is above); nothing was summarized")
    print(f"suite {args.suite} ({args.split}): wrote {os.path.join(args.out, 'suite.md')} and suite.json, one folder "
          f"per domain under {args.out}")
    return 0


def _report_only(args) -> int:
    """results.json, the report and plots again from ``--out``'s cache, under the settings that run recorded
    (its config.json; a run stopped part way, or one made on a GPU host, too). --methods, --tasks and
    --variants pick a subset; the other flags are the run's own."""
    from rotkv.eval.config import from_run
    from rotkv.eval.run import rebuild

    if args.suite:  # every domain's folder under --out, then the summary
        return _suite_report_only(args)

    try:
        cfg = from_run(args.out, methods=_list(args.methods), tasks=_list(args.tasks),
                       niah_variants=_list(args.variants))
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    return _wrote(args.out, rebuild(cfg, args.out))


def _suite_report_only(args) -> int:
    """``--suite NAME --report-only``: each domain's folder rebuilt under the settings it recorded, then the summary."""
    import json

    from rotkv.eval.config import from_run
    from rotkv.eval.suite import SUITES, rebuild_suite

    first = os.path.join(args.out, SUITES[args.suite][0])
    try:
        cfg = from_run(first, methods=_list(args.methods))
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"--report-only --suite: {args.out} holds no suite run ({e})") from None
    split = args.split
    if split is None:
        try:
            with open(os.path.join(args.out, "suite.json")) as f:
                split = json.load(f)["split"]
        except (OSError, ValueError, KeyError):
            raise UsageError(f"--report-only --suite: {args.out} has no suite.json naming its split: "
                             "pass --split") from None
    rebuild_suite(cfg, args.suite, split, args.out)
    print(f"suite {args.suite} ({split}): rebuilt {os.path.join(args.out, 'suite.md')} and suite.json")
    return 0
