"""The registered attention function ("rotkv") and its mask function.

transformers looks both up by ``config._attn_implementation``. The mask function hands the
attention function the 2D padding mask (which tells each row's real tokens) and builds the
standard SDPA mask only when a layer that rotkv does not manage (a bf16 sliding-window layer,
or a run without a rotkv cache) needs it. The attention function rotates queries and reads the
quantized cache through :meth:`rotkv.cache.layer.HybridLayer.attend`.

transformers does not pass the cache to the attention function, so a cache layer's ``update``
routes the call (:func:`rotkv.cache.route.route`): it records itself under its layer index, and the
attention function finds it by its module's ``layer_idx`` (:func:`rotkv.cache.route.routed`), for the
key states that ``update`` returned only. A cache that wraps rotkv's layers routes the call to itself
the same way.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rotkv.cache.route import route, routed  # noqa: F401 (route: re-exported)

NAME = "rotkv"


class RotkvMask:
    """A padding mask ``[B, kv_len]`` (bool, or None when every position is real) plus a lazily built
    4D SDPA mask for layers that rotkv does not manage."""

    def __init__(self, padding: torch.Tensor | None, sdpa_kwargs: dict):
        self.padding = padding
        self._kwargs = sdpa_kwargs
        self._sdpa: torch.Tensor | None = None
        self._built = False

    def sdpa(self) -> torch.Tensor | None:
        if not self._built:
            self._sdpa, self._built = sdpa_mask(**self._kwargs), True
        return self._sdpa


def rotkv_mask(**kwargs) -> RotkvMask:
    padding = kwargs.get("attention_mask")
    if padding is not None and padding.ndim != 2:
        raise ValueError(f"rotkv needs a 2D padding mask [batch, tokens], got shape {tuple(padding.shape)}")
    if padding is not None and bool(padding.all()):
        padding = None
    return RotkvMask(padding, kwargs)


@torch.compiler.disable  # a compiled model breaks its graph here (rotkv.cache.compiled)
def rotkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """AttentionInterface entry: ``query [B, q_heads, q, D]``; returns ``([B, q, q_heads, D], None)``."""
    layer = routed(module, key)
    if layer is None:  # a layer rotkv does not manage (sliding window) or a run without a RotkvCache
        mask = attention_mask.sdpa() if isinstance(attention_mask, RotkvMask) else attention_mask
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError("rotkv attention does not support logit soft-capping")
    q = query.shape[-2]
    real = None
    if isinstance(attention_mask, RotkvMask) and attention_mask.padding is not None:
        real = attention_mask.padding[:, -q:].to(query.device)
        if bool(real.all()):
            real = None
    elif attention_mask is not None and not isinstance(attention_mask, RotkvMask):
        raise ValueError("rotkv attention got a prepared (4D) mask; pass a 2D padding mask instead")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return layer.attend(query, real, scale), None


def install(model) -> None:
    """Register the attention and mask functions and switch the model to them (public APIs only)."""
    AttentionInterface.register(NAME, rotkv_attention)
    AttentionMaskInterface.register(NAME, rotkv_mask)
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
