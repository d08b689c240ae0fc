"""`rotkv calibrate`: fit rotations, key means and clip ratios for a model and write an artifact,
or (``--refit-clip``) re-fit only the clip ratios of an existing artifact for new bits / group size."""

from __future__ import annotations

from rotkv.cli.errors import UsageError, check_model, check_out_path, resolve_device, warn
from rotkv.config import KEY_MAP_CLASSES
from rotkv.quant.widths import WIDTHS
from rotkv.rotations import registry


def register(sub) -> None:
    widths = [m for m in registry.calibrated() if registry.get(m).widths]
    p = sub.add_parser("calibrate", help=f"calibrate rotations ({', '.join(registry.rotation_fits())}) "
                                         "into a safetensors artifact")
    p.add_argument("--model", default=None, help="smollm2 (default), a .gguf file or a local HF model directory")
    p.add_argument("--method", default=None, choices=registry.calibrated() + [MIX, MIX_LONG, AQUA],
                   help=f"{'/'.join(widths)}: per-layer final widths for progressive precision (see --base-artifact); "
                        f"{MIX}: the recommended preset's complete artifact, OSCAR plus per-layer key widths "
                        f"(--key-layers); {MIX_LONG}: that artifact with its key side refitted on long sequences "
                        f"(--long-seq-len); {AQUA}: an {MIX_LONG} artifact (--base-artifact) plus the inter-layer key "
                        "maps of preset oscar-aqua (--tokens, default 16384); required unless --refit-clip")
    p.add_argument("--refit-clip", default=None, metavar="ARTIFACT",
                   help="keep this artifact's rotations and key means, re-fit only its clip ratios for --bits and "
                        "--group-size (the deliberate override of the preset/artifact contract)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--data", nargs="+", default=None, help="text files (default: the built-in calibration corpus)")
    p.add_argument("--tokens", type=int, default=None,
                   help="calibration tokens, held-out chunks included, in whole chunks of 512 (default 16384; "
                        "2048 for pmkvq and --refit-clip; at least 1536 with the clip search)")
    p.add_argument("--bits", type=int, default=2, choices=list(WIDTHS), help="default: 2")
    p.add_argument("--group-size", type=int, default=None, help="default: 64, or head_dim when smaller")
    kv_head = [m for m in registry.calibrated() if registry.get(m).granularity == "kv-head"]
    p.add_argument("--granularity", choices=["layer", "kv-head"], default=None,
                   help=f"one rotation per layer or per KV head (default: layer; kv-head for {', '.join(kv_head)})")
    p.add_argument("--cs", choices=["exact", "weighted", "diag"], default="exact", help="OSCAR's value covariance form")
    p.add_argument("--base", choices=registry.bases(), default=registry.DEFAULT_METHOD, help="OptR's starting rotation")
    p.add_argument("--no-key-mean", action="store_true", help="fit clips (and OptR) without key mean-centering")
    p.add_argument("--sink", type=int, default=None,
                   help="leading tokens left unquantized in the error objective (default 16; --refit-clip: the artifact's)")
    p.add_argument("--steps", type=int, default=80, help="OptR Adam steps per phase")
    p.add_argument("--no-clip-search", action="store_true", help="store clip ratios 1.0 (no clipping)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N, or auto (cuda when available)")
    pm = p.add_argument_group("pmkvq and oscar-mix")
    pm.add_argument("--base-artifact", default=None,
                    help="pmkvq: an artifact whose rotations the widths are fitted for; oscar-mix: an OSCAR artifact "
                         "to measure the key widths on (default: calibrate it first)")
    pm.add_argument("--budget-bpe", type=float, default=3.5, help="pmkvq: mean body bits per element the widths may use")
    pm.add_argument("--stretch", type=int, default=4, help="pmkvq: positional interpolation factor s")
    mix = p.add_argument_group("oscar-mix (per-layer key widths: the decode KL with one layer's keys at 4 bits)")
    mix.add_argument("--key-layers", type=int, default=None, help="layers whose keys get 4 bits (default: a third; oscar-mix-long: the base's, re-ranked by its k_gain when given)")
    mix.add_argument("--key-length", type=int, default=1024, help="context tokens per window (default 1024)")
    mix.add_argument("--key-new-tokens", type=int, default=32, help="decode tokens scored per window (default 32)")
    mix.add_argument("--key-windows", type=int, default=2, help="windows of calibration text (default 2)")
    mix.add_argument("--long-seq-len", default="4096,8192", metavar="N[,N...]",
                     help=f"{MIX_LONG}: tokens per refit sequence (default 4096,8192); a comma list stores "
                          "one key fit per length, the first as the primary, and a cache given its context length "
                          "(rotkv generate/eval/bench do) uses the fit nearest it")
    mix.add_argument("--long-sequences", type=int, default=2, help=f"{MIX_LONG}: refit sequences (default 2)")
    mix.add_argument("--key-scale", type=float, default=None, metavar="ALPHA",
                     help=f"{MIX_LONG}: also fit a key scaling in the query eigenbasis (the artifact's k_scale, "
                          "rotkv.rotations.keyscale) with exponent ALPHA in [0, 1]; 0 is OSCAR's rotation alone "
                          "(default: none)")
    aq = p.add_argument_group("aqua (inter-layer key maps, preset oscar-aqua)")
    aq.add_argument("--aqua-layers", choices=["all", "odd"], default="all",
                    help="the layers that get a map: all (default; each predicts from the one before, a chain) or "
                         "odd (each predicts from the plain even layer before it: no chain)")
    aq.add_argument("--aqua-map", choices=KEY_MAP_CLASSES, default="dense",
                    help="the maps' class: dense (default; any map before RoPE, with a bias), rope (commutes with "
                         "RoPE: a complex H x H matrix per frequency pair on mean-centred keys, its bias after RoPE; a "
                         "kernel could fold it into the query) or rope-head (one complex number per head and frequency)")
    p.set_defaults(func=run)


