"""The rotation interface: per layer, per KV head matrices applied after RoPE.

Keys are stored as ``k' = (k - mu) R_K`` and queries read them as ``q' = q R_K``, so
``q'.k' = q.k - q.mu``; ``q.mu`` is the same for every key of one query, so softmax is
unchanged. Values are stored as ``v' = v R_V`` and the attention output is turned back with
``o = o' R_V^T`` (or R_V is folded into W_V / W_O and the cache sees identity).

How a rotation is computed (:func:`rotkv.kernels.plan.rotation_math` chooses): in float32
(``"fp32"``: ``x.float()`` times the float32 matrix; the CPU reference, float32 inputs, and every
call that asks for a float32 result), or, where a bf16 CUDA tensor is rotated into a bf16 result
(the cache's keys, values, queries and attention outputs on the GPU), as ``"bf16x2"``: one bf16
tensor-core GEMM of ``[x, x (, 1, 1)]`` against the matrix split in two bf16 terms
``[R_hi; R_lo (; -c_hi; -c_lo)]`` (``R_hi = bf16(R)``, ``R_lo = bf16(R - R_hi)``, ``c = mu R`` for the
key mean), accumulated in float32 and rounded to bf16 once. No float32 copy of ``x`` is made and
no float32 FFMA GEMM runs.

Precision of ``"bf16x2"`` (y = (x - mu) R, x bf16 so exact in the MMA): ``|R - R_hi - R_lo| <=
2^-18 |R|`` elementwise (two round-to-nearest steps of 2^-9 each), likewise for ``c``; so before
the final rounding ``|y' - y| <= 2^-18 (sum_i |x_i R_ij| + |c_j|) + (2D + 2) 2^-24 sum |terms|``
(the float32 accumulation; cuBLAS's reduced-precision bf16 reduction is switched off around the
GEMM), i.e. about ``2^-17 (||x|| + |c_j|)`` for an orthogonal R, 2^8 times below the half ulp
(``2^-9 |y|``) of the bf16 rounding that follows either way. The result equals the float32
path's ``bf16(y)`` except where y lies within that distance of a rounding boundary, and then
differs by one ulp. The residual scales with ``|x|`` (the key itself), not ``|x - mu|``, so a large
key mean puts more values one ulp off; the largest error over a row's rms stays the float32 path's own
(its bf16 rounding). (A TF32 GEMM of ``x.float()`` would round R to 10 bits, an error of about
``2^-11 ||x||``, as large as the bf16 rounding itself, and would still copy x to float32.)
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from rotkv.kernels.plan import plan_rotate, rotation_math  # noqa: F401 (rotation_math: re-exported)


@dataclass
class LayerRotation:
    """One layer's rotation. Matrices are ``[kv_heads, D, D]`` float32; None means identity.

    k_mean: ``[kv_heads, D]`` in the unrotated basis, or None. clip_k / clip_v: per-layer
    clipping ratios that override the preset's, or None.
    R_Q: the queries' matrix where it is not R_K, None otherwise. A key scaling ``S`` (an artifact's
    ``k_scale``, :mod:`rotkv.rotations.keyscale`) stores keys as ``(k - mu) S R_K`` and reads them with
    ``q S^-T R_K``: then R_K here is ``S R_K``, not orthogonal, and R_Q is ``S^-T R_K``, so that
    ``R_K R_Q^T = I`` and ``q'.k' = q.(k - mu)`` still holds.

    keys / values / queries / outputs return float32 (``dtype`` None) or ``dtype``; which
    arithmetic computes them: :func:`rotation_math` (the split bf16 matrices it needs are made
    when the rotation moves to a CUDA device, :meth:`to`, so a CUDA-graph capture finds them).
    """

    R_K: torch.Tensor | None = None
    R_V: torch.Tensor | None = None
    k_mean: torch.Tensor | None = None
    clip_k: float | None = None
    clip_v: float | None = None
    R_Q: torch.Tensor | None = None
    _split: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def to(self, device: torch.device) -> "LayerRotation":
        # no stream sync (a CUDA cache's layers move theirs inside the first forward, between its kernels)
        mv = lambda t: None if t is None else t.to(device=device, dtype=torch.float32, non_blocking=True)  # noqa: E731
        r = LayerRotation(mv(self.R_K), mv(self.R_V), mv(self.k_mean), self.clip_k, self.clip_v, mv(self.R_Q))
        if torch.device(device).type == "cuda":
            for which in ("keys", "values", "queries", "outputs"):
                r._bf16x2(which)
            r.key_shift()
        return r

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.R_K, self.R_V, self.k_mean, self.R_Q)
                   if t is not None)

    # --- applying it; tensors are [batch or rows, heads, tokens, D] ---------------------------
    def keys(self, k: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[.., kv_heads, T, D]`` -> ``(k - mu) R_K`` in float32 (or ``dtype``)."""
        if self.R_K is None and self.k_mean is None:
            return k.float() if dtype is None else k.to(dtype)  # the same values as through float32
        if self.R_K is not None and rotation_math(k, dtype) == "bf16x2":
            return _rotate_bf16x2(k, *self._bf16x2("keys"))
        k = k.float()
        if self.k_mean is not None:
            k = k - self.k_mean.unsqueeze(-2)
        return _cast(k if self.R_K is None else _per_head(k, self.R_K), dtype)

    def values(self, v: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.R_V is None:
            return v.float() if dtype is None else v.to(dtype)
        if rotation_math(v, dtype) == "bf16x2":
            return _rotate_bf16x2(v, *self._bf16x2("values"))
        return _cast(_per_head(v.float(), self.R_V), dtype)

    def queries(self, q: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``[B, q_heads, T, D]`` -> ``q R_Q(g)`` (R_Q is R_K unless set) with ``g = h // n_rep``, float32
        (or ``dtype``)."""
        mats = self.query_matrix
        if mats is None:
            return q.float() if dtype is None else q.to(dtype)
        if rotation_math(q, dtype) == "bf16x2":
            return _rotate_bf16x2(q, *self._bf16x2("queries"))
        return _cast(_per_group(q.float(), mats), dtype)

    @property
    def query_matrix(self) -> torch.Tensor | None:
        """The queries' matrix ``[kv_heads, D, D]``: R_Q where set, else R_K."""
        return self.R_K if self.R_Q is None else self.R_Q

    def outputs(self, o: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Attention output ``[B, q_heads, T, D]`` in the rotated value basis -> ``o R_V(g)^T``.

        ``dtype`` None: in ``o``'s dtype, not cast (callers pass float32); else ``dtype``."""
        if self.R_V is None:
            return o if dtype is None else o.to(dtype)
        if rotation_math(o, dtype) == "bf16x2":
            return _rotate_bf16x2(o, *self._bf16x2("outputs"))
        if dtype is None:
            return _per_group(o, self.R_V.transpose(-1, -2))
        return _per_group(o.float(), self.R_V.transpose(-1, -2)).to(dtype)

    def rotate_into(self, which: str, x: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None = None) -> bool:
        """Write ``keys(x)``, ``values(x)``, ``queries(x)`` or ``outputs(x)`` (``which``), bf16, straight into
        ``out`` (``rotkv.kernels.rotate``): with ``rows``, into the pool ``out`` at each batch row's element
        offset ``rows [B]``; without, into ``out``, a view of ``x``'s shape in any strides (last dim contiguous).
        False, writing nothing, where that kernel does not apply (no matrix on this side, not bf16 on CUDA,
        kernels off): the caller then rotates and copies or scatters."""
        a = self.kernel_matrix(which, x, out, rows)
        if a is None:
            return False
        from rotkv.kernels.rotate import rotate_bf16x2

        rotate_bf16x2(x, a, out=out, rows=rows)
        return True

    def rotate_many_into(self, jobs) -> bool:
        """:meth:`rotate_into` for up to three ``(which, x, out, rows)`` jobs of one head_dim in one launch of the
        rotation kernel (``rotkv.kernels.rotate.rotate_many``): a decode step's keys and values into their tier
        slots and its queries into the decode kernel's buffer. False, writing nothing, unless the kernel applies
        to every job; the caller then rotates each job on its own."""
        jobs = list(jobs)
        mats = [self.kernel_matrix(*job) for job in jobs]
        if any(a is None for a in mats) or len({x.shape[-1] for _, x, _, _ in jobs}) > 1 or not 1 <= len(jobs) <= 3:
            return False
        from rotkv.kernels.rotate import rotate_many

        rotate_many([(x, a, out, rows) for (_, x, out, rows), a in zip(jobs, mats)])
        return True

    def kernel_matrix(self, which: str, x: torch.Tensor, out: torch.Tensor, rows=None) -> torch.Tensor | None:
        """The split matrix (:func:`bf16x2_matrix`) the rotation kernel rotates ``x`` by for ``which`` into
        ``out``, or None where the kernel does not apply (:meth:`rotate_into`; ``rows`` as there)."""
        mats = {"keys": self.R_K, "values": self.R_V, "queries": self.query_matrix, "outputs": self.R_V}
        if which not in mats:
            raise ValueError(f"rotate_into: which is one of {list(mats)}, not {which!r}")
        if mats[which] is None or rotation_math(x, out.dtype) != "bf16x2":
            return None  # (rotation_math fp32: the eager step's float32 rotation, then the scatter)
        if rows is None and (out.shape != x.shape or out.stride(-1) != 1):
            return None
        a = self._bf16x2(which)[0]
        return a if plan_rotate(x, a) else None

    def key_shift(self) -> torch.Tensor | None:
        """``c = mu R_K`` ``[kv_heads, D]`` float32 (``mu`` without R_K), None without a key mean: what a
        stored key ``(k - mu) R_K`` lacks of ``k R_K``; made once."""
        if self.k_mean is None:
            return None
        got = self._split.get("shift")
        if got is None:
            mu = self.k_mean.float()
            got = self._split["shift"] = mu if self.R_K is None else torch.einsum("hd,hde->he", mu, self.R_K.float())
        return got

    def _bf16x2(self, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the split matrix ``[H, K, D]`` bf16 of :func:`bf16x2_matrix`, the ones row ``[8]``) for
        keys (R_K with the mean), queries (R_Q, else R_K), values (R_V) or outputs (R_V^T); made once."""
        got = self._split.get(which)
        if got is not None:
            return got
        mats = {"values": self.R_V, "outputs": self.R_V, "queries": self.query_matrix}.get(which, self.R_K)
        if mats is None:
            return None
        if mats.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("LayerRotation: the bf16x2 matrices are made outside a CUDA-graph capture "
                               "(LayerRotation.to(cuda) makes them)")
        if which == "outputs":
            mats = mats.transpose(-1, -2)
        a = bf16x2_matrix(mats, self.k_mean if which == "keys" else None)
        ones = torch.zeros(8, dtype=torch.bfloat16, device=mats.device)  # [1, 1, 0, ..., 0], made on the device
        ones[:2] = 1
        self._split[which] = got = (a, ones)
        return got


def _cast(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return x if dtype is None else x.to(dtype)


def bf16x2_matrix(mats: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """``mats [H, D, E]`` (and ``shift [H, D]``) -> ``[H, 2D, E]`` (``[H, 2D + 8, E]``) bf16: the rows
    ``R_hi = bf16(R)``, ``R_lo = bf16(R - R_hi)`` (and ``-c_hi``, ``-c_lo``, six zero rows, with
    ``c = shift R`` in float32 and its split likewise), so that ``[x, x, 1, 1, 0...] @ it``
    is ``(x - shift) R`` to about 2^-18 (module docstring)."""
    mats = mats.float()
    hi = mats.to(torch.bfloat16)
    parts = [hi, (mats - hi.float()).to(torch.bfloat16)]
    if shift is not None:
        c = torch.einsum("hd,hde->he", shift.float(), mats)
        c_hi = c.to(torch.bfloat16)
        c_lo = (c - c_hi.float()).to(torch.bfloat16)
        parts += [-c_hi[:, None], -c_lo[:, None], hi.new_zeros(hi.shape[0], 6, hi.shape[2])]
    return torch.cat(parts, 1).contiguous()


@contextmanager
def _fp32_reduction(on: bool):
    """cuBLAS without its reduced-precision (bf16) split-K reduction inside (restored after)."""
    m = torch.backends.cuda.matmul
    old = on and m.allow_bf16_reduced_precision_reduction
    if old:
        m.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        if old:
            m.allow_bf16_reduced_precision_reduction = True


def _rotate_bf16x2(x: torch.Tensor, a: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
    """The bf16x2 rotation: on CUDA with the kernels, one Triton kernel that reads ``x`` in place
    (``rotkv.kernels.rotate``: no concatenated copy); else :func:`_rotate_bf16x2_bmm`."""
    if plan_rotate(x, a):
        from rotkv.kernels.rotate import rotate_bf16x2

        return rotate_bf16x2(x, a)
    return _rotate_bf16x2_bmm(x, a, ones)


def _rotate_bf16x2_bmm(x: torch.Tensor, a: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
    """The PyTorch form of the bf16x2 rotation (the reference of ``rotkv.kernels.rotate``):
    ``x [B, Hq, T, D]`` bf16 -> ``[B, Hq, T, D]`` bf16, heads in groups of ``Hq // H`` over the ``H`` matrices of ``a`` (:func:`bf16x2_matrix`): one bmm over the heads of ``[x, x (, 1, 1, 0..)]``,
    laid out ``[Hq, B, T, K]`` so that the result is a view ``[B, Hq, T, D]`` of ``[Hq, B, T, D]``
    (no copy after the GEMM; the matrices are not copied per row)."""
    b, hq, t, d = x.shape
    h, k, e = a.shape
    xp = x.transpose(0, 1)
    parts = [xp, xp]
    if k > 2 * d:
        parts.append(ones[: k - 2 * d].expand(hq, b, t, k - 2 * d))
    x2 = torch.cat(parts, -1).view(h, hq // h * b * t, k)
    with _fp32_reduction(x.is_cuda):
        y = torch.bmm(x2, a)
    return y.view(hq, b, t, e).transpose(0, 1)


def _per_head(x: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
    """``x [..., H, T, D]`` times ``mats [H, D, D]`` per head. An einsum, i.e. one bmm over the heads:
    ``x @ mats`` broadcasts the matrices over the batch, and on CUDA that copies them once per row."""
    return torch.einsum("...htd,hde->...hte", x, mats)


def _per_group(x: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
    b, hq, t, d = x.shape
    h = mats.shape[0]
    return _per_head(x.reshape(b, h, hq // h * t, d), mats).reshape(b, hq, t, d)


def pooled(cov: torch.Tensor, granularity: str) -> torch.Tensor:
    """``[H, D, D]`` -> the same per KV head (``kv-head``) or their sum broadcast to every head (``layer``).

    How a fit from calibration statistics shares one rotation across a layer's KV heads."""
    if granularity == "kv-head":
        return cov
    if granularity == "layer":
        return cov.sum(0, keepdim=True).expand_as(cov)
    raise ValueError(f"`granularity` has to be one of ['layer', 'kv-head'] but got {granularity!r}")
