"""`rotkv lm-eval ARGS`: lm-evaluation-harness's own command line with the model ``rotkv`` registered
(:mod:`rotkv.integrations.lm_eval`; docs/lm-eval.md). Needs ``pip install -e '.[lmeval]'``."""

from __future__ import annotations

import argparse

from rotkv.cli.errors import UsageError


def register(sub) -> None:
    p = sub.add_parser("lm-eval", help="run lm-evaluation-harness tasks through a rotkv cache (needs .[lmeval])",
                       description="lm_eval's command line with the model `rotkv` registered, e.g. `rotkv lm-eval "
                                   "run --model rotkv --model_args preset=quarot-int2,sink=16,window=64 --tasks "
                                   "arc_easy --device cpu`; `rotkv lm-eval run --help` shows lm_eval's own options")
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm_eval's arguments, passed on unchanged")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise UsageError("lm-eval needs lm-evaluation-harness: pip install -e '.[lmeval]'") from None
    from rotkv.integrations.lm_eval import main

    return main(list(args.lm_eval_args))
