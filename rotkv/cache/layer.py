"""One layer of the hybrid cache over shared page pools: bf16 sink + quantized body + bf16 window.

Storage, per layer (``rotkv.cache.pools``): a tier pool ``[pages, kv_heads, P, D]`` in the tier
dtype for the sink and the recent window, and a body pool of encoded pages (INT2: codes, fp16
scale and minimum), both shared by every row of the batch. Which pages a row owns lives in the
cache's :class:`~rotkv.cache.plan.PageState`, shared by all layers; this class never holds a
per-row tensor.

Semantics (the same as :class:`rotkv.cache.rowstore.RowStoreLayer`, the per-row reference):
pads are never stored, the sink is the first ``S`` real tokens of a row, tokens leave the window
in pages of ``P`` once it holds ``W + P`` (so it keeps ``W`` to ``W + P - 1`` tokens), and a
prefill longer than ``prefill_chunk`` runs in chunks that attend to the quantized pages of the
earlier chunks and to their own tokens at tier precision. Keys are stored ``(k - mu) R_K``,
values ``v R_V``.

Each forward call is planned once for all layers (:meth:`PageState.plan`); a layer then runs,
per step: one batched write of the new tokens into the tier pool, one attention over every row
(on CUDA, a decode step is one call of the split-K kernel over the page tables), and one batched
flush of the pages that leave the window (the fused write kernel on CUDA).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from rotkv.cache.base import RotkvLayer
from rotkv.cache.plan import PageState, Step
from rotkv.cache.pools import LayerPools
from rotkv.config import CacheSpec
from rotkv.kernels import backend as kernels
from rotkv.rotations.base import LayerRotation


class HybridLayer(RotkvLayer):
    """A full-attention layer's cache; see the module docstring.

    ``state``: the :class:`PageState` shared with the cache's other layers (a layer built alone
    makes its own). ``decode_score``: the decode kernels' score variant (None: ROTKV_DECODE_SCORE / auto).
    """

    def __init__(self, spec: CacheSpec, rotation: LayerRotation, head_dim: int, kv_heads: int, layer_idx: int,
                 codecs=None, model_dtype: torch.dtype = torch.float32, state: PageState | None = None,
                 check_finite: bool = True, decode_score: str | None = None):
        super().__init__(spec, rotation, head_dim, kv_heads, layer_idx, codecs, model_dtype)
        self.state = state or PageState(spec.sink, spec.window, spec.page_size, spec.quantized, spec.prefill_chunk)
        self.check_finite = check_finite
        self.pools: LayerPools | None = None
        self.static = None  # a rotkv.cache.graph.StaticDecode while a CUDA-graph decode step runs
        self.decode_score = decode_score

    def __repr__(self) -> str:
        return f"HybridLayer({self.layer_idx}, {self.spec.name}, rows={self.state.rows}, seen={self.state.seen})"

    # ---- CacheLayerMixin -----------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.rotation = self.rotation_cpu.to(self.device)
        self.pools = LayerPools(self.kv_heads, self.head_dim, self.spec.page_size, self.tier_dtype, self.device,
                                self.key_codec, self.value_codec,
                                mirror=self.spec.quantized and not kernels.enabled(key_states))
        if self.state.rows == 0 and self.state.seen == 0:
            self.state.reset(key_states.shape[0])
        self.is_initialized = True

    @property
    def batch_rows(self) -> int:
        return self.state.rows

    @property
    def seen(self) -> int:
        return self.state.seen

    def reset(self) -> None:
        """Forget every token (the pools keep their memory for the next batch)."""
        self.pending = None
        if self.is_initialized:
            self.state.reset(0)
        self.is_initialized = False

    # ---- reading the stored tokens -------------------------------------------------------------
    def read(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 ``[kv_heads, n, D]`` keys and values of one row in order (sink, dequantized body,
        window), decoded from the stored format (never from the CPU mirror)."""
        st = self.state
        n_body = int(st.body_count[row])
        pages = torch.as_tensor(st.body_pages[row, :n_body], device=self.device)
        bk, bv = self.pools.body_dense(pages[None], torch.float32, use_mirror=False)
        tt = int(st.tier_tokens[row])
        s = min(tt, st.sink)
        tk, tv = self.pools.tier_dense(*self._tier_index(st.tier_pages[row:row + 1], np.array([tt])), torch.float32)
        cat = lambda t, b: torch.cat([t[0, :, :s], b[0], t[0, :, s:tt]], 1)  # noqa: E731
        return cat(tk, bk), cat(tv, bv)

    def _tier_index(self, pages: np.ndarray, tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """(page ``[B, Lt]``, offset ``[B, Lt]``) of the tier tokens of every row, padded by repeats."""
        p, pad = self.spec.page_size, self.state.pad
        lt = max(int(tokens.max(initial=0)), 1)
        pos = pad + np.minimum(np.arange(lt)[None, :], np.maximum(tokens[:, None] - 1, 0))
        pg = np.take_along_axis(pages, pos // p, 1) if pages.shape[1] else np.zeros_like(pos)
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)  # noqa: E731
        return t(pg), t(pos % p)

    # ---- attention -----------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, real: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of ``query [B, q_heads, q, D]`` over the stored tokens and the pending ones.

        real: ``[B, q]`` bool, which of the q new positions are real tokens (left padding only),
        or None when all are. Returns ``[B, q, q_heads, D]`` in the query dtype (zeros at pads).
        """
        if self.static is not None:
            return self._attend_static(query, scaling)
        k_new, v_new = self.pending
        self.pending = None
        b, hq, q, d = query.shape
        counts = self._counts(real, b, q)
        steps = self.state.steps_for(self.layer_idx, q, counts)
        if self.check_finite and not bool(torch.isfinite(k_new).all() & torch.isfinite(v_new).all()):
            self.state.rollback()  # nothing is stored: the cache stays as it was
            raise ValueError(f"layer {self.layer_idx}: the new key/value states contain NaN or Inf; nothing was stored")
        self.pools.fit(self.state.tier_free.capacity, self.state.body_free.capacity)
        rot = self.rotation
        kr, vr = rot.keys(k_new).to(self.tier_dtype), rot.values(v_new).to(self.tier_dtype)
        qr = rot.queries(query)
        if len(steps) == 1 and steps[0].decode:
            out = self._step(steps[0], qr, kr, vr, scaling)  # [B, Hq, 1, D]
        else:
            out = torch.zeros(b, hq, q, d, dtype=torch.float32, device=query.device)
            for step in steps:
                o = self._step(step, qr, kr, vr, scaling)
                rows, j, pos = step.device_query_out(self.device)
                out[rows, :, pos] = o[rows, :, j].float()
        return rot.outputs(out.float()).transpose(1, 2).to(query.dtype)

    def _attend_static(self, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """A decode step on fixed buffers (planned and loaded by ``rotkv.cache.graph``): no host
        work that depends on the step, so it can be captured in a CUDA graph."""
        from rotkv.kernels.decode import decode_attention

        st = self.static
        k_new, v_new = self.pending
        self.pending = None
        rot = self.rotation
        self.pools.write_tier(st.slots, rot.keys(k_new)[:, :, 0].to(self.tier_dtype),
                              rot.values(v_new)[:, :, 0].to(self.tier_dtype))
        q = rot.queries(query)[:, :, 0]
        plan = self.pools.decode_plan(q, kernels.decode_config(self.decode_score))
        if plan is None:
            raise ValueError(f"layer {self.layer_idx}: no decode kernel reads this cache's body on this device "
                             "(CUDA-graph decode runs the kernels only); run without cuda_graph")
        body = self.pools.paged if self.spec.quantized else None
        # the graph captures the plan's launch for the capacity (st.body_max): one kernel every replay
        o = decode_attention(q, body, st.body if body is not None else None, st.body_max,
                             (self.pools.tier_k, self.pools.tier_v), st.tier, st.tier_max, sm_scale=scaling,
                             tier_start=self.state.pad, plan=plan)
        return rot.outputs(o.float()[:, :, None]).transpose(1, 2).to(query.dtype)

    def _step(self, step: Step, qr: torch.Tensor, kr: torch.Tensor, vr: torch.Tensor, scaling: float) -> torch.Tensor:
        rows, pos, slots = step.device_write(self.device)
        self.pools.write_tier(slots, kr[rows, :, pos], vr[rows, :, pos])
        plan = self.pools.decode_plan(qr[:, :, 0], kernels.decode_config(self.decode_score)) if step.decode else None
        if plan is not None:
            o = self._attend_kernel(step, qr[:, :, 0], scaling, plan)[:, :, None]
        else:
            o = self._attend_dense(step, qr, scaling)
        if len(step.flush):
            self.pools.flush(*step.device_flush(self.device))
        return o

    def _attend_kernel(self, step: Step, q: torch.Tensor, scaling: float, plan) -> torch.Tensor:
        """One decode token of every row: the planned split-K kernel over the body and tier page tables."""
        from rotkv.kernels.decode import decode_attention

        t = step.device_tables(self.device, self.state)
        body = self.pools.paged if self.spec.quantized and t.body_max > 0 else None
        if body is None and plan.layout is not None:  # no body tokens yet: the tier's plan
            plan = None
        return decode_attention(q, body, t.body if body is not None else None, t.body_max,
                                (self.pools.tier_k, self.pools.tier_v), t.tier, t.tier_max, sm_scale=scaling,
                                cfg=kernels.decode_config(self.decode_score), tier_start=self.state.pad,
                                plan=plan).float()

    def _attend_dense(self, step: Step, qr: torch.Tensor, scaling: float) -> torch.Tensor:
        """Dense attention of the step's queries: body dequantized once, tier gathered, one SDPA."""
        dev = self.device
        # bf16 SDPA on the GPU (the tier's own precision), float32 elsewhere (the CPU reference)
        cdt = torch.bfloat16 if (qr.is_cuda and self.tier_dtype != torch.float32) else torch.float32
        pg, off = step.cached(("tier_index", dev), lambda: self._tier_index(step.tier_pages, step.tier_tokens))
        tk, tv = self.pools.tier_dense(pg, off, cdt)  # [B, H, Lt, D]
        nb = int(step.body_count.max(initial=0))
        if self.spec.quantized and nb:
            pages = step.cached(("body_pages", dev), lambda: torch.from_numpy(
                np.ascontiguousarray(step.body_pages[:, :nb])).to(dev))
            t = step.device_tables(dev, self.state) if self.pools.dequant_kernel else None
            run = step.cached("run", lambda: _consecutive_run(step.body_pages, nb))
            bk, bv = self.pools.body_dense(pages, cdt, table=t.body if t is not None else None, run=run)
        else:
            nb = 0
            bk = bv = None
        b, hq, _, d = qr.shape
        # a decode step whose rows all hold the same tokens needs no mask (the common, unpadded case):
        # scores of the body and the tier apart, one softmax, no concatenated copy of K and V
        uniform = step.cached("uniform", lambda: step.decode and bool(
            (step.tier_tokens == step.tier_tokens[0]).all() and (step.body_count == step.body_count[0]).all()))
        if uniform:
            h = tk.shape[1]
            qh = qr[:, :, -1:].to(cdt).reshape(b, h, hq // h, d) * scaling
            parts = [(bk, bv)] if bk is not None else []
            parts.append((tk, tv))
            s = torch.cat([qh @ k.transpose(-1, -2) for k, _ in parts], -1).softmax(-1)
            o, i = 0, 0
            for k, v in parts:
                o = o + s[..., i:i + k.shape[2]] @ v
                i += k.shape[2]
            return o.reshape(b, hq, 1, d)
        k, v = (torch.cat([bk, tk], 2), torch.cat([bv, tv], 2)) if bk is not None else (tk, tv)
        mask = step.cached(("mask", dev, nb), lambda: _mask(step, self.spec.page_size, nb, tk.shape[2], dev))
        if mask is None:  # rows alike, queries = the last keys: lower-right causal, no mask tensor
            mask = causal_lower_right(step.query_pos.shape[1], k.shape[2])
        qpos = step.device_query(dev)
        qc = qr.gather(2, qpos[:, None, :, None].expand(-1, hq, -1, d)).to(cdt)
        return F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, scale=scaling, enable_gqa=hq != k.shape[1])

    # ---- accounting ------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        st = self.state
        tokens = int(st.lengths().sum()) if st.rows else 0
        body_tokens = int(st.body_count.sum()) * self.spec.page_size if st.rows else 0
        tier_tokens = int(st.tier_tokens.sum()) if st.rows else 0
        pools = self.pools
        return {
            "tokens": tokens,
            "body_tokens": body_tokens,
            "body_bytes": body_tokens // self.spec.page_size * pools.body_page_bytes if pools else 0,
            "tier_bytes": tier_tokens * 2 * self.kv_heads * self.head_dim * torch.empty(0, dtype=self.tier_dtype).element_size(),
            "scratch_bytes": pools.mirror_bytes() if pools else 0,
            "pool_bytes": pools.nbytes() if pools else 0,
            "elements": 2 * tokens * self.kv_heads * self.head_dim,
            "body_elements": 2 * body_tokens * self.kv_heads * self.head_dim,
        }


def _consecutive_run(pages: np.ndarray, n: int) -> int | None:
    """The first page id when the batch is one row whose ``n`` body pages are consecutive, else None."""
    if pages.shape[0] != 1:
        return None
    first = int(pages[0, 0])
    return first if (pages[0, :n] == np.arange(first, first + n)).all() else None


def _mask(step: Step, page: int, body_pages: int, tier_len: int, device) -> torch.Tensor | None:
    """``[B, 1, C, body_pages * page + tier_len]`` bool: which keys each query of the step may read,
    built on the device; None when every row holds the same tokens and every query is real (then
    the step's queries are the last keys of every row: lower-right causal)."""
    c = step.query_pos.shape[1]
    alike = all((a == a[0]).all() for a in (step.body_count, step.tier_tokens, step.tier_before))
    if alike and (step.query_count == c).all() and step.tier_tokens[0] == step.tier_before[0] + c \
            and step.body_count[0] == body_pages and step.tier_tokens[0] == tier_len:
        return None
    small = lambda a: torch.as_tensor(a, device=device)  # noqa: E731
    body_len = body_pages * page
    keys = torch.arange(body_len + tier_len, device=device)
    j = torch.arange(c, device=device)
    in_body = keys < body_len
    t = keys - body_len  # tier index of a tier key
    body_ok = in_body[None, None, :] & (keys[None, None, :] < small(step.body_count)[:, None, None] * page)
    tier_ok = (~in_body[None, None, :] & (t[None, None, :] < small(step.tier_tokens)[:, None, None])
               & (t[None, None, :] <= small(step.tier_before)[:, None, None] + j[None, :, None]))
    m = body_ok | tier_ok
    # queries that are not real (ragged last chunks) read key 0 so that no row is empty (output unused)
    m[:, :, 0] |= j[None, :] >= small(step.query_count)[:, None]
    return m[:, None]
