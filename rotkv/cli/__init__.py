"""The `rotkv` command line. Each subcommand lives in its own module with a `register(subparsers)`.

Exit codes: 0 success, 2 a user error (one line naming the flag or field), 1 any other failure (one
line, and the traceback with ``--debug`` or ``ROTKV_DEBUG=1``); see rotkv.cli.errors.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from rotkv.cli.errors import debug_requested, report

# One line per subcommand module, in the order a user meets them (`rotkv --help` lists them so); each
# defines register(subparsers) which adds its parser and sets `func` (called with the parsed args,
# returning an exit code).
SUBCOMMANDS = [
    "rotkv.cli.demo",
    "rotkv.cli.calibrate",
    "rotkv.cli.inspect",
    "rotkv.cli.generate",
    "rotkv.cli.eval",
    "rotkv.cli.lm_eval",
    "rotkv.cli.bench",
    "rotkv.cli.build_kernels",
    "rotkv.cli.export",
]


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (with a pointer to --help), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def version() -> str:
    """``rotkv X.Y.Z``, with the commit (and ``-dirty``) when rotkv runs from a git checkout."""
    import os
    import subprocess

    import rotkv

    out = f"rotkv {rotkv.__version__}"
    root = os.path.dirname(os.path.dirname(os.path.abspath(rotkv.__file__)))
    if os.path.exists(os.path.join(root, ".git")):
        try:
            git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True, text=True,  # noqa: E731
                                            timeout=10, check=True).stdout.strip()
            out += f" (git {git('rev-parse', '--short', 'HEAD')}"
            out += "-dirty)" if git("status", "--porcelain", "--untracked-files=no") else ")"
        except (OSError, subprocess.SubprocessError):
            pass
    return out


class _Version(argparse.Action):
    """--version, computed only when asked (it runs git)."""

    def __call__(self, parser, namespace, values, option_string=None):
        print(version())
        parser.exit(0)


INT_MAX = 2**31 - 1  # every integer flag fits an int32 (token counts, sizes, seeds)


def bounded_int(text: str) -> int:
    """The type of every integer flag: a whole number in [-INT_MAX, INT_MAX] (argparse names the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if abs(value) > INT_MAX:
        raise argparse.ArgumentTypeError(f"{text} is out of range (at most {INT_MAX})")
    return value


def bounded_float(text: str) -> float:
    """The type of every number flag: a finite number."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def _bound_numbers(parser: argparse.ArgumentParser) -> None:
    """Give every ``type=int`` / ``type=float`` flag of ``parser`` (and its subcommands) the bounded types."""
    for action in parser._actions:
        if action.type is int:
            action.type = bounded_int
        elif action.type is float:
            action.type = bounded_float
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _bound_numbers(child)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="rotkv", description="Rotated INT2 KV cache for LLM inference")
    p.add_argument("--version", action=_Version, nargs=0, help="print the version (and git commit) and exit")
    p.add_argument("--debug", action="store_true", help="print the traceback of a failure (also: ROTKV_DEBUG=1)")
    sub = p.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    for child in sub.choices.values():  # `rotkv generate ... --debug` works as well as `rotkv --debug generate`
        child.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    _bound_numbers(p)
    return p


def main(argv: list[str] | None = None) -> int:
    import warnings

    from rotkv.cli.errors import warn
    from rotkv.config import RotkvWarning

    args = build_parser().parse_args(argv)
    shown = warnings.showwarning

    def show(message, category, *a, **k):  # rotkv's own warnings as `rotkv <command>: warning: ...`
        if issubclass(category, RotkvWarning):
            warn(args.command, str(message))
        else:
            shown(message, category, *a, **k)

    warnings.showwarning = show
    try:
        from rotkv import switches

        switches.reload()  # the environment, read as the command starts: a bad variable fails here, before any work
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"rotkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (`rotkv inspect A | head`): stop quietly, as Unix tools do
        try:  # and keep the interpreter's last flush from failing again on the closed pipe
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    except Exception as e:  # user errors: one line, exit 2; anything else: one line and the --debug hint, exit 1
        return report(args.command, e, debug_requested(args))
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":
    sys.exit(main())
