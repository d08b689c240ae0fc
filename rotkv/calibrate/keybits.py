"""Per-layer key widths from the decode KL on calibration text: which layers' keys get 4 bits.

The INT2 error of this cache is in the keys (docs/results/diagnosis.md), and some layers carry much
more of it than others. For each layer l, a cache of the preset (``oscar-int2`` by default, with the
base artifact) is run with the keys of layer l alone at 4 bits, over windows of calibration text
(context prefilled in chunks, then teacher-forced decode tokens, as ``rotkv eval``'s nll task); the
layer's gain is the drop in mean KL(plain model || cache) against the preset itself. The ``--layers``
layers with the largest gains get 4-bit keys: the artifact written is the base artifact plus
``k_bits [L]`` (int32) and ``k_gain [L]`` (float32), read by presets with ``k_bits="artifact"``.

A first-order, gradient-based ranking (PM-KVQ's bound, keys only) picked worse layers on SmolLM2
(docs/results/accuracy.md), hence the forward-only measurement here: L + 1 cache runs per window.

    python -m rotkv.calibrate.keybits --base-artifact oscar.safetensors --layers 10 --out oscar-mix.safetensors
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
from tqdm.auto import tqdm

from rotkv.hf import compat


@torch.inference_mode()
def _logp(model, ids, cache=None, keep=1):
    kw = {compat.cache_kwarg(model): cache} if cache is not None else {"use_cache": False}
    out = model(input_ids=ids, logits_to_keep=keep, **kw)
    return torch.log_softmax(out.logits[0, -keep:].float(), -1)


def decode_kl(model, make_cache, ids: torch.Tensor, length: int, new: int, chunk: int, ref: torch.Tensor) -> torch.Tensor:
    """Per-token KL(ref || cache) ``[new]`` of one window: prefill ``length`` tokens in chunks, then decode."""
    cache = make_cache()
    lps = []
    for c0 in range(0, length, chunk):
        lp = _logp(model, ids[:, c0:min(c0 + chunk, length)], cache)[-1]
    lps.append(lp)
    for t in range(new - 1):
        lps.append(_logp(model, ids[:, length + t:length + t + 1], cache)[-1])
    lp = torch.stack(lps)
    return (ref.exp() * (ref - lp)).sum(-1).clamp_min(0)


def layer_gains(loaded, artifact, preset: str = "oscar-int2", length: int = 1024, new: int = 32, windows: int = 2,
                chunk: int = 512, sink: int = 16, window: int = 64, files=None, progress: bool = True) -> tuple[np.ndarray, float]:
    """(gain ``[L]``: mean KL of the preset minus mean KL with layer l's keys at 4 bits, the preset's mean KL)."""
    from rotkv.cache import RotkvCache
    from rotkv.calibrate.corpus import token_chunks
    from rotkv.hf.models import sliding_layers

    model, tok = loaded.model, loaded.tokenizer
    n_layers = model.config.num_hidden_layers
    cached = [i for i, w in enumerate(sliding_layers(model)) if w is None]  # sliding layers stay the model's own
    span = length + new
    need = -(-span // 512) * 512
    chunks = token_chunks(tok, files, windows * need, 512)
    stream = torch.cat(chunks, 1).to(model.device)
    if stream.shape[1] < windows * span:
        raise ValueError(f"the calibration text has {stream.shape[1]} tokens, fewer than {windows} windows of {span}")
    starts = [w * (stream.shape[1] - span) // max(windows - 1, 1) for w in range(windows)]
    kw = dict(sink=sink, window=window, prefill_chunk=chunk)
    runs = [None] + cached
    kl = {r: [] for r in runs}
    bar = tqdm(total=len(runs) * windows, desc="key widths", disable=not progress)
    for s in starts:
        ids = stream[:, s:s + span]
        ref = _logp(model, ids[:, :span - 1], keep=new)
        for r in runs:
            extra = {} if r is None else {"k_bits": f"{r}:4"}
            kl[r].append(decode_kl(model, lambda: RotkvCache(model, preset, artifact, **kw, **extra), ids, length, new,
                                   chunk, ref))
            bar.update()
    bar.close()
    base = torch.cat(kl[None]).mean().item()
    gains = np.array([base - torch.cat(kl[i]).mean().item() if i in kl else float("-inf") for i in range(n_layers)])
    return gains, base


def with_key_bits(artifact, gains: np.ndarray, layers: int, **info) -> tuple[dict, dict]:
    """(tensors, metadata) of ``artifact`` plus ``k_bits`` (4 for the ``layers`` largest gains, else 2) and ``k_gain``."""
    order = np.argsort(-gains)
    bits = np.full(len(gains), 2, dtype=np.int32)
    bits[order[:layers]] = 4
    gain = torch.tensor(np.where(np.isfinite(gains), gains, 0.0), dtype=torch.float32)  # sliding layers: 0
    tensors = dict(artifact.tensors) | {"k_bits": torch.tensor(bits), "k_gain": gain}
    meta = dict(artifact.meta) | {f"keybits_{k}": str(v) for k, v in info.items()}
    return tensors, meta


def main(argv=None) -> int:
    from rotkv.hf.models import load_model
    from rotkv.rotations.artifact import load_artifact, save_artifact, validate_artifact

    ap = argparse.ArgumentParser(prog="python -m rotkv.calibrate.keybits", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="smollm2 (default), a .gguf file or a local HF model directory")
    ap.add_argument("--base-artifact", required=True, help="the rotation artifact of --preset (e.g. oscar.safetensors)")
    ap.add_argument("--preset", default="oscar-int2", help="the preset whose key widths are chosen (default: oscar-int2)")
    ap.add_argument("--layers", type=int, required=True, help="how many layers get 4-bit keys")
    ap.add_argument("--out", required=True, help="output .safetensors (the base artifact plus k_bits and k_gain)")
    ap.add_argument("--length", type=int, default=1024, help="context tokens per window (default 1024)")
    ap.add_argument("--new-tokens", type=int, default=32, help="decode tokens scored per window (default 32)")
    ap.add_argument("--windows", type=int, default=2, help="windows of calibration text (default 2)")
    ap.add_argument("--data", nargs="+", default=None, help="text files (default: the built-in calibration corpus)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    loaded = load_model(args.model, device=args.device, dtype=torch.float32)
    art = load_artifact(args.base_artifact)
    validate_artifact(art, loaded.model)
    if not 0 <= args.layers <= loaded.model.config.num_hidden_layers:
        raise ValueError(f"`--layers` has to be in [0, {loaded.model.config.num_hidden_layers}] but got {args.layers}")
    t0 = time.time()
    gains, base = layer_gains(loaded, art, args.preset, args.length, args.new_tokens, args.windows, files=args.data)
    tensors, meta = with_key_bits(art, gains, args.layers, preset=args.preset, length=args.length,
                                  new_tokens=args.new_tokens, windows=args.windows, base_kl=f"{base:.5f}",
                                  seconds=f"{time.time() - t0:.0f}")
    save_artifact(args.out, tensors, meta)
    order = [i for i in np.argsort(-gains).tolist() if np.isfinite(gains[i])]
    print(f"{args.preset} KL {base:.4f} on calibration text; gains by layer (best first): "
          + ", ".join(f"{i}:{gains[i]:+.4f}" for i in order))
    print(f"wrote {args.out}: 4-bit keys in layers {sorted(order[:args.layers])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