MIX = "oscar-mix"  # not a rotation method: the oscar-mix preset's artifact (rotkv.calibrate.keybits)
MIX_LONG = "oscar-mix-long"  # oscar-mix's artifact, key side refitted on long sequences (rotkv.calibrate.longfit)
AQUA = "aqua"  # an oscar-mix-long artifact plus inter-layer key maps (rotkv.calibrate.aqua; preset oscar-aqua)
AQUA_CHUNK = 2048  # tokens per calibration chunk of the key maps
LONG_CALL = 512  # tokens per model call of the long refit (rotkv.calibrate.longfit.refit's `call`)


def check_mix_args(args):
    """--method oscar-mix: every check that needs no model (the base artifact, --key-*)."""
    from rotkv.calibrate.keybits import check_layers
    from rotkv.hf.models import peek_geometry

    for flag in ("key_length", "key_new_tokens", "key_windows"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} has to be >= 1 but got {getattr(args, flag)}")
    if args.key_new_tokens < 2:
        raise UsageError(f"--key-new-tokens has to be >= 2 but got {args.key_new_tokens}")
    layers = None
    if args.base_artifact:
        from rotkv.config import PRESETS
        from rotkv.contract import check_contract, kind_serves, make_command
        from rotkv.rotations.artifact import load_artifact

        art = load_artifact(args.base_artifact)
        # the OSCAR rotations the key widths are measured on; a long refit also replaces another's key side whole
        if not (kind_serves(art.kind, "oscar") or (args.method == MIX_LONG and art.kind == MIX_LONG)):
            also = " (or oscar-mix-long)" if args.method == MIX_LONG else ""
            raise UsageError(f"--base-artifact {args.base_artifact} is {art.describe()}; --method {args.method} is made "
                             f"from an oscar or oscar-mix artifact{also}: make one with `{make_command('oscar')}`")
        try:
            check_contract(art, PRESETS["oscar-int2"].replace(artifact_kind=None))  # bits, group size: the kind is above
        except ValueError as e:
            raise UsageError(f"--base-artifact: {e}") from None
        layers = int(art.meta["num_layers"])
    else:
        from rotkv.calibrate.run import CalibConfig

        try:
            CalibConfig(method="oscar", tokens=args.tokens or 16384, files=args.data)
        except ValueError as e:
            raise UsageError(str(e).replace("`tokens`", "--tokens")) from None
    geometry = peek_geometry(args.model)
    if geometry is not None:
        layers = geometry[0]
    if layers is not None:
        try:
            check_layers(args.key_layers, layers, "--key-layers")
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif args.key_layers is not None and args.key_layers < 1:
        raise UsageError(f"--key-layers has to be >= 1 but got {args.key_layers}")


