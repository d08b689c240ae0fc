"""What every rotkv layer shares: the paged layer (:class:`rotkv.cache.layer.HybridLayer`) and the
per-row reference (:class:`rotkv.cache.rowstore.RowStoreLayer`, with its budgeted subclasses).

A layer holds its spec, its rotation and its (key, value) codecs, resolved once per layer by
:func:`rotkv.cache.assembly.plan_cache`. It follows transformers' ``CacheLayerMixin``: ``update``
only records the new post-RoPE states (the registered attention function, rotkv.hf.attention,
needs the padding mask to place them) and routes the layer's attention call to itself
(:func:`rotkv.cache.route.route`), then the subclass's ``attend`` runs the attention against what
is stored and writes the new tokens.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers.cache_utils import CacheLayerMixin

from rotkv.config import CacheSpec
from rotkv.cache.route import route
from rotkv.rotations.base import LayerRotation

TIER_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def tier_dtype(spec: CacheSpec, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the unquantized tiers (sink and window): ``spec.tier_dtype``, or the model's for "model"."""
    return model_dtype if spec.tier_dtype == "model" else TIER_DTYPES[spec.tier_dtype]


def attention_dtype(query: torch.Tensor, tier: torch.dtype) -> torch.dtype:
    """The dtype of the PyTorch readers' attention (the dense path's scores, softmax and weighted sum):
    bf16 on a GPU serving a 16-bit model from 16-bit tiers (the tiers' own precision), float32 otherwise:
    on the CPU (the reference path) and for a float32 model on a GPU (the accuracy runs), so that there
    the GPU computes what the CPU does instead of rounding every score to bf16."""
    half = query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and tier != torch.float32
    return torch.bfloat16 if half else torch.float32


class RotkvLayer(CacheLayerMixin):
    """A full-attention layer's cache; subclasses store the tokens and attend (see the module docstring).

    Subclasses give ``batch_rows`` (rows of the batch held now) and ``seen`` (slots the model has
    sent, pads included: what transformers calls the sequence length).
    """

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, spec: CacheSpec, rotation: LayerRotation, head_dim: int, kv_heads: int, layer_idx: int,
                 codecs=None, model_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.spec, self.head_dim, self.kv_heads, self.layer_idx = spec, head_dim, kv_heads, layer_idx
        self.rotation_cpu = rotation
        self.rotation = rotation
        self.key_codec, self.value_codec = codecs if codecs is not None else (None, None)
        self.tier_dtype = tier_dtype(spec, model_dtype)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def batch_rows(self) -> int:
        raise NotImplementedError

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Record new post-RoPE states ``[B, kv_heads, q, D]``; the attention function stores them.

        The layer routes the model layer's attention call to itself (:func:`rotkv.cache.route.route`):
        transformers does not pass the cache to the attention function, which finds the layer by its
        module's ``layer_idx``.
        """
        if getattr(self, "check_finite", False) and not bool(torch.isfinite(key_states).all()
                                                             & torch.isfinite(value_states).all()):
            raise ValueError(f"layer {self.layer_idx}: the new key/value states contain NaN or Inf; nothing was stored")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch_rows:
            raise ValueError(f"batch size changed from {self.batch_rows} to {key_states.shape[0]} without reordering the cache")
        if self.pending is not None:
            raise RuntimeError(
                f"layer {self.layer_idx}: new states arrived before the previous ones were attended; "
                "the model must run with attn_implementation='rotkv' (RotkvCache sets it)"
            )
        self.pending = (key_states, value_states)
        route(self.layer_idx, self, key_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("rotkv caches cannot be cropped: quantized tokens cannot be restored")

    @staticmethod
    def _counts(real: torch.Tensor | None, b: int, q: int) -> np.ndarray:
        """Real (non-pad) tokens of each of the ``b`` rows among the ``q`` new positions; ``real [B, q]``
        must be a suffix mask (left padding only)."""
        if real is None:
            return np.full(b, q, dtype=np.int64)
        real = real.bool().cpu()
        counts = real.sum(-1)
        suffix = torch.arange(q)[None] >= (q - counts)[:, None]
        if not torch.equal(suffix, real):
            raise ValueError("rotkv supports left padding only: the attention mask has a hole or right padding")
        return counts.numpy().astype(np.int64)
