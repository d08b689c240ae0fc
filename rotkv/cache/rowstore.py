"""A hybrid layer that keeps every row in its own tensors (the PyTorch reference of the paged layer).

The budgeted layers (progressive precision and eviction, ``rotkv.cache.progressive``) build on
it, and the tests use it as the oracle of :class:`rotkv.cache.layer.HybridLayer`, which stores
the same tokens in shared page pools. Semantics, per row:

Every row (request) of a batch has its own storage, so a left-padded batch stores exactly
what each request would store alone: pads are never stored, the sink is the first ``S`` real
tokens of the row, and tokens leave the window in pages of ``P`` once it holds ``W + P``
(so the window keeps ``W`` to ``W + P - 1`` tokens).

Keys are stored mean-centered and rotated, ``(k - mu) R_K``, in every tier; values as
``v R_V``. Tensors are ``[kv_heads, tokens, D]`` per row.

Like the paged layer, it is a :class:`rotkv.cache.base.RotkvLayer`: ``update`` only records the
new states, then :meth:`RowStoreLayer.attend` runs the attention against what is stored and writes
the new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from rotkv.cache.base import RotkvLayer, attention_dtype
from rotkv.config import CacheSpec
from rotkv.rotations.base import LayerRotation


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class RowStore:
    """The stored tokens of one row: sink and window in the tier dtype, body as encoded pages."""

    sink_k: torch.Tensor
    sink_v: torch.Tensor
    win_k: torch.Tensor
    win_v: torch.Tensor
    body_k: dict[str, torch.Tensor] = field(default_factory=dict)
    body_v: dict[str, torch.Tensor] = field(default_factory=dict)
    body_tokens: int = 0
    # The reference reader's float32 view of every stored token in order (sink, dequantized
    # body, window): appends write into it and a page flush overwrites its tokens with their
    # dequantized values, so a read never re-decodes or concatenates. It is scratch memory of
    # the CPU reference path, kept on the CPU only (RowStoreLayer.read_view; on a GPU a read
    # decodes the pages, and a call of several prefill chunks keeps one for the row it is on,
    # dropped at the call's end), and is reported apart as scratch_bytes, not as resident cache.
    view_k: torch.Tensor | None = None
    view_v: torch.Tensor | None = None

    @classmethod
    def empty(cls, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> "RowStore":
        z = lambda: torch.empty(heads, 0, head_dim, dtype=dtype, device=device)  # noqa: E731
        return cls(z(), z(), z(), z())

    @property
    def length(self) -> int:
        return self.sink_k.shape[1] + self.body_tokens + self.win_k.shape[1]

    def tier_bytes(self) -> int:
        return sum(_nbytes(t) for t in (self.sink_k, self.sink_v, self.win_k, self.win_v))

    def body_bytes(self) -> int:
        return sum(_nbytes(t) for t in (*self.body_k.values(), *self.body_v.values()))

    def scratch_bytes(self) -> int:
        return sum(_nbytes(t) for t in (self.view_k, self.view_v) if t is not None)

    def write_view(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write float32 ``[H, m, D]`` states at token ``start`` of the read view, growing it as needed."""
        end = start + k.shape[1]
        if self.view_k is None or self.view_k.shape[1] < end:
            cap = max(end + 64, (5 * (0 if self.view_k is None else self.view_k.shape[1])) // 4)  # +25%: geometric, but little slack
            grow = lambda old: torch.cat([old[:, :start], torch.empty(  # noqa: E731
                k.shape[0], cap - start, k.shape[2], dtype=torch.float32, device=k.device)], 1) \
                if old is not None else torch.empty(k.shape[0], cap, k.shape[2], dtype=torch.float32, device=k.device)
            self.view_k, self.view_v = grow(self.view_k), grow(self.view_v)
        self.view_k[:, start:end] = k
        self.view_v[:, start:end] = v


class RowStoreLayer(RotkvLayer):
    """A full-attention layer's cache, one set of tensors per row; see the module docstring."""

    def __init__(self, spec: CacheSpec, rotation: LayerRotation, head_dim: int, kv_heads: int, layer_idx: int,
                 codecs=None, model_dtype: torch.dtype = torch.float32):
        super().__init__(spec, rotation, head_dim, kv_heads, layer_idx, codecs, model_dtype)
        self.rows: list[RowStore] = []
        self.seen = 0  # slots the model has sent, pads included (what transformers calls the sequence length)
        # the float32 read view (RowStore.view_k): None decides at the first write, on the CPU only (the
        # reference path's speed); on a GPU a read decodes the row's pages, so the cache holds its codes
        # and tiers and no float32 copy of every token (which would be twice a bf16 cache)
        self.read_view: bool | None = None

    def __repr__(self) -> str:
        return f"RowStoreLayer({self.layer_idx}, {self.spec.name}, rows={len(self.rows)}, seen={self.seen})"

    # ---- CacheLayerMixin -----------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        if self.read_view is None:
            self.read_view = self.device.type == "cpu"
        self.rotation = self.rotation_cpu.to(self.device)
        self.rows = [RowStore.empty(self.kv_heads, self.head_dim, self.tier_dtype, self.device)
                     for _ in range(key_states.shape[0])]
        self.is_initialized = True

    @property
    def batch_rows(self) -> int:
        return len(self.rows)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        out = super().update(key_states, value_states, *args, **kwargs)
        self.seen += key_states.shape[-2]
        return out

    def reset(self) -> None:
        self.rows, self.seen, self.pending, self.is_initialized = [], 0, None, False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.rows = [self._copy_row(self.rows[i]) for i in beam_idx.tolist()]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.rows = [self.rows[i] for i in indices.tolist()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.rows = [self._copy_row(r) for r in self.rows for _ in range(repeats)]

    @staticmethod
    def _copy_row(r: RowStore) -> RowStore:
        n = r.length
        views = (None, None) if r.view_k is None else (r.view_k[:, :n].clone(), r.view_v[:, :n].clone())
        return RowStore(r.sink_k, r.sink_v, r.win_k, r.win_v, dict(r.body_k), dict(r.body_v), r.body_tokens, *views)

    # ---- storage ---------------------------------------------------------------------------------
    def _append(self, row: RowStore, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append rotated states ``[H, n, D]`` (float32) to a row: sink first, then the window;
        full pages leave the window for the body."""
        k, v = k.to(self.tier_dtype), v.to(self.tier_dtype)
        if self.read_view or row.view_k is not None:
            row.write_view(row.length, k.float(), v.float())
        room = max(0, self.spec.sink - row.sink_k.shape[1])
        if room:
            row.sink_k = torch.cat([row.sink_k, k[:, :room]], 1)
            row.sink_v = torch.cat([row.sink_v, v[:, :room]], 1)
            k, v = k[:, room:], v[:, room:]
        if k.shape[1]:
            row.win_k = torch.cat([row.win_k, k], 1)
            row.win_v = torch.cat([row.win_v, v], 1)
        if self.spec.quantized:
            self._flush(row)

    def _flush(self, row: RowStore) -> None:
        p, n = self.spec.page_size, row.win_k.shape[1]
        w = self.spec.window_at(row.sink_k.shape[1] + row.body_tokens + n)
        pages = (n - w) // p if n >= w + p else 0
        if not pages:
            return
        m = pages * p
        start = row.sink_k.shape[1] + row.body_tokens
        view = row.view_k is not None  # the read view, kept or this call's (attend), gets the dequantized pages
        decoded = {}
        for name, codec in (("k", self.key_codec), ("v", self.value_codec)):
            win = getattr(row, f"win_{name}")
            block = win[:, :m].float().reshape(self.kv_heads, pages, p, self.head_dim).transpose(0, 1)
            parts = codec.encode(block)
            if view:
                decoded[name] = codec.decode(parts).transpose(0, 1).reshape(self.kv_heads, m, self.head_dim)
            body = getattr(row, f"body_{name}")
            for key, t in parts.items():
                body[key] = torch.cat([body[key], t], 0) if key in body else t
            setattr(row, f"win_{name}", win[:, m:].clone())
        row.body_tokens += m
        if view:
            row.write_view(start, decoded["k"], decoded["v"])

    def read(self, row: RowStore) -> tuple[torch.Tensor, torch.Tensor]:
        """What a reader sees: float32 ``[H, n, D]`` keys and values of a row, body dequantized
        (a view of the row's read buffer, equal to :meth:`decode_row`)."""
        n = row.length
        if row.view_k is None:
            return self.decode_row(row)
        return row.view_k[:, :n], row.view_v[:, :n]

    def decode_row(self, row: RowStore) -> tuple[torch.Tensor, torch.Tensor]:
        """The same as :meth:`read`, decoded from the stored tiers and pages alone."""
        ks, vs = [row.sink_k.float()], [row.sink_v.float()]
        if row.body_tokens:
            for name, codec, out in (("k", self.key_codec, ks), ("v", self.value_codec, vs)):
                x = codec.decode(getattr(row, f"body_{name}"))  # [nb, H, P, D]
                out.append(x.transpose(0, 1).reshape(self.kv_heads, row.body_tokens, self.head_dim))
        ks.append(row.win_k.float())
        vs.append(row.win_v.float())
        return torch.cat(ks, 1), torch.cat(vs, 1)

    # ---- attention -----------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, real: torch.Tensor | None, scaling: float) -> torch.Tensor:
        """Attention of ``query [B, q_heads, q, D]`` over the stored tokens and the pending ones.

        real: ``[B, q]`` bool, which of the q new positions are real tokens (left padding only),
        or None when all are. Returns ``[B, q, q_heads, D]`` in the query dtype (zeros at pads).
        Chunks of ``prefill_chunk`` queries attend to the stored (quantized) cache of the earlier
        chunks plus their own states at full precision, then are written.
        """
        k_new, v_new = self.pending
        self.pending = None
        if not (torch.isfinite(k_new).all() and torch.isfinite(v_new).all()):
            self.seen -= k_new.shape[-2]  # nothing is stored: the cache stays as it was
            raise ValueError(f"layer {self.layer_idx}: the new key/value states contain NaN or Inf; nothing was stored")
        b, hq, q, d = query.shape
        rot = self.rotation
        qr, kr, vr = rot.queries(query), rot.keys(k_new), rot.values(v_new)
        out = torch.zeros(b, hq, q, d, dtype=torch.float32, device=query.device)
        # bf16 attention on a GPU serving a 16-bit model from 16-bit tiers (as the paged layer's dense path),
        # float32 elsewhere (on the CPU the casts below copy nothing)
        cdt = attention_dtype(query, self.tier_dtype)
        counts = self._counts(real, b, q).tolist()
        for i, row in enumerate(self.rows):
            chunks = range(q - counts[i], q, self.spec.prefill_chunk)
            # without a kept view, a call of several chunks decodes the row once into a view of its own that its
            # writes keep current and that goes with the call: one row's float32 copy at a time, not every row's
            transient = not self.read_view and len(chunks) > 1
            if transient:
                row.write_view(0, *self.decode_row(row))
            for c0 in chunks:
                c1 = min(c0 + self.spec.prefill_chunk, q)
                kc, vc = kr[i, :, c0:c1], vr[i, :, c0:c1]
                past_k, past_v = self.read(row)
                o = _sdpa(qr[i, :, c0:c1].to(cdt), torch.cat([past_k.to(cdt), kc.to(cdt)], 1),
                          torch.cat([past_v.to(cdt), vc.to(cdt)], 1), scaling)
                out[i, :, c0:c1] = o
                self._append(row, kc, vc)
            if transient:
                row.view_k = row.view_v = None
        return rot.outputs(out).transpose(1, 2).to(query.dtype)

    # ---- accounting ------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        tokens = sum(r.length for r in self.rows)
        body_tokens = sum(r.body_tokens for r in self.rows)
        return {
            "tokens": tokens,
            "body_tokens": body_tokens,
            "body_bytes": sum(r.body_bytes() for r in self.rows),
            "tier_bytes": sum(r.tier_bytes() for r in self.rows),
            "scratch_bytes": sum(r.scratch_bytes() for r in self.rows),
            "resident_bytes": sum(r.tier_bytes() + r.body_bytes() + r.scratch_bytes() for r in self.rows),
            "elements": 2 * tokens * self.kv_heads * self.head_dim,
            "body_elements": 2 * body_tokens * self.kv_heads * self.head_dim,
        }


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of the last ``m`` positions: ``q [Hq, m, D]``, ``k, v [H, n + m, D]``."""
    m, total = q.shape[1], k.shape[1]
    allowed = torch.arange(total, device=q.device)[None] <= (total - m + torch.arange(m, device=q.device))[:, None]
    o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=allowed, scale=scaling,
                                       enable_gqa=q.shape[0] != k.shape[0])
    return o[0]
