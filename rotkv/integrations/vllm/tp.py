"""Tensor parallelism: the KV heads of the artifact a rank serves.

vLLM's attention layers split the model's ``H`` KV heads over ``tp`` ranks in order: rank ``r`` holds heads
``[r * H / tp, (r + 1) * H / tp)``; with fewer KV heads than ranks each head is replicated on ``tp / H``
consecutive ranks (rank ``r`` holds head ``r // (tp / H)``). Query heads are split the same way, so the local
query heads map to the local KV heads with the model's ``n_rep``. A rotation acts inside one head: a rank
needs only its heads' ``R_K``, ``R_V`` and key means, and nothing is communicated.
"""

from __future__ import annotations

import torch

from rotkv.rotations.base import LayerRotation


def local_heads(total_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """The model's KV heads rank ``tp_rank`` of ``tp_size`` holds (vLLM's split)."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} of size {tp_size} is out of range")
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(f"{total_kv_heads} KV heads do not split over {tp_size} tensor-parallel ranks")
        n = total_kv_heads // tp_size
        return range(tp_rank * n, (tp_rank + 1) * n)
    if tp_size % total_kv_heads:
        raise ValueError(f"{tp_size} tensor-parallel ranks do not replicate {total_kv_heads} KV heads evenly")
    head = tp_rank // (tp_size // total_kv_heads)
    return range(head, head + 1)


def shard_heads(t: torch.Tensor | None, total_kv_heads: int, tp_size: int, tp_rank: int) -> torch.Tensor | None:
    """The rank's rows of a per-KV-head tensor ``[H, ...]``; a shared one (``[1, ...]``) and None pass through."""
    if t is None or t.shape[0] == 1 and total_kv_heads != 1:
        return t
    if t.shape[0] != total_kv_heads:
        raise ValueError(f"a per-head tensor of {t.shape[0]} rows for a model of {total_kv_heads} KV heads")
    heads = local_heads(total_kv_heads, tp_size, tp_rank)
    return t[heads.start:heads.stop].contiguous()


def shard_rotation(rot: LayerRotation, total_kv_heads: int, tp_size: int, tp_rank: int) -> LayerRotation:
    """The rank's part of one layer's rotation: its heads of ``R_K``, ``R_V`` and ``k_mean``; clip ratios kept."""
    if tp_size == 1:
        return rot
    s = lambda t: shard_heads(t, total_kv_heads, tp_size, tp_rank)  # noqa: E731
    return LayerRotation(s(rot.R_K), s(rot.R_V), s(rot.k_mean), rot.clip_k, rot.clip_v, s(rot.R_Q))