def parse_long_seq_len(text) -> list[int]:
    """--long-seq-len: one length or a comma list, each at least the refit's call size (512 tokens)."""
    from rotkv.rotations.artifact import parse_fit_lengths

    try:
        lengths = parse_fit_lengths(text, "--long-seq-len")
    except ValueError as e:
        raise UsageError(str(e).replace("`--long-seq-len`", "--long-seq-len")) from None
    if short := [n for n in lengths if n < LONG_CALL]:
        raise UsageError(f"--long-seq-len has to be >= {LONG_CALL} (the refit's call size) but got {short[0]}")
    return lengths


def check_args(args):
    """Every check that needs no model (so a bad --out fails before, not after, the calibration)."""
    if (args.method is None) == (args.refit_clip is None):
        raise UsageError("give exactly one of --method (a new calibration) and --refit-clip ARTIFACT")
    args.device = resolve_device(args.device)
    check_model(args.model)
    check_out_path(args.out)
    if args.sink is not None and args.sink < 0:
        raise UsageError(f"--sink has to be >= 0 but got {args.sink}")
    if args.group_size is not None and args.group_size < 1:
        raise UsageError(f"--group-size has to be a positive divisor of head_dim but got {args.group_size}")
    if args.group_size is not None and not args.refit_clip:  # head_dim from the model's config (no weights read)
        from rotkv.hf.models import peek_geometry

        if (geometry := peek_geometry(args.model)) is not None:
            _group_check(args.group_size, geometry[2])
    for flag in ("steps", "long_sequences", "key_length", "key_new_tokens", "key_windows", "stretch"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} has to be >= 1 but got {getattr(args, flag)}")
    if not 0 < args.budget_bpe <= 16:
        raise UsageError(f"--budget-bpe has to be in (0, 16] (bits per element) but got {args.budget_bpe}")
    if args.tokens is not None and args.tokens < 1:
        raise UsageError(f"--tokens has to be >= 1 but got {args.tokens}")
    for path in args.data or []:
        from rotkv.cli.errors import read_text_file

        read_text_file(path, "--data")
    if args.aqua_layers != "all" and args.method != AQUA:
        raise UsageError(f"--aqua-layers picks the layers of --method {AQUA}'s key maps, not of --method {args.method}")
    if args.aqua_map != "dense" and args.method != AQUA:
        raise UsageError(f"--aqua-map picks the class of --method {AQUA}'s key maps, not of --method {args.method}")
    if args.key_scale is not None and (args.method != MIX_LONG or not 0.0 <= args.key_scale <= 1.0):
        raise UsageError(f"--key-scale is an exponent in [0, 1] for --method {MIX_LONG} but got "
                         f"{args.key_scale} with --method {args.method}")
    if args.method == AQUA:
        return check_aqua_args(args)
    if args.method in (MIX, MIX_LONG):
        if args.method == MIX_LONG:
            args.long_seq_len = parse_long_seq_len(args.long_seq_len)
            if args.long_sequences < 1:
                raise UsageError(f"--long-sequences has to be >= 1 but got {args.long_sequences}")
        _check_context(args)
        return check_mix_args(args)
    if args.refit_clip:
        from rotkv.calibrate.refit import check_refittable
        from rotkv.rotations.artifact import load_artifact

        art = load_artifact(args.refit_clip)
        check_refittable(art)
        if args.group_size is not None:
            _group_check(args.group_size, int(art.meta["head_dim"]))
        return art
    if registry.get(args.method).widths:
        if args.base_artifact:
            from rotkv.rotations.artifact import load_artifact

            load_artifact(args.base_artifact)
        return None
    from rotkv.calibrate.run import CalibConfig

    try:
        cfg = CalibConfig(method=args.method, tokens=args.tokens or 16384, bits=args.bits, group_size=args.group_size,
                          granularity=args.granularity, cs=args.cs, base=args.base, key_mean=not args.no_key_mean,
                          sink=16 if args.sink is None else args.sink, steps=args.steps,
                          search_clips=not args.no_clip_search, files=args.data)
    except ValueError as e:
        msg = str(e)
        for field in ("tokens", "steps", "group_size", "bits", "sink", "granularity"):
            msg = msg.replace(f"`{field}`", f"--{field.replace('_', '-')}")
        if "--tokens" in msg and not args.no_clip_search:
            msg += " (or pass --no-clip-search)"
        raise UsageError(msg) from None
    if cfg.rounded_tokens != cfg.tokens:
        warn("calibrate", f"--tokens {cfg.tokens} is rounded up to {cfg.rounded_tokens} (whole chunks of {cfg.chunk_len})")
    return cfg


