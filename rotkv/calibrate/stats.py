"""Streaming per-layer statistics of post-RoPE queries, keys, values and attention outputs.

``StatsRecorder`` is a capture recorder (``rotkv.calibrate.capture``). Per layer and KV head it sums
(float64): ``C_Q = sum q^T q`` over the query heads of the KV head, ``C_S = sum O^T O`` (attention
outputs of those query heads), ``C_diag = sum_t w_t v_t^T v_t`` with ``w_t = sum_q S_qt^2``,
``C_K``/``C_V`` (plain second moments) and the key sum over body positions (``>= sink``). It keeps
keys and values in fp16 (for the weighted C_S form, which needs the final C_Q) and the raw
``(q, k, v)`` of the chunks listed in ``keep`` (for clip search and OptR).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Sample:
    """One chunk of one layer: ``q [Hq, T, D]``, ``k, v [H, T, D]`` float32, post-RoPE."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class LayerStats:
    cq: torch.Tensor  # [H, D, D] float64 sums
    cs: torch.Tensor
    cdiag: torch.Tensor
    ck: torch.Tensor
    cv: torch.Tensor
    wdiag: torch.Tensor  # [H] sum of diag weights
    key_sum: torch.Tensor  # [H, D]
    n_q: int = 0  # query rows summed into cq / cs (per query head)
    n_k: int = 0  # body key rows summed into key_sum / ck / cv
    kv_f16: list = field(default_factory=list)  # [(k [H, T, D], v [H, T, D]) fp16], body positions
    samples: dict = field(default_factory=dict)  # chunk index -> Sample

    @property
    def k_mean(self) -> torch.Tensor:
        return (self.key_sum / max(self.n_k, 1)).float()

    def value_cov(self, form: str) -> torch.Tensor:
        """OSCAR's value covariance ``[H, D, D]`` in one of the forms (``exact``: ``C_S``; ``weighted``:
        :func:`weighted_cs`; ``diag``: ``C_diag``)."""
        if form == "exact":
            return self.cs
        if form == "weighted":
            return weighted_cs(self)
        if form == "diag":
            return self.cdiag
        raise ValueError(f"`cs` has to be one of ['exact', 'weighted', 'diag'] but got {form!r}")


def _gram(x: torch.Tensor) -> torch.Tensor:
    """``x [H, N, D]`` -> ``[H, D, D]`` float64 sum of outer products."""
    x = x.double()
    return x.transpose(-1, -2) @ x


class StatsRecorder:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, sink: int = 16,
                 keep: set[int] | None = None, keep_kv: bool = True):
        z = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
        h, d = kv_heads, head_dim
        self.layers = [LayerStats(z(h, d, d), z(h, d, d), z(h, d, d), z(h, d, d), z(h, d, d), z(h), z(h, d))
                       for _ in range(num_layers)]
        self.sink, self.keep, self.keep_kv = sink, keep or set(), keep_kv
        self.chunk = 0

    def __call__(self, layer, q, k, v, out, probs) -> None:
        st = self.layers[layer]
        # statistics are float64 on the CPU, whatever device the model runs on
        q, k, v, out, probs = (t[0].float().cpu() for t in (q, k, v, out, probs))
        h, hq = k.shape[0], q.shape[0]
        r = hq // h
        t, d = q.shape[1], q.shape[2]
        st.cq += _gram(q.reshape(h, r * t, d))
        st.cs += _gram(out.reshape(h, r * t, d))
        st.n_q += t * r
        kb, vb = k[:, self.sink :], v[:, self.sink :]
        w = (probs**2).sum(dim=1).reshape(h, r, -1).sum(1)[:, self.sink :]  # [H, S_body]
        st.cdiag += _gram(vb * w.unsqueeze(-1).sqrt())
        st.wdiag += w.double().sum(-1)
        st.ck += _gram(kb)
        st.cv += _gram(vb)
        st.key_sum += kb.double().sum(1)
        st.n_k += kb.shape[1]
        if self.keep_kv:
            st.kv_f16.append((kb.half(), vb.half()))
        if self.chunk in self.keep:
            st.samples[self.chunk] = Sample(q.clone(), k.clone(), v.clone())


def weighted_cs(st: LayerStats) -> torch.Tensor:
    """The reference's weighted value covariance ``sum_t w_t v_t^T v_t``, ``w_t = k_t C_Q k_t^T``
    normalized to mean 1 per KV head; ``[H, D, D]`` float64. C_Q is per KV head (final)."""
    cq = st.cq / max(st.n_q, 1)
    acc = torch.zeros_like(st.cq)
    wsum = torch.zeros(cq.shape[0], dtype=torch.float64)
    for k16, v16 in st.kv_f16:
        k, v = k16.double(), v16.double()
        w = torch.einsum("htd,hde,hte->ht", k, cq, k)  # [H, T]
        acc += _gram(v * w.clamp_min(0).unsqueeze(-1).sqrt())
        wsum += w.sum(-1)
    return acc / (wsum / max(st.n_k, 1)).clamp_min(1e-30)[:, None, None]
