"""INT2 or INT4 pages of one body part -> dense K or V (Triton): the first half of the unfused
"dequant + SDPA" baseline, and the dense reader of the cache's PyTorch attention paths.

Writes ``out [B, H, L_max, D]`` (tokens past a request's length are left untouched). Token parts
(``rotkv.kernels.body.TokenPart``) and KIVI's per-channel keys (``ChannelPart``) each have a kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rotkv.kernels.body import ChannelPart, TokenPart
from rotkv.quant.widths import KERNEL_WIDTHS, check_width


@triton.jit
def _codes(codes_ptr, rows, mask, R: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr):
    """The integer codes ``[R, N]`` of ``rows [R]`` (row ids; masked rows read 0) of a planar-packed uint8
    array of ``N * BITS / 8`` bytes a row (rotkv.quant.packing)."""
    ROWB: tl.constexpr = N * BITS // 8
    Q4: tl.constexpr = N // 4
    offs_c = tl.arange(0, Q4)
    ptr = codes_ptr + rows[:, None] * ROWB + offs_c[None, :]
    byte = tl.load(ptr, mask=mask[:, None], other=0)
    if BITS == 2:  # byte j: codes j + i * N/4 in bits 2i
        c = tl.join(tl.join(byte & 3, (byte >> 4) & 3), tl.join((byte >> 2) & 3, (byte >> 6) & 3))
    else:  # INT4, byte j: codes j (low nibble) and j + N/2; quarters 0..3 = lo(A), lo(B), hi(A), hi(B)
        byte2 = tl.load(ptr + Q4, mask=mask[:, None], other=0)
        c = tl.join(tl.join(byte & 15, byte >> 4), tl.join(byte2 & 15, byte2 >> 4))
    return tl.reshape(tl.permute(c, [0, 2, 3, 1]), [R, N])  # [n, j, i, k] -> [n, i, k, j]: quarter 2i+k


@triton.jit
def _dequant_kernel(codes_ptr, scale_ptr, lo_ptr, indptr_ptr, indices_ptr, last_ptr, out_ptr, H, L,
                    D: tl.constexpr, G: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr,
                    BITS: tl.constexpr):
    pid, blk = tl.program_id(0), tl.program_id(1)
    b, h = pid // H, pid % H
    NG: tl.constexpr = D // G
    start = tl.load(indptr_ptr + b)
    npages = tl.load(indptr_ptr + b + 1) - start
    n_tok = tl.where(npages > 0, (npages - 1) * P + tl.load(last_ptr + b), 0)
    offs_n = blk * BLOCK + tl.arange(0, BLOCK)
    nmask = offs_n < n_tok
    page = tl.load(indices_ptr + start + offs_n // P, mask=nmask, other=0).to(tl.int64)
    row = (page * H + h) * P + offs_n % P
    c = _codes(codes_ptr, row, nmask, BLOCK, D, BITS)
    offs_d = tl.arange(0, D)
    grp = row[:, None] * NG + (offs_d // G)[None, :]
    s = tl.load(scale_ptr + grp, mask=nmask[:, None], other=0.0).to(tl.float32)
    lo = tl.load(lo_ptr + grp, mask=nmask[:, None], other=0.0).to(tl.float32)
    x = c.to(tl.float32) * s + lo
    optr = out_ptr + ((b * H + h).to(tl.int64) * L + offs_n)[:, None] * D + offs_d[None, :]
    tl.store(optr, x.to(out_ptr.dtype.element_ty), mask=nmask[:, None])


@triton.jit
def _dequant_channel_kernel(codes_ptr, scale_ptr, lo_ptr, indptr_ptr, indices_ptr, last_ptr, out_ptr, H, L,
                            D: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr):
    """One page of one request and KV head: the D channel rows of its codes ``[D, P]``, scaled per channel,
    stored as ``P`` tokens of ``D`` dims."""
    pid, i = tl.program_id(0), tl.program_id(1)
    b, h = pid // H, pid % H
    start = tl.load(indptr_ptr + b)
    npages = tl.load(indptr_ptr + b + 1) - start
    n_tok = tl.where(i == npages - 1, tl.load(last_ptr + b), tl.where(i < npages, P, 0))
    page = tl.load(indices_ptr + start + i, mask=i < npages, other=0).to(tl.int64)
    offs_d = tl.arange(0, D)
    rows = (page * H + h) * D + offs_d  # the page's channel rows of head h
    live = offs_d < tl.where(n_tok > 0, D, 0)
    c = _codes(codes_ptr, rows, live, D, P, BITS)  # [D, P]
    s = tl.load(scale_ptr + rows, mask=live, other=0.0).to(tl.float32)
    lo = tl.load(lo_ptr + rows, mask=live, other=0.0).to(tl.float32)
    x = tl.trans(c.to(tl.float32) * s[:, None] + lo[:, None])  # [P, D]
    offs_t = tl.arange(0, P)
    optr = out_ptr + ((b * H + h).to(tl.int64) * L + i * P + offs_t)[:, None] * D + offs_d[None, :]
    tl.store(optr, x.to(out_ptr.dtype.element_ty), mask=(offs_t < n_tok)[:, None])


def dequant_dense(part: TokenPart | ChannelPart, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                  kv_last_page_len: torch.Tensor, max_len: int, out: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Dequantize every request's tokens of one body part (``max_len`` the longest) into
    ``out [B, H, L, D]`` (``L >= max_len``; ``block``: tokens a program of the token kernel writes)."""
    b, h, length, d = out.shape
    check_width(part.bits, "bits", KERNEL_WIDTHS)
    if part.head_dim != d:
        raise ValueError(f"the part's head_dim {part.head_dim} is not the output's {d}")
    if not all(t.is_contiguous() for t in part.tensors):
        raise ValueError("the dequant kernel reads contiguous parts (a pool's tensors)")
    p = part.page_size
    if isinstance(part, ChannelPart):
        _dequant_channel_kernel[(b * h, triton.cdiv(max_len, p))](
            *part.tensors, kv_indptr, kv_indices, kv_last_page_len, out, h, length, D=d, P=p, BITS=part.bits)
        return out
    _dequant_kernel[(b * h, triton.cdiv(max_len, block))](
        *part.tensors, kv_indptr, kv_indices, kv_last_page_len, out, h, length, D=d, G=part.group_size,
        P=p, BLOCK=block, BITS=part.bits)
    return out
