"""The rotation interface: per layer, per KV head matrices applied after RoPE.

Keys are stored as ``k' = (k - mu) R_K`` and queries read them as ``q' = q R_K``, so
``q'.k' = q.k - q.mu``; ``q.mu`` is the same for every key of one query, so softmax is
unchanged. Values are stored as ``v' = v R_V`` and the attention output is turned back with
``o = o' R_V^T`` (or R_V is folded into W_V / W_O and the cache sees identity).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LayerRotation:
    """One layer's rotation. Matrices are ``[kv_heads, D, D]`` float32; None means identity.

    k_mean: ``[kv_heads, D]`` in the unrotated basis, or None. clip_k / clip_v: per-layer
    clipping ratios that override the preset's, or None.
    """

    R_K: torch.Tensor | None = None
    R_V: torch.Tensor | None = None
    k_mean: torch.Tensor | None = None
    clip_k: float | None = None
    clip_v: float | None = None

    def to(self, device: torch.device) -> "LayerRotation":
        mv = lambda t: None if t is None else t.to(device=device, dtype=torch.float32)  # noqa: E731
        return LayerRotation(mv(self.R_K), mv(self.R_V), mv(self.k_mean), self.clip_k, self.clip_v)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.R_K, self.R_V, self.k_mean) if t is not None)

    # --- applying it; tensors are [batch or rows, heads, tokens, D] ---------------------------
    def keys(self, k: torch.Tensor) -> torch.Tensor:
        """``[.., kv_heads, T, D]`` -> ``(k - mu) R_K`` in float32."""
        k = k.float()
        if self.k_mean is not None:
            k = k - self.k_mean.unsqueeze(-2)
        return k if self.R_K is None else k @ self.R_K

    def values(self, v: torch.Tensor) -> torch.Tensor:
        v = v.float()
        return v if self.R_V is None else v @ self.R_V

    def queries(self, q: torch.Tensor) -> torch.Tensor:
        """``[B, q_heads, T, D]`` -> ``q R_K(g)`` with ``g = h // n_rep``, float32."""
        q = q.float()
        if self.R_K is None:
            return q
        return _per_group(q, self.R_K)

    def outputs(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output ``[B, q_heads, T, D]`` in the rotated value basis -> ``o R_V(g)^T``."""
        if self.R_V is None:
            return o
        return _per_group(o, self.R_V.transpose(-1, -2))


def _per_group(x: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
    b, hq, t, d = x.shape
    h = mats.shape[0]
    x = x.reshape(b, h, hq // h, t, d)
    return (x @ mats[None, :, None]).reshape(b, hq, t, d)


def hadamard_matrix(n: int) -> torch.Tensor:
    """The normalized Sylvester Hadamard matrix of size n (a power of two), float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(
            f"a Hadamard rotation needs head_dim to be a power of two, got {n}; "
            "use rotation='random' or a calibrated artifact instead"
        )
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n**0.5


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A Haar-random orthogonal matrix (QR of a Gaussian with sign fix), reproducible by seed."""
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


def build_rotations(kind: str, num_layers: int, kv_heads: int, head_dim: int, seed: int = 0, rotate_values: bool = True) -> list[LayerRotation]:
    """Data-free rotations for every layer: identity, hadamard or random."""
    if kind == "identity":
        return [LayerRotation() for _ in range(num_layers)]
    out = []
    for layer in range(num_layers):
        if kind == "hadamard":
            r = hadamard_matrix(head_dim)
        elif kind == "random":
            r = random_orthogonal(head_dim, seed * 100003 + layer)
        else:
            raise ValueError(f"`rotation` has to be one of ['identity', 'hadamard', 'random'] here but got {kind!r}")
        r = r.expand(kv_heads, head_dim, head_dim).contiguous()
        out.append(LayerRotation(R_K=r, R_V=r if rotate_values else None))
    return out
