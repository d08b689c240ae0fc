"""Layers with a memory budget: progressive precision (PM-KVQ) and, as its baselines, eviction.

Each layer's budget is what ``spec.budget_tokens`` tokens of one sequence take in that layer at
its final width, the bf16 sink and window included (``layer_budget``), times the batch's rows.

- :class:`ProgressiveLayer` (``spec.start_bits`` set): the body starts at 16 (or 8) bits. Before
  a page leaves the window, the layer checks the bytes it would then hold; while that is over
  budget the whole body (every row, keys and values) shrinks one step, 16 -> 8 -> 4 -> 2, down
  to the layer's final width, by the equivalent right shift on the integer codes
  (``rotkv.quant.progressive``). Pages written later are quantized at the current width on the
  same grid. At the final width a layer still over budget raises, naming the budget and the
  context length: it never drops tokens.
- :class:`EvictingLayer` (``budget_tokens`` without ``start_bits``): fixed width, or bf16 when
  ``bits`` is None; over budget, the oldest tokens after the sink are dropped (body pages first,
  then window tokens): "keep the sink and the most recent tokens that fit". Keys are stored
  post-RoPE, so the kept tokens keep their positions.

Final widths per layer come from an artifact's ``bits [L]`` (``rotkv calibrate --method pmkvq``),
otherwise ``spec.bits`` for every layer (:func:`rotkv.cache.widths.resolve_widths`);
:func:`rotkv.cache.assembly.plan_cache` resolves them with each layer's codecs and budget. Rotations compose: the body stores rotated rows.
"""

from __future__ import annotations

import torch

from rotkv.cache.rowstore import RowStore, RowStoreLayer
from rotkv.config import CacheSpec
from rotkv.quant.progressive import (
    ProgressiveRows,
    anchor_div,
    anchor_dtype,
    dequantize_progressive,
    quantize_at,
    shrink_stored,
    step_factor,
)
from rotkv.quant.quantizer import meta_dtype


