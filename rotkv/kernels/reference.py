"""Pure-PyTorch references of the Triton kernels (they run anywhere; the tests compare against them).

- :func:`quant_write_reference`: ``(x - mu) R``, clip, quantize with ``rotkv.quant.quantizer``,
  scatter codes and metadata into a :class:`~rotkv.kernels.body.TokenPart`.
- :func:`decode_reference`: gather each request's pages, dequantize in float32, attend together
  with the bf16 tier (one softmax over both), GQA by ``kv_head = q_head // n_rep``.
- :func:`dequant_pages`: the unfused baseline's first half (a paged body -> dense K/V).
"""

from __future__ import annotations

import torch

from rotkv.kernels.body import PagedBody, TokenPart
from rotkv.quant.quantizer import META_DTYPES, QuantizedRows, dequantize, quantize

_META_NAMES = {dt: name for name, dt in META_DTYPES.items()}


def lengths_from_table(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token count of every request ``[B]`` (int64) from a page table."""
    n = (kv_indptr[1:] - kv_indptr[:-1]).long()
    return torch.where(n > 0, (n - 1) * page_size + kv_last_page_len.long(), torch.zeros_like(n))


def quant_write_reference(x: torch.Tensor, slots: torch.Tensor, part: TokenPart, rot: torch.Tensor | None = None,
                          mean: torch.Tensor | None = None, clip: float = 1.0) -> None:
    """Quantize ``x [T, H, D]`` (rotated as ``(x - mean[h]) @ rot[h]``) into ``part`` at ``slots [T]``
    (in place; its bits, group size and metadata dtype as stated by the part)."""
    y = x.float()
    if mean is not None:
        y = y - mean.float()[None]
    if rot is not None:
        y = torch.einsum("thd,hde->the", y, rot.float())
    q = quantize(y, part.bits, part.group_size, clip, _META_NAMES[part.meta])
    p = part.codes.shape[2]
    page, off = slots.long() // p, slots.long() % p
    part.codes[page, :, off] = q.codes
    part.scale[page, :, off] = q.scale
    part.lo[page, :, off] = q.lo


def _gather(pages: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """``pages [NP, H, P, W]`` -> the first ``n`` tokens of the listed pages ``[H, n, W]``."""
    g = pages[indices.long()]  # [np, H, P, W]
    return g.permute(1, 0, 2, 3).reshape(g.shape[1], -1, g.shape[3])[:, :n]


def dequant_rows(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int,
                 group_size: int) -> torch.Tensor:
    """codes ``[.., D*bits/8]``, scale/lo ``[.., D/G]`` -> float32 ``[.., D]``."""
    return dequantize(QuantizedRows(codes, scale, lo, bits, group_size))


def dequant_pages(body: PagedBody, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Dense ``(K [H, L_b, D], V [H, L_b, D])`` per request of a paged body."""
    lens = lengths_from_table(kv_indptr, kv_last_page_len, body.page_size).tolist()
    out = []
    for b, n in enumerate(lens):
        idx = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        kv = [dequant_rows(*[_gather(t, idx, n) for t in part.tensors], part.bits, part.group_size).to(dtype)
              for part in body.parts]
        out.append((kv[0], kv[1]))
    return out


def refine_dense(dense: list, body: PagedBody, table: tuple, refine, side: int = 0) -> None:
    """Add the refine tier (rotkv.cache.refine) to the dense keys (``side`` 0; 1: values) of
    :func:`dequant_pages`, in place: ``refine``, a :class:`~rotkv.kernels.body.RefineTier` or ``(ring [B, K, H,
    P, D/4], K[, every])``; page ``i`` of request ``b`` is refined from slot ``i % K`` when it is one of the
    request's ``refined_pages(n, K, every)`` newest of its ``n`` pages."""
    from rotkv.kernels.body import RefineTier
    from rotkv.quant.packing import unpack
    from rotkv.quant.refine import refine_delta, refined_pages

    ring, k_pages, every = RefineTier.of(refine)
    indptr, indices = table[0].tolist(), table[1]
    part, p = body.parts[side], body.page_size
    for b, kv in enumerate(dense):
        k = kv[side]
        n = indptr[b + 1] - indptr[b]
        for i in range(n - refined_pages(n, k_pages, every), n):
            page = int(indices[indptr[b] + i])
            delta = refine_delta(unpack(ring[b, i % k_pages], 2), part.scale[page], part.group_size)  # [H, P, D]
            end = min(k.shape[1], (i + 1) * p)
            k[:, i * p:end] += delta[:, : end - i * p].to(k.dtype)


def decode_reference(q: torch.Tensor, body: PagedBody | None, table: tuple | None,
                     tier_k: torch.Tensor | None = None, tier_v: torch.Tensor | None = None,
                     tier_table: tuple | None = None, sm_scale: float | None = None,
                     tier_start: int = 0, refine=None, refine_values=None) -> torch.Tensor:
    """One decode step in float32.

    q ``[B, Hq, D]`` (already rotated); body a :class:`~rotkv.kernels.body.PagedBody` (any width);
    table ``(kv_indptr, kv_indices, kv_last_page_len)`` of the body; tier_k/tier_v
    ``[NPT, H, PT, D]`` with tier_table likewise (positions below ``tier_start`` hold no token).
    ``refine``, ``refine_values``: the body's refine tier of keys and values (:func:`refine_dense`). Returns ``[B, Hq, D]`` float32.
    """
    b_sz, hq, d = q.shape
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    dense = dequant_pages(body, *table) if table is not None else [None] * b_sz
    if refine is not None and table is not None:
        refine_dense(dense, body, table, refine)
    if refine_values is not None and table is not None:
        refine_dense(dense, body, table, refine_values, side=1)
    if tier_table is not None:
        pt = tier_k.shape[2]
        tier_lens = lengths_from_table(tier_table[0], tier_table[2], pt).tolist()
    out = torch.empty(b_sz, hq, d, dtype=torch.float32, device=q.device)
    for b in range(b_sz):
        ks, vs = [], []
        if dense[b] is not None:
            ks.append(dense[b][0]), vs.append(dense[b][1])
        if tier_table is not None:
            idx = tier_table[1][tier_table[0][b]:tier_table[0][b + 1]]
            ks.append(_gather(tier_k, idx, tier_lens[b])[:, tier_start:].float())
            vs.append(_gather(tier_v, idx, tier_lens[b])[:, tier_start:].float())
        k, v = torch.cat(ks, 1), torch.cat(vs, 1)  # [H, L, D]
        rep = hq // k.shape[0]
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        s = torch.einsum("hd,hld->hl", q[b].float(), k) * sm_scale
        out[b] = torch.einsum("hl,hld->hd", torch.softmax(s, -1), v)
    return out
