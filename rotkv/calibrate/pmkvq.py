"""PM-KVQ calibration (METHODS section 4): the driver behind ``rotkv calibrate --method pmkvq``.

The sensitivity and the allocation are the method's own (rotkv.rotations.pmkvq); this module runs the
model to get what they need:

1. Sensitivity. Calibration text runs with positional interpolation, ``position_ids =
   arange(0, s*T, s)`` (s = 4), so short samples reach long-range RoPE phases. The LM loss is
   back-propagated to every layer's post-RoPE keys and values (total derivatives: the graph is
   kept whole, the input embeddings are the leaf). In the basis the cache stores, ``K' = (K - mu)
   R_K`` with gradient ``G_K R_K`` (and ``V' = V R_V``, ``G_V R_V``), the first-order loss change of
   quantizing layer l at b bits is bounded by ``s[l, b] = |G'_K * (K' - Q_b(K'))|_1 + |G'_V * (V' -
   Q_b(V'))|_1``, summed over tokens past the bf16 sink.
2. Allocation. Binary ``x[l, b]``, one width per layer, minimize ``sum s[l, b] x[l, b]`` subject to
   ``sum cost[b] x[l, b] <= L * budget`` with ``cost[b]`` the body's bits per element at b bits
   (codes and metadata): an integer program for ``scipy.optimize.milp``.

The artifact gets ``bits [L]`` (int32 final widths) and ``pmkvq_sensitivity [L, 3]``, next to a
base artifact's rotations when one is given (OSCAR + PM-KVQ).
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from rotkv.rotations.base import LayerRotation
from rotkv.rotations.pmkvq import WIDTHS, allocate, layer_sensitivity, width_cost  # noqa: F401 (re-exported)

GRAD_ATTN = "rotkv_pmkvq_grad"

_captured: list[dict | None] = [None]


def _grad_attention(module, query, key, value, attention_mask, **kwargs):
    """SDPA that keeps the post-RoPE key/value tensors of each layer for their gradients."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _captured[0] is not None and key.requires_grad:
        key.retain_grad()
        value.retain_grad()
        _captured[0][module.layer_idx] = (key, value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


@contextlib.contextmanager
def capturing_kv_grads(model):
    """Inside the block, ``model`` fills the returned dict ``{layer: (k, v)}`` ``[B, H, T, D]``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GRAD_ATTN, _grad_attention)
    AttentionMaskInterface.register(GRAD_ATTN, sdpa_mask)
    old = model.config._attn_implementation
    model.set_attn_implementation(GRAD_ATTN)
    _captured[0] = store = {}
    try:
        yield store
    finally:
        _captured[0] = None
        model.set_attn_implementation(old)


def kv_with_grads(model, ids: torch.Tensor, stretch: int = 4) -> dict:
    """``{layer: (k, v)}`` post-RoPE ``[1, H, T, D]`` with ``.grad`` = dL/dk, dL/dv of the LM loss on
    ``ids [1, T]`` at positions ``arange(0, stretch * T, stretch)``. ``model`` must not need grads."""
    t = ids.shape[1]
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    pos = torch.arange(0, stretch * t, stretch, device=ids.device).unsqueeze(0)
    # an explicit all-ones mask: without it, transformers reads non-consecutive position_ids (no
    # cache, no mask) as packed sequences and lets every token attend to itself only
    mask = torch.ones_like(ids)
    with capturing_kv_grads(model) as kv:
        loss = model(inputs_embeds=emb, attention_mask=mask, position_ids=pos, labels=ids, use_cache=False).loss
    loss.backward()
    return kv


def sensitivities(model, chunks: list[torch.Tensor], rotations: list[LayerRotation], group: int,
                  clip_k: float = 1.0, clip_v: float = 1.0, stretch: int = 4, skip: int = 16) -> np.ndarray:
    """``[L, len(WIDTHS)]`` summed over ``chunks`` (each ``[1, T]`` token ids); see the module docstring."""
    dev = next(model.parameters()).device
    sens = np.zeros((len(rotations), len(WIDTHS)))
    req = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    try:
        for ids in chunks:
            kv = kv_with_grads(model, ids.to(dev), stretch)
            for layer, (k, v) in kv.items():
                rot = rotations[layer].to(dev)
                ck = clip_k if rot.clip_k is None else rot.clip_k
                cv = clip_v if rot.clip_v is None else rot.clip_v
                sl = slice(skip, None)  # the sink stays bf16 in the cache
                sens[layer] += layer_sensitivity(rot, k[0, :, sl].detach().float(), v[0, :, sl].detach().float(),
                                                  k.grad[0, :, sl].float(), v.grad[0, :, sl].float(), group, ck, cv)
    finally:
        for p, r in zip(model.parameters(), req):
            p.requires_grad_(r)
    return sens


def calibrate_pmkvq(loaded, rotations: list[LayerRotation], budget_bpe: float, group: int, tokens: int = 4096,
                    chunk_len: int = 512, clip_k: float = 1.0, clip_v: float = 1.0, stretch: int = 4,
                    files: list[str] | None = None, log=print) -> tuple[np.ndarray, np.ndarray]:
    """(final widths ``[L]``, sensitivities ``[L, 3]``) on the calibration text."""
    from rotkv.calibrate.corpus import token_chunks

    chunks = token_chunks(loaded.tokenizer, files, tokens, chunk_len)
    t0 = time.time()
    sens = sensitivities(loaded.model, chunks, rotations, group, clip_k, clip_v, stretch)
    log(f"pmkvq: sensitivities from {len(chunks)} x {chunk_len} tokens (positions x{stretch}) in {time.time() - t0:.0f} s")
    bits = allocate(sens, budget_bpe, group)
    log(f"pmkvq: widths {bits.tolist()} (mean body {np.mean([width_cost(group)[WIDTHS.index(b)] for b in bits]):.3f}"
        f" bits/element, budget {budget_bpe})")
    return bits, sens


def pmkvq_artifact(loaded, bits: np.ndarray, sens: np.ndarray, base=None, **info) -> tuple[dict, dict]:
    """(tensors, metadata): the widths and sensitivities, beside a base artifact's tensors if given."""
    from rotkv.contract import kind_meta
    from rotkv.hf.fingerprint import model_meta

    tensors = dict(base.tensors) if base is not None else {}
    tensors |= {"bits": torch.tensor(bits, dtype=torch.int32), "pmkvq_sensitivity": torch.tensor(sens, dtype=torch.float32)}
    meta = dict(base.meta) if base is not None else model_meta(loaded.model, loaded.model_id)
    method = f"{base.meta['method']}+pmkvq" if base is not None else "pmkvq"
    meta |= {"method": method, "date": model_meta(loaded.model, loaded.model_id)["date"]} | kind_meta(method, base)
    meta |= {f"pmkvq_{k}": str(v) for k, v in info.items()}
    return tensors, meta


def run(args) -> int:
    """``rotkv calibrate --method pmkvq``: per-layer widths under ``args.budget_bpe``, written to ``args.out``."""
    from rotkv.hf.geometry import model_geometry
    from rotkv.hf.models import load_model
    from rotkv.contract import validate_artifact
    from rotkv.rotations.artifact import load_artifact, save_artifact
    from rotkv.rotations.registry import build_rotations

    loaded = load_model(args.model, device=args.device)
    layers, kv_heads, head_dim = model_geometry(loaded.model.config)
    group = min(args.group_size, head_dim)
    base = None
    if args.base_artifact:
        base = load_artifact(args.base_artifact)
        validate_artifact(base, loaded.model)
        rots = [base.layer_rotation(i) for i in range(layers)]
    else:
        rots = build_rotations(args.rotation, layers, kv_heads, head_dim)
    clip_k = 1.0 if args.clip_k is None else args.clip_k
    clip_v = 1.0 if args.clip_v is None else args.clip_v
    t0 = time.time()
    bits, sens = calibrate_pmkvq(loaded, rots, args.budget_bpe, group, args.tokens, args.chunk_len,
                                 clip_k, clip_v, args.stretch, args.data)
    tensors, meta = pmkvq_artifact(
        loaded, bits, sens, base, budget_bpe=args.budget_bpe, stretch=args.stretch, tokens=args.tokens,
        rotation="base" if base is not None else args.rotation, group_size=group,
        base_artifact=args.base_artifact or "", seconds=f"{time.time() - t0:.0f}")
    save_artifact(args.out, tensors, meta)
    print(f"wrote {args.out}: final widths {bits.tolist()}")
    return 0

