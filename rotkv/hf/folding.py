"""Folding rotations into the attention weights (``nn.Linear`` layout: ``weight [out, in]``).

Values (METHODS 3): for KV head g and query head h with ``g = h // n_rep``,
``v_proj.weight[g] <- R_V(g)^T @ W[g]``, ``v_proj.bias[g] <- b[g] @ R_V(g)``,
``o_proj.weight[:, h] <- W_O[:, h] @ R_V(g)``. The value cache then holds ``v R_V`` and the output
projection undoes it, at no run-time cost.

Pairwise SO(2) rotations of the RoPE pairs ``(i, i + D/2)`` commute with RoPE, so they fold into
W_Q and W_K (``W[h] <- R(g)^T @ W[h]`` for the query heads of g and for g itself). With QK-norm the
norm's per-channel weight sits between W and RoPE: a pair folds exactly only where its two norm
weights are equal (for both q_norm and k_norm); the other pairs are returned to be applied online,
post-RoPE. All arithmetic is float64, cast back to the weight's dtype.

A folded model is marked (``config.rotkv_values_folded``, and ``config.rotkv_values_fingerprint``: a
hash of the matrices folded) so that nothing folds twice: :func:`fold_model_values`.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from rotkv.hf.geometry import attention_modules
from rotkv.rotations.base import LayerRotation
from rotkv.rotations.pairwise import pair_matrix


def _geometry(attn) -> tuple[int, int, int]:
    d = attn.head_dim
    h = attn.k_proj.weight.shape[0] // d
    hq = attn.q_proj.weight.shape[0] // d
    return h, hq, d


@torch.no_grad()
def _rotate_rows(proj: torch.nn.Linear, mats: torch.Tensor, head_of_block) -> None:
    """Row block b of ``proj`` (``[D, in]``) <- ``R(head_of_block(b))^T @ W_b``; bias ``b_b @ R``."""
    d = mats.shape[-1]
    w = proj.weight.double()
    n = w.shape[0] // d
    wb = w.reshape(n, d, -1)
    r = mats.to(w.device, torch.float64)[[head_of_block(b) for b in range(n)]]  # [n, D, D]
    proj.weight.copy_((r.transpose(-1, -2) @ wb).reshape_as(w).to(proj.weight.dtype))
    if proj.bias is not None:
        b = proj.bias.double().reshape(n, 1, d)
        proj.bias.copy_((b @ r).reshape(-1).to(proj.bias.dtype))


@torch.no_grad()
def fold_values(model: torch.nn.Module, r_v: list[torch.Tensor | None]) -> None:
    """Fold ``R_V`` (per layer ``[H or 1, D, D]``; None: the layer is left as it is) into v_proj and
    o_proj, in place. No checks or marks: :func:`fold_model_values` is the guarded entry."""
    for attn, r in zip(attention_modules(model), r_v, strict=True):
        if r is None:
            continue
        h, hq, d = _geometry(attn)
        r = r.expand(h, d, d)
        rep = hq // h
        _rotate_rows(attn.v_proj, r, lambda b: b)
        w = attn.o_proj.weight.double()  # [hidden, Hq*D]
        wb = w.reshape(w.shape[0], hq, d).transpose(0, 1)  # [Hq, hidden, D]
        rr = r.to(w.device, torch.float64)[[i // rep for i in range(hq)]]
        attn.o_proj.weight.copy_((wb @ rr).transpose(0, 1).reshape_as(w).to(attn.o_proj.weight.dtype))


def values_fingerprint(model: torch.nn.Module, r_v: list[torch.Tensor | None]) -> str:
    """A hash of per-layer R_V (None: not folded), each expanded to the layer's ``[H, D, D]`` float32."""
    h = hashlib.sha256()
    for l, (attn, r) in enumerate(zip(attention_modules(model), r_v, strict=True)):
        h.update(f"{l}:".encode())
        if r is not None:
            kv, _, d = _geometry(attn)
            h.update(r.detach().float().expand(kv, d, d).contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


@torch.no_grad()
def fold_model_values(model: torch.nn.Module, r_v: list[torch.Tensor | None]) -> bool:
    """Fold per-layer ``R_V`` (None: skip the layer) into ``model`` once, and mark it folded.

    Returns False (and changes nothing) when the model already holds exactly these matrices; raises
    when it holds others (or unknown ones: folded from an artifact before fingerprints)."""
    fp = values_fingerprint(model, r_v)
    cfg = model.config
    if getattr(cfg, "rotkv_values_folded", False):
        if getattr(cfg, "rotkv_values_fingerprint", None) == fp:
            return False
        raise ValueError(f"this model already has other value rotations folded into its weights (fingerprint "
                         f"{getattr(cfg, 'rotkv_values_fingerprint', None)}, these are {fp}); folding them too would "
                         "rotate the values twice: load a fresh copy of the model")
    fold_values(model, r_v)
    cfg.rotkv_values_folded, cfg.rotkv_values_fingerprint = True, fp
    return True


def without_values(rot: LayerRotation) -> LayerRotation:
    """``rot`` with identity R_V (folded into the weights): keeps the key side and its split bf16
    matrices (made by :meth:`LayerRotation.to` for CUDA graphs), drops those of values and outputs."""
    out = dataclasses.replace(rot, R_V=None)
    out._split.update({k: v for k, v in rot._split.items() if k in ("keys", "queries")})
    return out


def foldable_pairs(attn) -> torch.Tensor:
    """``[D/2]`` bool: pairs whose QK-norm weights are equal (all True without QK-norm)."""
    d = attn.head_dim
    ok = torch.ones(d // 2, dtype=torch.bool)
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name, None)
        w = getattr(norm, "weight", None)
        if w is not None and w.numel() == d:
            ok &= w.detach()[: d // 2].cpu() == w.detach()[d // 2 :].cpu()
    return ok


@torch.no_grad()
def fold_pairwise(model: torch.nn.Module, angles: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fold per-layer pair angles ``[H or 1, D/2]`` into q_proj and k_proj, in place.

    Returns per layer the angles ``[H, D/2]`` that could not be folded (zero where folded): apply
    ``pair_matrix(rest)`` to post-RoPE queries and keys online to complete the rotation.
    """
    rests = []
    for attn, a in zip(attention_modules(model), angles, strict=True):
        h, hq, d = _geometry(attn)
        a = a.float().expand(h, d // 2)
        ok = foldable_pairs(attn)
        folded = torch.where(ok, a, torch.zeros_like(a))
        r = pair_matrix(folded)
        rep = hq // h
        _rotate_rows(attn.q_proj, r, lambda b: b // rep)
        _rotate_rows(attn.k_proj, r, lambda b: b)
        rests.append(a - folded)
    return rests


def fold_artifact_values(model: torch.nn.Module, artifact):
    """Fold an artifact's R_V into ``model`` (in place) and return the artifact with ``values_folded``
    set and R_V removed, for a cache that then stores ``v R_V`` straight from v_proj."""
    from rotkv.rotations.artifact import Artifact

    if artifact.values_folded:
        raise ValueError(f"artifact {artifact.path} already has its values folded")
    if getattr(model.config, "rotkv_values_folded", False):
        raise ValueError("this model already has values folded into its weights; load a fresh copy")
    n = artifact.num_layers
    fold_model_values(model, [artifact.tensors[f"R_V.{l}"].float() for l in range(n)])
    tensors = {k: v for k, v in artifact.tensors.items() if not k.startswith("R_V.")}
    return Artifact(tensors, {**artifact.meta, "values_folded": "1"}, artifact.path,
                    sum(t.numel() * t.element_size() for t in tensors.values()))
