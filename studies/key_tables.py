"""Add calibrated key tables (non-uniform 2-bit grids or PQ codebooks, rotkv.calibrate.grids) to an artifact:
the ``CacheSpec.k_table`` lever, which no preset uses.

    python studies/key_tables.py --table grid --base-artifact oscar-mix.safetensors --out oscar-mix-grid.safetensors
"""

from __future__ import annotations

import torch


def main(argv=None) -> int:
    import argparse
    import sys
    import time

    from rotkv.config import get_preset
    from rotkv.hf.models import load_model
    from rotkv.contract import validate_artifact
    from rotkv.rotations.artifact import load_artifact, save_artifact

    ap = argparse.ArgumentParser(prog="python studies/key_tables.py",
                                 description="Add calibrated key tables (non-uniform grids or PQ codebooks) to an artifact.")
    ap.add_argument("--table", required=True, choices=["grid", "pq"])
    ap.add_argument("--base-artifact", required=True, help="e.g. oscar-mix.safetensors (rotations, clips, key widths)")
    ap.add_argument("--preset", default="oscar-mix", help="the preset whose clip ratios and metadata the grids follow")
    ap.add_argument("--tokens", type=int, default=4096, help="calibration tokens (default 4096)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    loaded = load_model(args.model, device=args.device, dtype=torch.float32)
    art = load_artifact(args.base_artifact)
    validate_artifact(art, loaded.model)
    spec = get_preset(args.preset)
    if spec.bits is None:
        raise ValueError(f"preset {args.preset!r} does not quantize: no tables to fit")
    t0 = time.time()
    from rotkv.calibrate.grids import fit_grids, fit_pq_books

    fit = fit_grids if args.table == "grid" else fit_pq_books
    tables = fit(loaded.model, loaded.tokenizer, art, spec, args.tokens)
    if args.table == "grid":
        tables = {"k_grid": tables["k_grid"]}
    save_artifact(args.out, dict(art.tensors) | tables,
                  dict(art.meta) | {"k_table": args.table, "k_table_tokens": str(args.tokens)})
    print(f"wrote {args.out}: {args.table} tables {[tuple(t.shape) for t in tables.values()]} in {time.time() - t0:.0f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
