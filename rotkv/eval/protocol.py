"""The evaluation protocol shared by the tasks (METHODS section 2).

A context is prefilled in chunks of ``chunk`` tokens through the method's own cache, so each chunk
attends to the stored (quantized) cache of the earlier ones; whatever is scored afterwards (the next
tokens, a question) is fed as its own call and reads the stored cache.
"""

from __future__ import annotations

import copy

import torch

from rotkv.hf import compat


@torch.inference_mode()
def forward_rows(model, ids: torch.Tensor, cache=None, keep: int = 1) -> torch.Tensor:
    """Log-probabilities ``[B, keep, vocab]`` (float32) of the last ``keep`` positions of each row of ``ids [B, n]``.

    Without a cache this is the plain model (no cache, full-precision attention over ``ids``).
    """
    kw = {compat.cache_kwarg(model): cache} if cache is not None else {"use_cache": False}
    out = model(input_ids=ids.to(model.device), logits_to_keep=keep, **kw)
    return torch.log_softmax(out.logits[:, -keep:].float(), -1)


def forward(model, ids: torch.Tensor, cache=None, keep: int = 1) -> torch.Tensor:
    """Log-probabilities ``[keep, vocab]`` (float32) of the last ``keep`` positions of ``ids [1, n]``."""
    return forward_rows(model, ids, cache, keep)[0]


def prefill_rows(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed ``ids [B, n]`` into ``cache`` in calls of ``chunk`` tokens; log-probs ``[B, vocab]`` after the last one."""
    logp = None
    for c0 in range(0, ids.shape[1], chunk):
        logp = forward_rows(model, ids[:, c0:c0 + chunk], cache)[:, -1]
    return logp


def prefill(model, cache, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """Feed ``ids [1, n]`` into ``cache`` in calls of ``chunk`` tokens; log-probs ``[vocab]`` after the last one."""
    return prefill_rows(model, cache, ids, chunk)[0]


@torch.inference_mode()
def greedy(model, cache, first_logp: torch.Tensor, max_new: int, stop_ids: set[int]) -> list[int]:
    """Greedy decoding from the log-probs of the last fed position, one token per call through ``cache``."""
    out: list[int] = []
    logp = first_logp
    for _ in range(max_new):
        tok = int(logp.argmax())
        if tok in stop_ids:
            break
        out.append(tok)
        if len(out) == max_new:
            break
        logp = forward(model, torch.tensor([[tok]]), cache)[-1]
    return out


def fork(cache):
    """An independent copy of a filled cache, so several questions can read the same context.

    quanto's quantized tensors cannot be deep-copied; such a cache is copied layer by layer with the
    tensors shared, which is safe for transformers' QuantizedLayer: its ``update`` rebinds its tensors
    (``torch.cat``, a fresh quantization) and never writes into them.
    """
    try:
        return copy.deepcopy(cache)
    except RuntimeError:
        twin = copy.copy(cache)
        twin.layers = [copy.copy(layer) for layer in cache.layers]
        return twin
