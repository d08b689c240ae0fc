"""Calibration artifacts: rotations, key means, clip ratios (and later bit widths) in safetensors.

Layout (all tensors float32 unless noted; ``l`` is the layer index, ``H`` KV heads, ``D`` head_dim):

- ``R_K.{l}``: ``[H, D, D]`` or ``[1, D, D]`` (one matrix for the whole layer);
- ``R_V.{l}``: same, absent when values are not rotated at run time (identity or folded);
- ``k_mean.{l}``: ``[H, D]``, the post-RoPE key mean in the unrotated basis;
- ``clip_k``, ``clip_v``: ``[L]`` per-layer clipping ratios;
- ``bits``: ``[L]`` int32 final widths (progressive precision), optional;
- any other tensor a method needs, under its own prefix.

String metadata: ``format_version``, ``method``, ``model_id``, ``config_hash``,
``weights_fingerprint``, ``num_layers``, ``kv_heads``, ``head_dim``, ``bits``, ``group_size``,
``clip_k``, ``clip_v``, ``calib_tokens``, ``date``, ``values_folded`` ("0" or "1").
Never pickle.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rotkv.rotations.base import LayerRotation

FORMAT_VERSION = "1"
REQUIRED_META = ("format_version", "method", "num_layers", "kv_heads", "head_dim", "weights_fingerprint")


class ArtifactMismatch(ValueError):
    """The artifact was made for another model (or is malformed)."""


@dataclass
class Artifact:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str]
    path: str | None = None
    nbytes: int = field(default=0)

    @property
    def num_layers(self) -> int:
        return int(self.meta["num_layers"])

    @property
    def values_folded(self) -> bool:
        return self.meta.get("values_folded", "0") == "1"

    def layer_rotation(self, layer: int) -> LayerRotation:
        h, d = int(self.meta["kv_heads"]), int(self.meta["head_dim"])

        def mat(name: str) -> torch.Tensor | None:
            t = self.tensors.get(f"{name}.{layer}")
            return None if t is None else t.float().expand(h, d, d).contiguous()

        mean = self.tensors.get(f"k_mean.{layer}")
        clip_k = self.tensors.get("clip_k")
        clip_v = self.tensors.get("clip_v")
        return LayerRotation(
            R_K=mat("R_K"),
            R_V=None if self.values_folded else mat("R_V"),
            k_mean=None if mean is None else mean.float(),
            clip_k=None if clip_k is None else float(clip_k[layer]),
            clip_v=None if clip_v is None else float(clip_v[layer]),
        )

    def summary(self) -> str:
        lines = [f"rotkv artifact {self.path or ''}".rstrip()]
        for k in sorted(self.meta):
            lines.append(f"  {k}: {self.meta[k]}")
        lines.append(f"  tensors: {len(self.tensors)} ({self.nbytes / 1e6:.2f} MB)")
        groups: dict[str, int] = {}
        for name in self.tensors:
            groups[name.split(".")[0]] = groups.get(name.split(".")[0], 0) + 1
        for g, n in sorted(groups.items()):
            shape = tuple(next(t for k, t in self.tensors.items() if k.split(".")[0] == g).shape)
            lines.append(f"    {g}: {n} tensor(s), e.g. shape {shape}")
        return "\n".join(lines)


def model_geometry(config) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of a transformers config (text config for multimodal ones)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, getattr(c, "num_key_value_heads", heads) or heads, head_dim


def config_hash(config) -> str:
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    keys = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "rope_theta", "rope_parameters", "max_position_embeddings")
    d = {k: getattr(c, k, None) for k in keys}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def weights_fingerprint(model) -> str:
    """A dtype- and device-independent hash of the query/key projection weights.

    It samples 64 entries of every layer's q_proj and k_proj, rounds them to bf16 (so a bf16
    GPU copy and an fp32 CPU copy agree) and hashes them. Values are folded into v_proj /
    o_proj, so those are left out: a folded model keeps its fingerprint.
    """
    from rotkv.hf.models import attention_modules

    h = hashlib.sha256()
    for attn in attention_modules(model):
        for proj in (attn.q_proj, attn.k_proj):
            w = proj.weight.detach().flatten()
            idx = torch.linspace(0, w.numel() - 1, 64).long().to(w.device)
            h.update(w[idx].to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def model_meta(model, model_id: str) -> dict[str, str]:
    """The metadata fields that tie an artifact to a model."""
    layers, kv_heads, head_dim = model_geometry(model.config)
    return {
        "format_version": FORMAT_VERSION,
        "model_id": str(model_id),
        "config_hash": config_hash(model.config),
        "weights_fingerprint": weights_fingerprint(model),
        "num_layers": str(layers),
        "kv_heads": str(kv_heads),
        "head_dim": str(head_dim),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def save_artifact(path: str, tensors: dict[str, torch.Tensor], meta: dict[str, object]) -> None:
    """Write tensors (made contiguous, on the CPU) and string metadata to ``path``."""
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ValueError(f"artifact metadata is missing {missing}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path,
              metadata={k: str(v) for k, v in meta.items()})


def load_artifact(path: str) -> Artifact:
    if not os.path.exists(path):
        raise FileNotFoundError(f"artifact file not found: {path}")
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata() or {})
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ArtifactMismatch(f"{path} is not a rotkv artifact: metadata is missing {missing}")
    if meta["format_version"] != FORMAT_VERSION:
        raise ArtifactMismatch(f"{path} has format_version {meta['format_version']}, this rotkv reads {FORMAT_VERSION}")
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return Artifact(tensors, meta, path, nbytes)


def validate_artifact(artifact: Artifact, model) -> None:
    """Refuse an artifact made for another model, naming every field that differs."""
    layers, kv_heads, head_dim = model_geometry(model.config)
    want = {"num_layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
    diffs = [f"{k}: artifact {artifact.meta[k]} vs model {v}" for k, v in want.items() if int(artifact.meta[k]) != v]
    if not diffs:
        fp = weights_fingerprint(model)
        if artifact.meta["weights_fingerprint"] != fp:
            diffs.append(f"weights_fingerprint: artifact {artifact.meta['weights_fingerprint']} vs model {fp}")
    if diffs:
        made_for = artifact.meta.get("model_id", "?")
        raise ArtifactMismatch(
            f"artifact {artifact.path} was made for another model ({made_for}): " + "; ".join(diffs)
            + ". Calibrate one for this model with `rotkv calibrate`."
        )