class ProgressiveCodec:
    """A block codec whose width shrinks; pages ``[nb, H, P, D]`` <-> ``{codes, scale, lo}``.

    State shared by every page of the body: ``bits`` (current width), ``mult`` (M), ``div``.
    """

    def __init__(self, start_bits: int, final_bits: int, group_size: int, clip: float = 1.0,
                 anchor: str = "final", shift: str = "equivalent"):
        self.bits, self.final_bits, self.group_size, self.clip = start_bits, final_bits, group_size, clip
        self.shift, self.mult = shift, 1
        self.div = anchor_div(start_bits, final_bits, anchor)
        self.dtype = anchor_dtype(start_bits, final_bits, anchor)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        q = quantize_at(x, self.bits, self.mult, self.div, self.dtype, self.group_size, self.clip, self.shift)
        return {"codes": q.codes, "scale": q.scale, "lo": q.lo}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        q = ProgressiveRows(parts["codes"], parts["scale"], parts["lo"], self.bits, self.mult, self.div, self.group_size)
        return dequantize_progressive(q)

    @property
    def can_shrink(self) -> bool:
        return self.bits // 2 >= self.final_bits

    def shrink_parts(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stored codes one step down (integer ops only); lo and scale are kept as they are."""
        return parts | {"codes": shrink_stored(parts["codes"], self.bits, self.shift)}

    def step(self) -> None:
        c = self.bits // 2
        self.bits, self.mult = c, self.mult * step_factor(c, self.shift)

    def row_bytes(self, head_dim: int, bits: int | None = None) -> int:
        """Bytes of one token-head row ``[D]`` at ``bits`` (default: the current width)."""
        bits = self.bits if bits is None else bits
        return head_dim * bits // 8 + 2 * (head_dim // self.group_size) * self.dtype.itemsize


def body_row_bytes(head_dim: int, bits: int, group_size: int, meta: torch.dtype | None = None) -> int:
    """Bytes of one quantized token-head row ``[D]``: codes plus lo and scale per group."""
    return head_dim * bits // 8 + 2 * (head_dim // group_size) * (meta or meta_dtype(bits)).itemsize


def layer_budget(spec: CacheSpec, final_bits: int | None, kv_heads: int, head_dim: int, tier_itemsize: int) -> int:
    """Bytes one sequence may hold in one layer: ``spec.budget_tokens`` tokens at ``final_bits``
    (None: unquantized), with the sink and the fullest window (W + P - 1 tokens) in the tier dtype."""
    n = spec.budget_tokens
    tier_tok = 2 * kv_heads * head_dim * tier_itemsize
    if final_bits is None:
        return n * tier_tok
    tiers = min(n, spec.sink + spec.window + spec.page_size - 1)
    meta = anchor_dtype(spec.start_bits, final_bits, spec.anchor) if spec.start_bits else None
    body_tok = 2 * kv_heads * body_row_bytes(head_dim, final_bits, spec.resolved_group(head_dim), meta)
    return tiers * tier_tok + (n - tiers) * body_tok


def _bytes(row: RowStore) -> int:
    return row.tier_bytes() + row.body_bytes()


class ProgressiveLayer(RowStoreLayer):
    """A hybrid layer whose body shrinks to stay within its budget; see the module docstring."""

    def __init__(self, *args, final_bits: int, budget: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.final_bits, self.budget = final_bits, budget
        self.shrinks: list[tuple[int, int]] = []  # (context length, new width) of every shrink

    @property
    def bits(self) -> int:
        return self.key_codec.bits

    def held_bytes(self) -> int:
        """Bytes every row holds, tiers and body: ``sum(tier_bytes + body_bytes)`` over the rows, from token
        counts. Every row's tiers are in the tier dtype, and every stored page has the same bytes (pages are
        encoded, and shrunk, at the layer's one current width), so this takes one page's bytes instead of
        each row's tensors: a flush checks the budget without a pass over every row's tensors."""
        tier_tok = 2 * self.kv_heads * self.head_dim * self.tier_dtype.itemsize
        tiers = body = 0
        page_bytes = None
        for r in self.rows:
            tiers += r.sink_k.shape[1] + r.win_k.shape[1]
            if r.body_tokens:
                body += r.body_tokens
                if page_bytes is None:
                    pages = r.body_tokens // self.spec.page_size
                    page_bytes = r.body_bytes() // pages
        return tiers * tier_tok + (body // self.spec.page_size) * (page_bytes or 0)

    def shrink(self) -> None:
        """The whole body (every row, keys and values) one step down; the rows' float32 read
        views (the reference reader's) get the body's new values."""
        for row in self.rows:
            if row.body_tokens:
                row.body_k = self.key_codec.shrink_parts(row.body_k)
                row.body_v = self.value_codec.shrink_parts(row.body_v)
        self.key_codec.step()
        self.value_codec.step()
        for row in self.rows:
            if row.body_tokens and row.view_k is not None:
                k, v = (c.decode(getattr(row, f"body_{n}")).transpose(0, 1).reshape(self.kv_heads, row.body_tokens, self.head_dim)
                        for n, c in (("k", self.key_codec), ("v", self.value_codec)))
                row.write_view(row.sink_k.shape[1], k, v)

    def _flush(self, row: RowStore) -> None:
        p, w = self.spec.page_size, self.spec.window
        n = row.win_k.shape[1]
        m = (n - w) // p * p if n >= w + p else 0
        if not m:
            return
        budget = self.budget * len(self.rows)
        tier_tok = 2 * self.kv_heads * self.head_dim * row.win_k.element_size()

        def after() -> int:  # bytes held once the m tokens are in the body at the current width
            body_tok = 2 * self.kv_heads * self.key_codec.row_bytes(self.head_dim)
            return self.held_bytes() - m * tier_tok + m * body_tok

        while after() > budget and self.key_codec.can_shrink:
            self.shrink()
            self.shrinks.append((row.length, self.bits))
        if after() > budget:
            raise ValueError(
                f"layer {self.layer_idx}: the KV cache is over its budget at its final width of {self.final_bits} bits: "
                f"{after()} bytes > {budget} bytes (budget_tokens={self.spec.budget_tokens} per sequence) at a "
                f"context length of {row.length} tokens; raise `budget_tokens` or lower the final width"
            )
        super()._flush(row)


def _drop_view(row: RowStore, start: int, count: int) -> None:
    """Remove tokens ``[start, start + count)`` from the row's float32 read view, if it has one."""
    if row.view_k is not None and count > 0:
        cut = lambda t: torch.cat([t[:, :start], t[:, start + count :]], 1)  # noqa: E731
        row.view_k, row.view_v = cut(row.view_k), cut(row.view_v)


class EvictingLayer(RowStoreLayer):
    """Fixed width (or bf16) with a budget: drops the oldest tokens after the sink; see the module docstring."""

    def __init__(self, *args, budget: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.budget = budget
        self.evicted = 0

    def _append(self, row: RowStore, k: torch.Tensor, v: torch.Tensor) -> None:
        super()._append(row, k, v)
        excess = _bytes(row) - self.budget
        sink = row.sink_k.shape[1]
        if excess > 0 and row.body_tokens:
            page = self.spec.page_size
            page_bytes = row.body_bytes() // (row.body_tokens // page)
            drop = min(-(-excess // page_bytes), row.body_tokens // page)
            row.body_k = {key: t[drop:] for key, t in row.body_k.items()}
            row.body_v = {key: t[drop:] for key, t in row.body_v.items()}
            row.body_tokens -= drop * page
            _drop_view(row, sink, drop * page)
            self.evicted += drop * page
            excess = _bytes(row) - self.budget
        if excess > 0:
            tok = 2 * self.kv_heads * self.head_dim * row.win_k.element_size()
            drop = min(-(-excess // tok), row.win_k.shape[1] - 1)
            row.win_k, row.win_v = row.win_k[:, drop:].clone(), row.win_v[:, drop:].clone()
            _drop_view(row, sink + row.body_tokens, drop)
            self.evicted += drop
