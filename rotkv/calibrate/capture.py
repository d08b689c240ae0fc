"""Capturing post-RoPE q, k, v and each query head's attention output through the attention interface.

``capturing(model, recorder)`` switches the model to a registered attention function,
``"rotkv_capture"``, which computes attention eagerly in float32 (so the softmax probabilities of
*one* layer exist for a moment), hands ``recorder(layer, q, k, v, out, probs)`` everything it
needs, and returns the same output the model would get from SDPA. Statistics are streamed by the
recorder layer by layer; nothing holds every layer's probabilities at once.

Shapes handed to the recorder (batch first, GQA not expanded):
``q [B, Hq, T, D]``, ``k, v [B, H, S, D]`` (post-RoPE, the keys of this forward only: calibration
runs without a cache), ``out [B, Hq, T, D]`` (per query head, before W_O), ``probs [B, Hq, T, S]``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Protocol

import torch

CAPTURE = "rotkv_capture"


class Recorder(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 out: torch.Tensor, probs: torch.Tensor) -> None: ...


_recorder: list[Recorder | None] = [None]


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An eager attention function for the attention interface; returns ``([B, T, Hq, D], None)``."""
    b, hq, t, d = query.shape
    h = key.shape[1]
    scaling = d**-0.5 if scaling is None else scaling
    kx = key.float().repeat_interleave(hq // h, dim=1)  # head i reads KV head i // n_rep
    vx = value.float().repeat_interleave(hq // h, dim=1)
    scores = (query.float() @ kx.transpose(-1, -2)) * scaling
    softcap = kwargs.get("softcap")
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:  # no mask handed over: plain causal, queries are the last t keys
        s = kx.shape[2]
        attention_mask = torch.ones(t, s, dtype=torch.bool, device=query.device).tril(s - t)
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask[..., : kx.shape[2]], float("-inf"))
    else:
        scores = scores + attention_mask[..., : kx.shape[2]].float()
    probs = torch.softmax(scores, dim=-1)
    out = probs @ vx  # [B, Hq, T, D]
    rec = _recorder[0]
    if rec is not None:
        rec(module.layer_idx, query.detach(), key.detach(), value.detach(), out.detach(), probs.detach())
    return out.transpose(1, 2).contiguous().to(query.dtype), None


def _capture_mask(*args, **kwargs):
    """Always a boolean mask (causal, sliding window and padding included), never the is_causal skip."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CAPTURE, _capture_attention)
    AttentionMaskInterface.register(CAPTURE, _capture_mask)


@contextlib.contextmanager
def capturing(model: torch.nn.Module, recorder: Recorder | Callable):
    """Run ``model`` with the capture attention inside the block; restores the previous implementation."""
    register()
    old = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE)
    _recorder[0] = recorder
    try:
        yield
    finally:
        _recorder[0] = None
        model.set_attn_implementation(old)
