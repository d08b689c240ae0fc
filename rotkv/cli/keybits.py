"""``python -m rotkv.cli.keybits``: the older spelling of ``rotkv calibrate --method oscar-mix``
(per-layer key widths on top of an OSCAR artifact, :mod:`rotkv.calibrate.keybits`), with its flag
names (``--layers``, ``--length``, ``--new-tokens``, ``--windows``); the same checks and errors."""

from __future__ import annotations

import sys

def main(argv=None) -> int:
    """``python -m rotkv.cli.keybits``: kept as an alias of ``rotkv calibrate --method oscar-mix
    --base-artifact A --key-layers N`` (the same checks and errors)."""
    from rotkv.cli import Parser
    from rotkv.cli.errors import debug_requested, report

    ap = Parser(prog="python -m rotkv.cli.keybits",
                description="alias of `rotkv calibrate --method oscar-mix`: per-layer key widths on an OSCAR artifact")
    ap.add_argument("--model", default=None, help="smollm2 (default), a .gguf file or a local HF model directory")
    ap.add_argument("--base-artifact", default=None,
                    help="the OSCAR artifact to start from (default: calibrate one, as rotkv calibrate --method oscar)")
    ap.add_argument("--layers", type=int, default=None, help="how many layers get 4-bit keys (default: a third)")
    ap.add_argument("--out", required=True, help="output .safetensors (the base artifact plus k_bits and k_gain)")
    ap.add_argument("--length", type=int, default=1024, help="context tokens per window (default 1024)")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode tokens scored per window (default 32)")
    ap.add_argument("--windows", type=int, default=2, help="windows of calibration text (default 2)")
    ap.add_argument("--data", nargs="+", default=None, help="text files (default: the built-in calibration corpus)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--debug", action="store_true", help="print the traceback of a failure")
    args = ap.parse_args(argv)
    from rotkv.cli import calibrate as cli

    argv2 = ["--method", "oscar-mix", "--out", args.out, "--device", args.device,
             "--key-length", str(args.length), "--key-new-tokens", str(args.new_tokens), "--key-windows", str(args.windows)]
    for flag, value in (("--model", args.model), ("--base-artifact", args.base_artifact), ("--key-layers", args.layers)):
        if value is not None:
            argv2 += [flag, str(value)]
    if args.data:
        argv2 += ["--data", *args.data]
    sub = Parser(prog="rotkv").add_subparsers()
    cli.register(sub)
    ns = sub.choices["calibrate"].parse_args(argv2)
    try:
        return cli.run(ns)
    except Exception as e:  # noqa: BLE001 - the CLI's rules: one line, rc 2 for a user error
        msg = str(e).replace("--key-layers", "--layers").replace("--key-length", "--length")
        msg = msg.replace("--key-new-tokens", "--new-tokens").replace("--key-windows", "--windows")
        return report("calibrate", type(e)(msg) if isinstance(e, ValueError) else e, debug_requested(args))


if __name__ == "__main__":
    sys.exit(main())
