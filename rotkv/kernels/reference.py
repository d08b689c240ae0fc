"""Pure-PyTorch references of the Triton kernels (they run anywhere; the tests compare against them).

- :func:`quant_write_reference`: ``(x - mu) R``, clip, quantize with ``rotkv.quant.quantizer``,
  scatter codes and metadata into an :class:`~rotkv.cache.paged.Int2PagePool`'s tensors.
- :func:`decode_reference`: gather each request's pages, dequantize in float32, attend together
  with the bf16 tier (one softmax over both), GQA by ``kv_head = q_head // n_rep``.
- :func:`dequant_pages`: the unfused baseline's first half (INT2/INT4 pages -> dense K/V).
"""

from __future__ import annotations

import torch

from rotkv.quant.packing import unpack
from rotkv.quant.quantizer import quantize


def lengths_from_table(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token count of every request ``[B]`` (int64) from a page table."""
    n = (kv_indptr[1:] - kv_indptr[:-1]).long()
    return torch.where(n > 0, (n - 1) * page_size + kv_last_page_len.long(), torch.zeros_like(n))


def quant_write_reference(x: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                          lo: torch.Tensor, rot: torch.Tensor | None = None, mean: torch.Tensor | None = None,
                          clip: float = 1.0, group_size: int = 64) -> None:
    """Quantize ``x [T, H, D]`` (rotated as ``(x - mean[h]) @ rot[h]``) into the pool at ``slots [T]``.

    codes ``[NP, H, P, D*bits/8]`` uint8 (bits 2 or 4, read off its width), scale/lo
    ``[NP, H, P, D/G]`` fp16 are written in place.
    """
    y = x.float()
    if mean is not None:
        y = y - mean.float()[None]
    if rot is not None:
        y = torch.einsum("thd,hde->the", y, rot.float())
    q = quantize(y, codes.shape[-1] * 8 // x.shape[-1], group_size, clip)
    p = codes.shape[2]
    page, off = slots.long() // p, slots.long() % p
    codes[page, :, off] = q.codes
    scale[page, :, off] = q.scale
    lo[page, :, off] = q.lo


def _gather(pages: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """``pages [NP, H, P, W]`` -> the first ``n`` tokens of the listed pages ``[H, n, W]``."""
    g = pages[indices.long()]  # [np, H, P, W]
    return g.permute(1, 0, 2, 3).reshape(g.shape[1], -1, g.shape[3])[:, :n]


def dequant_rows(codes: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """codes ``[.., D*bits/8]``, scale/lo ``[.., D/G]`` -> float32 ``[.., D]``."""
    c = unpack(codes, bits).float()
    d, ng = c.shape[-1], scale.shape[-1]
    c = c.reshape(*c.shape[:-1], ng, d // ng) * scale.float()[..., None] + lo.float()[..., None]
    return c.reshape(*c.shape[:-2], d)


def dequant_pages(pool_k: tuple, pool_v: tuple, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                  kv_last_page_len: torch.Tensor, dtype: torch.dtype = torch.float32,
                  bits: tuple[int, int] = (2, 2)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Dense ``(K [H, L_b, D], V [H, L_b, D])`` per request from ``(codes, scale, lo)`` pool tensors
    (``bits``: the widths of K and V)."""
    p = pool_k[0].shape[2]
    lens = lengths_from_table(kv_indptr, kv_last_page_len, p).tolist()
    out = []
    for b, n in enumerate(lens):
        idx = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
        kv = [dequant_rows(*[_gather(t, idx, n) for t in pool], bits=nb).to(dtype)
              for pool, nb in zip((pool_k, pool_v), bits)]
        out.append((kv[0], kv[1]))
    return out


def decode_reference(q: torch.Tensor, pool_k: tuple | None, pool_v: tuple | None, table: tuple | None,
                     tier_k: torch.Tensor | None = None, tier_v: torch.Tensor | None = None,
                     tier_table: tuple | None = None, sm_scale: float | None = None,
                     tier_start: int = 0) -> torch.Tensor:
    """One decode step in float32.

    q ``[B, Hq, D]`` (already rotated); pool_k/pool_v ``(codes, scale, lo)`` (INT2 or INT4 each); table
    ``(kv_indptr, kv_indices, kv_last_page_len)`` of the INT2 body; tier_k/tier_v
    ``[NPT, H, PT, D]`` with tier_table likewise (positions below ``tier_start`` hold no token).
    Returns ``[B, Hq, D]`` float32.
    """
    b_sz, hq, d = q.shape
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    if table is not None:  # the widths of K and V (2 or 4 bits) from the codes' row bytes
        bits = (pool_k[0].shape[-1] * 8 // d, pool_v[0].shape[-1] * 8 // d)
        body = dequant_pages(pool_k, pool_v, *table, bits=bits)
    else:
        body = [None] * b_sz
    if tier_table is not None:
        pt = tier_k.shape[2]
        tier_lens = lengths_from_table(tier_table[0], tier_table[2], pt).tolist()
    out = torch.empty(b_sz, hq, d, dtype=torch.float32, device=q.device)
    for b in range(b_sz):
        ks, vs = [], []
        if body[b] is not None:
            ks.append(body[b][0]), vs.append(body[b][1])
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
