"""INT2 or INT4 pages of one body part -> dense K or V (Triton): the first half of the unfused
"dequant + SDPA" baseline.

Writes ``out [B, H, L_max, D]`` (tokens past a request's length are left untouched).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rotkv.kernels.body import TokenPart
from rotkv.quant.widths import KERNEL_WIDTHS, check_width


@triton.jit
def _dequant_kernel(codes_ptr, scale_ptr, lo_ptr, indptr_ptr, indices_ptr, last_ptr, out_ptr, H, L,
                    D: tl.constexpr, G: tl.constexpr, P: tl.constexpr, BLOCK: tl.constexpr,
                    BITS: tl.constexpr):
    pid, blk = tl.program_id(0), tl.program_id(1)
    b, h = pid // H, pid % H
    NG: tl.constexpr = D // G
    Q4: tl.constexpr = D // 4
    ROWB: tl.constexpr = D * BITS // 8
    start = tl.load(indptr_ptr + b)
    npages = tl.load(indptr_ptr + b + 1) - start
    n_tok = tl.where(npages > 0, (npages - 1) * P + tl.load(last_ptr + b), 0)
    offs_n = blk * BLOCK + tl.arange(0, BLOCK)
    nmask = offs_n < n_tok
    page = tl.load(indices_ptr + start + offs_n // P, mask=nmask, other=0).to(tl.int64)
    row = (page * H + h) * P + offs_n % P
    offs_c = tl.arange(0, Q4)
    byte = tl.load(codes_ptr + row[:, None] * ROWB + offs_c[None, :], mask=nmask[:, None], other=0)
    if BITS == 2:  # byte j: dims j + i * D/4 in bits 2i
        c = tl.join(tl.join(byte & 3, (byte >> 4) & 3), tl.join((byte >> 2) & 3, (byte >> 6) & 3))
    else:  # INT4, byte j: dims j (low nibble) and j + D/2; quarters 0..3 = lo(A), lo(B), hi(A), hi(B)
        byte2 = tl.load(codes_ptr + row[:, None] * ROWB + Q4 + offs_c[None, :], mask=nmask[:, None], other=0)
        c = tl.join(tl.join(byte & 15, byte >> 4), tl.join(byte2 & 15, byte2 >> 4))
    c = tl.reshape(tl.permute(c, [0, 2, 3, 1]), [BLOCK, D])  # [n, j, i, k] -> [n, i, k, j]: quarter 2i+k
    offs_d = tl.arange(0, D)
    grp = row[:, None] * NG + (offs_d // G)[None, :]
    s = tl.load(scale_ptr + grp, mask=nmask[:, None], other=0.0).to(tl.float32)
    lo = tl.load(lo_ptr + grp, mask=nmask[:, None], other=0.0).to(tl.float32)
    x = c.to(tl.float32) * s + lo
    optr = out_ptr + ((b * H + h).to(tl.int64) * L + offs_n)[:, None] * D + offs_d[None, :]
    tl.store(optr, x.to(out_ptr.dtype.element_ty), mask=nmask[:, None])


def dequant_dense(part: TokenPart, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor,
                  max_len: int, out: torch.Tensor, block: int = 64) -> torch.Tensor:
    """Dequantize every request's tokens of one body part (``max_len`` the longest) into
    ``out [B, H, L, D]``."""
    b, h, length, d = out.shape
    check_width(part.bits, "bits", KERNEL_WIDTHS)
    if part.head_dim != d:
        raise ValueError(f"the part's head_dim {part.head_dim} is not the output's {d}")
    _dequant_kernel[(b * h, triton.cdiv(max_len, block))](
        *part.tensors, kv_indptr, kv_indices, kv_last_page_len, out, h, length, D=d, G=part.group_size,
        P=part.codes.shape[2], BLOCK=block, BITS=part.bits)
    return out
