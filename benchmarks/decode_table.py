"""Print ``bench_decode.py`` JSON files as tables: one row per (batch, context), one column per INT2
config (ms) and the best bf16 (the faster of flash SDPA and the paged Triton kernel)::

    python benchmarks/decode_table.py benchmarks/results/decode-20261202-6997c50.json
"""

from __future__ import annotations

import collections
import json
import sys


def table(rows: list[dict]) -> list[str]:
    t: dict = collections.defaultdict(dict)
    for r in rows:
        key = (r["batch"], r["context"])
        if r["impl"] == "rotkv_int2_cfg":
            t[key][r["config"]] = r["ms"]
        elif r["impl"] in ("sdpa_bf16", "triton_bf16"):
            t[key]["bf16"] = min(t[key].get("bf16", float("inf")), r["ms"])
    names = sorted({k for v in t.values() for k in v})
    return ["B L " + " ".join(names)] + [
        f"{k} " + " ".join(f"{v.get(n, float('nan')):.4f}" for n in names) for k, v in t.items()]


def main(argv: list[str] | None = None) -> int:
    for path in argv if argv is not None else sys.argv[1:]:
        with open(path) as f:
            print(path, *table(json.load(f)), sep="\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
