"""The calibration corpus: built-in text files (``rotkv/data/calib_*.txt``) or user files, cut into chunks.

Calibration and evaluation text are different files from different sources (``rotkv/data/README.md``).
"""

from __future__ import annotations

import glob
import os

import torch

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


def default_files(kind: str = "calib") -> list[str]:
    """The built-in ``calib_*.txt`` (or ``eval_*.txt``) files, sorted."""
    files = sorted(glob.glob(os.path.join(DATA_DIR, f"{kind}_*.txt")))
    if not files:
        raise FileNotFoundError(f"no built-in {kind}_*.txt files in {DATA_DIR}")
    return files


def token_chunks(tokenizer, files: list[str] | None, tokens: int, chunk_len: int = 512, kind: str = "calib") -> list[torch.Tensor]:
    """``ceil(tokens / chunk_len)`` chunks of ``chunk_len`` token ids ``[1, chunk_len]``, taken
    round-robin from the files (so a short run still sees every source); fewer if the text runs out."""
    per_file = []
    for path in files or default_files(kind):
        with open(path, encoding="utf-8") as f:
            ids = tokenizer(f.read(), return_tensors="pt").input_ids[0]
        per_file.append([ids[i : i + chunk_len] for i in range(0, len(ids) - chunk_len + 1, chunk_len)])
    want = -(-tokens // chunk_len)
    out = []
    for i in range(max(len(p) for p in per_file)):
        for p in per_file:
            if i < len(p) and len(out) < want:
                out.append(p[i].unsqueeze(0))
    if not out:
        raise ValueError(f"the calibration text is shorter than one chunk of {chunk_len} tokens")
    return out
