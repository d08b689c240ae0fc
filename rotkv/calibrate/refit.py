"""Re-fit only the clip ratios of an artifact for new bits / group size (``rotkv calibrate --refit-clip``).

The deliberate override of the artifact contract (rotkv.contract.check_contract): the
rotations and key means are kept as they are, and the per-layer clip ratios are searched again
(rotkv.calibrate.clip) on held-out calibration chunks at the new width and group size. OptR
rotations were optimized at the old settings; only their clips are re-fitted, and the metadata says so
(``refit_from``, ``refit_tokens``).
"""

from __future__ import annotations

import time

import torch
from tqdm.auto import tqdm

from rotkv.calibrate import clip
from rotkv.calibrate.corpus import token_chunks
from rotkv.calibrate.run import collect
from rotkv.contract import kind_meta, validate_artifact
from rotkv.hf.fingerprint import model_meta
from rotkv.hf.geometry import attention_modules, model_geometry
from rotkv.quant.quantizer import check_bits, check_group
from rotkv.rotations.artifact import Artifact
from rotkv.rotations.base import LayerRotation


def check_refittable(artifact: Artifact) -> None:
    """Refuse what a clip re-fit cannot handle: folded values, per-layer widths, no rotations."""
    where = f"--refit-clip {artifact.path}"
    if artifact.values_folded:
        raise ValueError(f"{where}: R_V is folded into the weights; re-fit the unfolded artifact")
    if "bits" in artifact.tensors:
        raise ValueError(f"{where}: the artifact has per-layer widths (pmkvq); re-fit its base artifact, then run pmkvq again")
    if "R_K.0" not in artifact.tensors:
        raise ValueError(f"{where}: the artifact has no rotations whose clips could be re-fitted")


def refit_clips(loaded, artifact: Artifact, bits: int, group_size: int | None = None, tokens: int = 2048,
                files: list[str] | None = None, sink: int | None = None, chunk_len: int = 512,
                grid=clip.GRID, progress: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of ``artifact`` with clip ratios searched again for ``bits`` and ``group_size``.

    Every one of the ``ceil(tokens / chunk_len)`` chunks is held out (no statistics are needed).
    ``group_size`` None: min(64, head_dim); ``sink`` None: the artifact's (else 16).
    """
    model, tok = loaded.model, loaded.tokenizer
    check_bits(bits)
    check_refittable(artifact)
    validate_artifact(artifact, model)
    layers, _, head_dim = model_geometry(model.config)
    group = group_size or min(64, head_dim)
    check_group(group, head_dim)
    sink = int(artifact.meta.get("sink", 16)) if sink is None else sink
    key_mean = artifact.meta.get("key_mean_fitted", "1") == "1"
    t0 = time.perf_counter()
    chunks = token_chunks(tok, files, tokens, chunk_len)
    every = set(range(len(chunks)))
    rec = collect(model, chunks, sink, keep=every, keep_kv=False, heldout=every, progress=progress, desc="capture")
    attn = attention_modules(model)
    clips_k, clips_v = [], []
    for l in tqdm(range(layers), desc="refit clips", disable=not progress):
        r = artifact.layer_rotation(l)
        rot = LayerRotation(r.R_K, r.R_V, r.k_mean if key_mean else None, R_Q=r.R_Q)
        w_o = attn[l].o_proj.weight.detach().float().cpu()
        scaling = float(getattr(attn[l], "scaling", head_dim**-0.5))
        held = [rec.layers[l].samples[i] for i in sorted(every)]
        ck, cv = clip.search_layer(held, rot, w_o, bits, group, sink, scaling, grid)
        clips_k.append(ck)
        clips_v.append(cv)
    tensors = dict(artifact.tensors)
    tensors["clip_k"] = torch.tensor(clips_k, dtype=torch.float32)
    tensors["clip_v"] = torch.tensor(clips_v, dtype=torch.float32)
    meta = dict(artifact.meta)
    fresh = model_meta(model, loaded.model_id)
    meta.update({
        "format_version": fresh["format_version"],
        "bits": str(bits), "group_size": str(group), "sink": str(sink),
        "clip_k": ",".join(f"{c:g}" for c in clips_k), "clip_v": ",".join(f"{c:g}" for c in clips_v),
        "refit_from": f"{artifact.path} (bits {artifact.meta.get('bits', '?')}, group_size "
                      f"{artifact.meta.get('group_size', '?')})",
        "refit_tokens": str(sum(c.shape[1] for c in chunks)),
        "refit_seconds": f"{time.perf_counter() - t0:.1f}",
        "date": fresh["date"],
    } | kind_meta(artifact.kind, artifact))  # the same kind as the artifact it was made from
    return tensors, meta
