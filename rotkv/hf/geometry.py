"""What rotkv reads from a transformers model's structure: its geometry and its attention modules.

A leaf module (it imports nothing from rotkv), so that loading (rotkv.hf.models), artifacts
(rotkv.rotations.artifact), folding and calibration all read the model the same way without
importing each other.
"""

from __future__ import annotations


def text_config(config):
    """The text part of a transformers config (the config itself for text-only models)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_geometry(config) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of a transformers config (text config for multimodal ones)."""
    c = text_config(config)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, getattr(c, "num_key_value_heads", heads) or heads, head_dim


def attention_modules(model) -> list:
    """The self-attention modules (``torch.nn.Module`` with q/k/v/o projections), ordered by layer index."""
    mods = [
        m for m in model.modules()
        if hasattr(m, "layer_idx") and all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    ]
    return sorted(mods, key=lambda m: m.layer_idx)
