"""The `rotkv` command line. Each subcommand lives in its own module with a `register(subparsers)`."""

from __future__ import annotations

import argparse
import importlib
import sys

# One line per subcommand module; each defines register(subparsers) which adds its parser and
# sets `func` (called with the parsed args, returning an exit code).
SUBCOMMANDS = [
    "rotkv.cli.generate",
    "rotkv.cli.demo",
    "rotkv.cli.calibrate",
    "rotkv.cli.inspect",
    "rotkv.cli.eval",
    "rotkv.cli.bench",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rotkv", description="Rotated INT2 KV cache for LLM inference")
    sub = p.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # bad input: one clear line, no traceback
        print(f"rotkv {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