def check_aqua_args(args):
    """--method aqua: the base artifact (an oscar-mix-long one) and the calibration text; returns the base."""
    from rotkv.calibrate.aqua import BASE_KIND
    from rotkv.contract import make_command
    from rotkv.rotations.artifact import load_artifact

    if not args.base_artifact:
        raise UsageError(f"--method {AQUA} adds key maps to an {BASE_KIND} artifact: pass --base-artifact "
                         f"{BASE_KIND}.safetensors (make one with `{make_command(BASE_KIND)}`)")
    art = load_artifact(args.base_artifact)
    if art.kind != BASE_KIND:
        raise UsageError(f"--base-artifact {args.base_artifact} is {art.describe()}; --method {AQUA} is made from an "
                         f"{BASE_KIND} artifact: make one with `{make_command(BASE_KIND, art)}`")
    if any(name.partition(".")[0] == "k_scale" for name in art.tensors):
        raise UsageError(f"--base-artifact {args.base_artifact} scales its keys (k_scale); --method {AQUA} needs "
                         "orthogonal key rotations")
    if args.group_size is not None and args.group_size != int(art.meta.get("group_size", args.group_size)):
        raise UsageError(f"--group-size {args.group_size} differs from the base artifact's "
                         f"{art.meta['group_size']}; --method {AQUA} keeps the base's")
    from rotkv.hf.models import peek_context

    ctx = peek_context(args.model)
    if ctx and ctx < AQUA_CHUNK:
        raise UsageError(f"--method {AQUA} fits on chunks of {AQUA_CHUNK} tokens, longer than the model's context "
                         f"of {ctx}")
    return art


def _check_context(args) -> None:
    """oscar-mix / oscar-mix-long: the windows and refit sequences fit the model's context (its config)."""
    from rotkv.hf.models import peek_context

    ctx = peek_context(args.model)
    if not ctx:
        return
    if args.key_length + args.key_new_tokens > ctx:
        raise UsageError(f"--key-length {args.key_length} plus --key-new-tokens {args.key_new_tokens} is longer than the "
                         f"model's context of {ctx} tokens")
    if args.method == MIX_LONG and max(args.long_seq_len) > ctx:
        raise UsageError(f"--long-seq-len {max(args.long_seq_len)} is longer than the model's context of {ctx} tokens")


def _group_check(group: int, head_dim: int) -> None:
    from rotkv.quant.quantizer import check_group

    try:
        check_group(min(group, head_dim), head_dim)
    except ValueError as e:
        raise UsageError(str(e).replace("`group_size`", "--group-size")) from None


def run(args) -> int:
    checked = check_args(args)
    if args.refit_clip:
        return refit(args, checked)
    if args.method == AQUA:
        return aqua(args, checked)
    if args.method in (MIX, MIX_LONG):
        return mix(args)
    if registry.get(args.method).widths:
        import argparse

        from rotkv.calibrate import pmkvq

        return pmkvq.run(argparse.Namespace(
            model=args.model, out=args.out, base_artifact=args.base_artifact, rotation="identity",
            budget_bpe=args.budget_bpe, data=args.data, tokens=args.tokens or 2048, chunk_len=512,
            stretch=args.stretch, group_size=args.group_size or 64, clip_k=None, clip_v=None, device=args.device))
    from rotkv.calibrate.run import calibrate
    from rotkv.hf.models import load_model
    from rotkv.rotations.artifact import load_artifact, save_artifact

    cfg = checked
    loaded = load_model(args.model, device=args.device)
    tensors, meta = calibrate(loaded, cfg)
    save_artifact(args.out, tensors, meta)
    t = cfg.timings
    print(f"wrote {args.out}: {args.method}, capture {t['capture_s']:.1f} s, fit {t['fit_s']:.1f} s, "
          f"total {t['total_s']:.1f} s ({meta['threads']} threads)")
    print(load_artifact(args.out).summary())
    return 0


