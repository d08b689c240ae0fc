"""OSCAR calibrated on long sequences (issue 24 lever): the same fit as ``rotkv calibrate --method oscar``
but over chunks of ``--chunk-len`` tokens (default 4096) instead of 512, so the query covariance, key
means and clip ratios see long-range RoPE phases and long-context attention. Calibration text only.

    python benchmarks/calibrate_long.py --chunk-len 4096 --tokens 24576 --out oscar-long.safetensors
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk-len", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=24576, help="all chunks, the 2 held-out ones (clip search) included")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from rotkv.calibrate.run import CalibConfig, calibrate
    from rotkv.hf.models import load_model
    from rotkv.rotations.artifact import save_artifact

    loaded = load_model(None, device="cpu")
    cfg = CalibConfig(method="oscar", tokens=args.tokens, chunk_len=args.chunk_len)
    tensors, meta = calibrate(loaded, cfg)
    meta["chunk_len"] = str(args.chunk_len)
    save_artifact(args.out, tensors, meta)
    print(f"wrote {args.out}: {meta['calib_tokens']} statistics tokens in chunks of {args.chunk_len}, "
          f"{meta['heldout_tokens']} held out; {cfg.timings}")


if __name__ == "__main__":
    main()
