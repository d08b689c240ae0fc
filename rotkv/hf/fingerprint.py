"""What ties an artifact to a model: the config hash, the weights' fingerprint and the metadata that records them
(rotkv.rotations.artifact reads and writes the format; it takes the model's geometry and fingerprint from here)."""

from __future__ import annotations

import datetime
import hashlib
import json

import torch

from rotkv.hf.geometry import attention_modules, model_geometry, text_config


def config_hash(config) -> str:
    c = text_config(config)
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
    h = hashlib.sha256()
    for attn in attention_modules(model):
        for proj in (attn.q_proj, attn.k_proj):
            w = proj.weight.detach().flatten()
            idx = torch.linspace(0, w.numel() - 1, 64).long().to(w.device)
            h.update(w[idx].to(torch.bfloat16).float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def model_meta(model, model_id: str) -> dict[str, str]:
    """The metadata fields that tie an artifact to a model."""
    from rotkv.rotations.artifact import FORMAT_VERSION

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
