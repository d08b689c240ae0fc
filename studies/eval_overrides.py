"""``rotkv eval`` with CacheSpec fields it has no flag for, set on every rotkv method (a study tool).

    python studies/eval_overrides.py refine_salient=2,refine_every=14 -- --suite mixed --split dev ... --out DIR

The fields (integers, floats, true/false) are added to each rotkv method's overrides; the results cache tells them
apart where its fingerprint names the field (``rotkv.eval.run.SPEC_KEYED``), and this tool refuses any other field.
The run's ``config.json`` records this tool's argv.
"""

from __future__ import annotations

import sys

from rotkv.eval import methods
from rotkv.eval.run import SPEC_KEYED


def parse(text: str) -> dict:
    """``a=1,b=true,c=0.5`` -> ``{"a": 1, "b": True, "c": 0.5}``."""
    out = {}
    for part in filter(None, text.split(",")):
        key, _, val = part.partition("=")
        low = val.lower()
        out[key] = True if low == "true" else False if low == "false" else float(val) if "." in val else int(val)
    return out


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 1:
        print(__doc__, file=sys.stderr)
        return 2
    extra = parse(argv[0])
    bad = sorted(set(extra) - set(SPEC_KEYED))
    if bad:
        raise SystemExit(f"eval_overrides: {bad} would not be told apart in the results cache; fields: {SPEC_KEYED}")
    plain = methods.cached_method

    def with_extra(name, sink, window, window_share=None):
        m = plain(name, sink, window, window_share)
        if m.kind == "rotkv":
            m.overrides.update(extra)
        return m

    methods.cached_method = with_extra
    from rotkv.cli import main as cli_main

    print(f"eval_overrides: {extra} on every rotkv method", file=sys.stderr)
    return cli_main(["eval", *argv[2:]])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
