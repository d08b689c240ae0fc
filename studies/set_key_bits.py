"""Write an artifact with given per-layer key widths (``k_bits``), e.g. the layers a keybits run picked elsewhere.

    python studies/set_key_bits.py --base oscar.safetensors --layers 4,7,14,15,18,20,21,23,24,26 --out oscar-mix.safetensors

The headline oscar-mix artifact (docs/results/accuracy.md) has 4-bit keys in layers 4, 7, 14, 15, 18, 20, 21,
23, 24, 26 (keybits on the GPU); this rebuilds it on top of any OSCAR artifact without re-running keybits.
"""

from __future__ import annotations

import argparse

import numpy as np

from rotkv.calibrate.keybits import with_key_bits
from rotkv.rotations.artifact import load_artifact, save_artifact


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True)
    ap.add_argument("--layers", required=True, help="comma-separated layers whose keys get 4 bits")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    art = load_artifact(args.base)
    chosen = [int(x) for x in args.layers.split(",") if x.strip()]
    gains = np.zeros(art.num_layers)
    gains[chosen] = 1.0
    tensors, meta = with_key_bits(art, gains, len(chosen), source="set_key_bits.py", chosen=args.layers)
    save_artifact(args.out, tensors, meta)
    print(f"wrote {args.out}: 4-bit keys in layers {sorted(chosen)}")


if __name__ == "__main__":
    main()
