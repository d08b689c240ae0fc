"""`rotkv calibrate`: fit rotations, key means and clip ratios for a model and write an artifact."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="calibrate rotations (hadamard, oscar, optr, pairwise) into a safetensors artifact")
    p.add_argument("--model", default=None, help="smollm2 (default), a .gguf file or a local HF model directory")
    p.add_argument("--method", required=True, choices=["hadamard", "oscar", "optr", "pairwise", "pmkvq"],
                   help="pmkvq: per-layer final widths for progressive precision (see --base-artifact)")
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--data", nargs="+", default=None, help="text files (default: the built-in calibration corpus)")
    p.add_argument("--tokens", type=int, default=None,
                   help="calibration tokens, held-out chunks included (default 16384; 2048 for pmkvq)")
    p.add_argument("--bits", type=int, default=2, choices=[2, 4, 8])
    p.add_argument("--group-size", type=int, default=None, help="default: 64, or head_dim when smaller")
    p.add_argument("--granularity", choices=["layer", "kv-head"], default=None,
                   help="one rotation per layer or per KV head (default: layer; kv-head for optr)")
    p.add_argument("--cs", choices=["exact", "weighted", "diag"], default="exact", help="OSCAR's value covariance form")
    p.add_argument("--base", choices=["hadamard", "oscar"], default="oscar", help="OptR's starting rotation")
    p.add_argument("--no-key-mean", action="store_true", help="fit clips (and OptR) without key mean-centering")
    p.add_argument("--sink", type=int, default=16, help="leading tokens left unquantized in the error objective")
    p.add_argument("--steps", type=int, default=80, help="OptR Adam steps per phase")
    p.add_argument("--no-clip-search", action="store_true", help="store clip ratios 1.0 (no clipping)")
    p.add_argument("--device", default="cpu")
    pm = p.add_argument_group("pmkvq")
    pm.add_argument("--base-artifact", default=None, help="pmkvq: an artifact whose rotations the widths are fitted for")
    pm.add_argument("--budget-bpe", type=float, default=3.5, help="pmkvq: mean body bits per element the widths may use")
    pm.add_argument("--stretch", type=int, default=4, help="pmkvq: positional interpolation factor s")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.method == "pmkvq":
        import argparse

        from rotkv.calibrate import pmkvq

        return pmkvq.run(argparse.Namespace(
            model=args.model, out=args.out, base_artifact=args.base_artifact, rotation="identity",
            budget_bpe=args.budget_bpe, data=args.data, tokens=args.tokens or 2048, chunk_len=512,
            stretch=args.stretch, group_size=args.group_size or 64, clip_k=None, clip_v=None, device=args.device))
    args.tokens = args.tokens or 16384
    from rotkv.calibrate.run import CalibConfig, calibrate
    from rotkv.hf.models import load_model
    from rotkv.rotations.artifact import load_artifact, save_artifact

    cfg = CalibConfig(method=args.method, tokens=args.tokens, bits=args.bits, group_size=args.group_size,
                      granularity=args.granularity, cs=args.cs, base=args.base, key_mean=not args.no_key_mean,
                      sink=args.sink, steps=args.steps, search_clips=not args.no_clip_search, files=args.data)
    loaded = load_model(args.model, device=args.device)
    tensors, meta = calibrate(loaded, cfg)
    save_artifact(args.out, tensors, meta)
    t = cfg.timings
    print(f"wrote {args.out}: {args.method}, capture {t['capture_s']:.1f} s, fit {t['fit_s']:.1f} s, "
          f"total {t['total_s']:.1f} s ({meta['threads']} threads)")
    print(load_artifact(args.out).summary())
    return 0