def refit(args, artifact) -> int:
    """``--refit-clip``: the artifact's rotations and key means, clip ratios searched again."""
    from rotkv.calibrate.refit import refit_clips
    from rotkv.hf.models import load_model
    from rotkv.rotations.artifact import load_artifact, save_artifact

    loaded = load_model(args.model, device=args.device)
    tensors, meta = refit_clips(loaded, artifact, args.bits, args.group_size, tokens=args.tokens or 2048,
                                files=args.data, sink=args.sink)
    save_artifact(args.out, tensors, meta)
    print(f"wrote {args.out}: clip ratios of {args.refit_clip} re-fitted for bits {meta['bits']}, "
          f"group_size {meta['group_size']} in {meta['refit_seconds']} s")
    print(load_artifact(args.out).summary())
    return 0


def mix(args) -> int:
    """``--method oscar-mix``: the OSCAR base (calibrated here unless --base-artifact) plus per-layer key widths."""
    import sys
    import time

    import torch

    from rotkv.calibrate.keybits import calibrate_mix
    from rotkv.calibrate.longfit import calibrate_mix_long
    from rotkv.hf.models import load_model
    from rotkv.rotations.artifact import load_artifact, save_artifact

    t0 = time.time()
    # key widths already in the base (an oscar-mix artifact given to oscar-mix-long) are kept, not measured here
    widths_from_base = (args.method == MIX_LONG and args.base_artifact is not None
                        and "k_bits" in load_artifact(args.base_artifact).tensors)
    loaded = load_model(args.model, device=args.device)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    kw = dict(length=args.key_length, new=args.key_new_tokens, windows=args.key_windows, tokens=args.tokens)
    if args.method == MIX_LONG:
        tensors, meta = calibrate_mix_long(loaded, args.base_artifact, args.long_seq_len, args.long_sequences,
                                           files=args.data, log=log, layers=args.key_layers,
                                           key_scale=args.key_scale, **kw)
    else:
        tensors, meta = calibrate_mix(loaded, args.base_artifact, args.key_layers, files=args.data, log=log, **kw)
    save_artifact(args.out, tensors, meta)
    base = f"base {args.base_artifact}" if args.base_artifact else f"OSCAR calibrated in {meta.get('calib_seconds', '?')} s"
    if widths_from_base:
        how = "re-ranked by the base's k_gain" if args.key_layers is not None else "the base's"
        widths = f"4-bit keys in layers {meta['keybits_layers']} ({how})"
    else:
        widths = f"4-bit keys in layers {meta['keybits_layers']}, measured in {meta['keybits_seconds']} s"
    long = ""
    if args.method == MIX_LONG:
        fits = meta.get("key_fit_lengths", meta["longfit_seq_len"])
        secs = sum(int(x) for x in meta.get("key_fit_seconds", meta["longfit_seconds"]).split(","))
        long = f"; key side refitted on {fits}-token sequences in {secs} s"
    print(f"wrote {args.out}: {args.method} ({base}; {widths}{long}; total {time.time() - t0:.0f} s, "
          f"{torch.get_num_threads()} threads)")
    print(load_artifact(args.out).summary())
    return 0


def aqua(args, base) -> int:
    """``--method aqua``: the base oscar-mix-long artifact plus the inter-layer key maps (rotkv.calibrate.aqua)."""
    import time

    from rotkv.calibrate.aqua import calibrate_aqua
    from rotkv.contract import validate_artifact
    from rotkv.hf.models import load_model
    from rotkv.rotations.artifact import ArtifactMismatch, load_artifact, save_artifact

    t0 = time.time()
    loaded = load_model(args.model, device=args.device)
    try:
        validate_artifact(base, loaded.model)
    except ArtifactMismatch as e:
        raise UsageError(f"--base-artifact: {e}") from None
    tensors, meta = calibrate_aqua(loaded, base, tokens=args.tokens or 16384, chunk=AQUA_CHUNK, files=args.data,
                                   layers=args.aqua_layers, map_class=args.aqua_map)
    save_artifact(args.out, tensors, meta)
    print(f"wrote {args.out}: {AQUA} (base {args.base_artifact}; key maps of {meta['aqua_map_bytes']} bytes fitted on "
          f"{meta['aqua_tokens']} tokens in {time.time() - t0:.0f} s)")
    print(load_artifact(args.out).summary())
    return 0
