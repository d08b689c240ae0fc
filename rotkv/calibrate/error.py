"""Layer-local attention-output error after W_O, the objective of clip search, OptR and the held-out table.

For one layer and a chunk of fp32 post-RoPE ``q [Hq, T, D]``, ``k, v [H, T, D]``: the keys and values
are stored as the cache stores them (``(k - mu) R_K`` and ``v R_V``; the first ``sink`` tokens
unquantized, the rest fake-quantized per token group), attention is causal, and the error is
``||(o_hat - o) W_O^T||^2 / ||o W_O^T||^2`` with ``W_O`` the layer's ``o_proj.weight [hidden, Hq*D]``.
"""

from __future__ import annotations

import torch

from rotkv.quant.quantizer import fake_quantize
from rotkv.rotations.base import LayerRotation


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """``q [Hq, T, D]``, ``k, v [H, T, D]`` -> ``o [Hq, T, D]`` (query head i reads KV head i // n_rep)."""
    r = q.shape[0] // k.shape[0]
    s = (q @ k.repeat_interleave(r, 0).transpose(-1, -2)) * scaling
    t = q.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    p = torch.softmax(s.masked_fill(mask, float("-inf")), -1)
    return p @ v.repeat_interleave(r, 0)


def store(x: torch.Tensor, bits: int | None, group: int, clip: float, sink: int) -> torch.Tensor:
    """Fake-quantize the body (positions ``>= sink``) of rows ``x [H, T, D]``; None bits = no quantization."""
    if bits is None:
        return x
    return torch.cat([x[:, :sink], fake_quantize(x[:, sink:], bits, group, clip)], 1)


def quantized_output(q, k, v, rot: LayerRotation, bits: int | None, group: int, clip_k: float, clip_v: float,
                     sink: int, scaling: float, quant_k: bool = True, quant_v: bool = True) -> torch.Tensor:
    """Attention output ``[Hq, T, D]`` in the original basis, read from the stored (rotated, quantized) cache."""
    kk = store(rot.keys(k[None])[0], bits if quant_k else None, group, clip_k, sink)
    vv = store(rot.values(v[None])[0], bits if quant_v else None, group, clip_v, sink)
    o = causal_attention(rot.queries(q[None])[0], kk, vv, scaling)
    return rot.outputs(o[None])[0]


def project(o: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    """``o [Hq, T, D]`` -> ``[T, hidden]`` through ``o_proj.weight [hidden, Hq*D]``."""
    hq, t, d = o.shape
    return o.transpose(0, 1).reshape(t, hq * d) @ w_o.T


def output_error(samples, rot: LayerRotation, w_o: torch.Tensor, bits: int | None, group: int,
                 clip_k: float = 1.0, clip_v: float = 1.0, sink: int = 16, scaling: float | None = None,
                 quant_k: bool = True, quant_v: bool = True) -> float:
    """Relative squared attention-output error after W_O, pooled over ``samples`` (stats.Sample list)."""
    num = den = 0.0
    for s in samples:
        sc = scaling or s.q.shape[-1] ** -0.5
        ref = reference_output(s, w_o, sc)
        got = project(quantized_output(s.q, s.k, s.v, rot, bits, group, clip_k, clip_v, sink, sc, quant_k, quant_v), w_o)
        num += (got - ref).pow(2).sum().item()
        den += ref.pow(2).sum().item()
    return num / max(den, 1e-30)


def reference_output(s, w_o: torch.Tensor, scaling: float) -> torch.Tensor:
    """The fp32 output after W_O ``[T, hidden]`` of a sample, computed once and kept on the sample
    (the clip search evaluates many stored variants against the same reference)."""
    key = (w_o.data_ptr(), tuple(w_o.shape), scaling)
    cached = getattr(s, "_ref", None)
    if cached is None or cached[0] != key:
        cached = (key, project(causal_attention(s.q, s.k, s.v, scaling), w_o))
        s._ref = cached
    return cached[1]
