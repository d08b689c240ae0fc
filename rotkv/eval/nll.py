"""``nll``: decode-regime quality after a context of L tokens.

For each window of the evaluation text, the first L tokens are prefilled in chunks through the method's
cache, then the next N tokens are teacher-forced one per call (decode), each reading the stored cache.
Per scored token: NLL of the true token, KL(reference || method) of the next-token distributions, and
whether both pick the same top-1 token. The reference is the plain model (float32, no cache, full
attention over the same tokens), computed once per window.
"""

from __future__ import annotations

import math

import torch

from rotkv.eval.protocol import forward, forward_rows, prefill_rows
from rotkv.eval.stats import mean_ci


def window_starts(n_tokens: int, length: int, new_tokens: int, count: int) -> list[int]:
    """``count`` start offsets spread evenly over a stream of ``n_tokens`` (windows overlap if it is short)."""
    span = length + new_tokens
    if n_tokens < span:
        raise ValueError(f"the evaluation text has {n_tokens} tokens, fewer than length + new tokens = {span}; "
                         "pass longer --text files or a smaller length")
    room = n_tokens - span
    if count == 1:
        return [0]
    return [round(i * room / (count - 1)) for i in range(count)]


def reference(model, ids: torch.Tensor, length: int, new_tokens: int) -> torch.Tensor:
    """Plain-model log-probs ``[N, vocab]`` predicting tokens ``length .. length + N - 1`` of ``ids [1, n]``."""
    return forward(model, ids[:, : length + new_tokens - 1], None, keep=new_tokens)


def score_window(model, method, ids: torch.Tensor, length: int, new_tokens: int, chunk: int,
                 ref: torch.Tensor) -> tuple[dict[str, list[float]], dict]:
    """Per-token nll / kl / top1 of one window through a fresh cache of ``method``, and its measured bytes."""
    (per,), mem = score_windows(model, method, ids, length, new_tokens, chunk, [ref])
    return per, mem


def score_windows(model, method, ids: torch.Tensor, length: int, new_tokens: int, chunk: int,
                  refs: list[torch.Tensor]) -> tuple[list[dict[str, list[float]]], dict]:
    """``score_window`` of the windows ``ids [B, length + new_tokens]`` as the B rows of one fresh cache (one
    batched prefill and decode); the measured bytes are one row's. Equal to scoring them one at a time up to
    the float rounding of the batched products."""
    rows = ids.shape[0]
    if len(refs) != rows:
        raise ValueError(f"{rows} windows but {len(refs)} references")
    cache = method.build(model, context_length=length + new_tokens)
    ids = ids.to(model.device)  # once, not one host-to-device copy per decoded token
    logps = [prefill_rows(model, cache, ids[:, :length], chunk)]
    for t in range(new_tokens - 1):  # no host sync inside the loop: the scores stay on the device
        logps.append(forward_rows(model, ids[:, length + t: length + t + 1], cache)[:, -1])
    lp = torch.stack(logps, 1)  # [B, N, vocab]
    ref = torch.stack([r.to(lp.device) for r in refs])
    target = ids[:, length: length + new_tokens]
    nll = -lp.gather(-1, target[..., None])[..., 0]
    kl = (ref.exp() * (ref - lp)).sum(-1).clamp_min(0)
    top1 = (lp.argmax(-1) == ref.argmax(-1)).float()
    mem = method.measure(cache, model, rows=rows)
    return [{"nll": nll[b].tolist(), "kl": kl[b].tolist(), "top1": top1[b].tolist()} for b in range(rows)], mem


def reference_scores(ref: torch.Tensor, ids: torch.Tensor, length: int, new_tokens: int) -> list[float]:
    target = ids[0, length: length + new_tokens].to(ref.device)
    return (-ref.gather(-1, target[:, None])[:, 0]).tolist()


def summarize(per_token: dict[str, list[float]], n_windows: int) -> dict:
    """One record's figures from the pooled per-token values (the interval ignores within-window correlation)."""
    nll, nll_ci = mean_ci(per_token["nll"])
    out = {"n": len(per_token["nll"]), "windows": n_windows, "nll": nll, "ci95": nll_ci, "ppl": math.exp(nll)}
    if "kl" in per_token:
        kl, kl_ci = mean_ci(per_token["kl"])
        top1, top1_ci = mean_ci(per_token["top1"])
        out.update({"kl": kl, "kl_ci95": kl_ci, "top1": top1, "top1_ci95": top1_ci})
    return out
