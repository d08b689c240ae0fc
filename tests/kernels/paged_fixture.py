"""Stand-alone page pools and a page table, in the layout the kernels read (for the kernel tests).

Was ``rotkv.cache.paged``; only tests/kernels/test_kernels.py uses it.

The cache itself keeps its pages in ``rotkv.cache.pools`` (one per layer) and its page lists in
``rotkv.cache.plan`` (shared by the layers); both use the layout described here.

Layout is HND per page (a page holds ``P`` tokens of every KV head, one head's tokens contiguous):

- INT2 body: ``codes [num_pages, H, P, D/4] uint8`` (planar packed, see ``rotkv.quant.packing``),
  ``scale, lo [num_pages, H, P, D/G] float16``, one part for keys and one for values
  (:class:`rotkv.kernels.body.PagedBody`).
- bf16 tier (sink + recent window): ``k, v [num_pages, H, P, D]`` in the tier dtype.

A request's tokens live in a list of pages; a batch is described by
``kv_indptr [B+1]``, ``kv_indices [nnz_pages]`` and ``kv_last_page_len [B]`` (int32), where
request ``b`` owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` and its last page holds
``kv_last_page_len[b]`` tokens (1..P; a request with no pages has length 0).
Writers address tokens by *slot* = ``page * P + offset`` (int64), as vLLM's slot mapping does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rotkv.kernels.body import PagedBody, TokenPart
from rotkv.kernels.reference import lengths_from_table  # noqa: F401  (re-exported: the table's vocabulary)
from rotkv.quant.widths import KERNEL_WIDTHS, check_width


class PagePool:
    """Fixed-size storage of ``num_pages`` pages and a free list. Subclasses own the tensors."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"`num_pages` and `page_size` have to be >= 1, got {num_pages}, {page_size}")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError(f"page pool exhausted ({self.num_pages} pages of {self.page_size} tokens)")
        return self._free.pop()

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    @property
    def free_pages(self) -> int:
        return len(self._free)


class Int2PagePool(PagePool):
    """Packed INT2 (or INT4: ``k_bits`` / ``v_bits``) keys and values with fp16 scale and lo per
    group of ``group_size`` dims (the values' e4m3 with ``v_meta``): ``body``, a
    :class:`~rotkv.kernels.body.PagedBody`."""

    def __init__(self, num_pages: int, kv_heads: int, head_dim: int, page_size: int = 16,
                 group_size: int = 64, device: str | torch.device = "cpu", k_bits: int = 2, v_bits: int = 2,
                 v_meta: torch.dtype = torch.float16):
        super().__init__(num_pages, page_size)
        if head_dim % 4:
            raise ValueError(f"head_dim ({head_dim}) must be a multiple of 4")
        for name, b in (("k_bits", k_bits), ("v_bits", v_bits)):
            check_width(b, name, KERNEL_WIDTHS)
        self.kv_heads, self.head_dim, self.group_size = kv_heads, head_dim, group_size
        self.body = PagedBody(TokenPart.zeros(num_pages, kv_heads, page_size, head_dim, k_bits, group_size,
                                              device=device),
                              TokenPart.zeros(num_pages, kv_heads, page_size, head_dim, v_bits, group_size, v_meta,
                                              device))

    def part(self, which: str) -> TokenPart:
        """The body part of ``which`` in {"k", "v"}."""
        if which not in ("k", "v"):
            raise ValueError(f"`which` has to be one of ['k', 'v'] but got {which!r}")
        return getattr(self.body, which)

    @property
    def nbytes_per_token(self) -> int:
        """Resident bytes of one token, all KV heads, K and V, metadata included."""
        return self.kv_heads * sum(part.row_bytes for part in self.body.parts)


class Bf16PagePool(PagePool):
    """Unquantized keys and values (the sink and recent tier, or a plain bf16 cache)."""

    def __init__(self, num_pages: int, kv_heads: int, head_dim: int, page_size: int = 16,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu"):
        super().__init__(num_pages, page_size)
        self.kv_heads, self.head_dim = kv_heads, head_dim
        shape = (num_pages, kv_heads, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [T, H, D]`` at ``slots [T]`` (int64 page * P + offset)."""
        page, off = slots // self.page_size, slots % self.page_size
        self.k[page, :, off] = k.to(self.k.dtype)
        self.v[page, :, off] = v.to(self.v.dtype)


@dataclass
class PageTable:
    """Host-side page lists of a batch of requests on one pool.

    ``lengths[b]`` tokens of request ``b`` live in ``pages[b]``; :meth:`append` hands out slots
    for new tokens (allocating pages from the pool), :meth:`tensors` builds the device table.
    """

    pool: PagePool
    pages: list[list[int]] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)

    def add_request(self) -> int:
        self.pages.append([])
        self.lengths.append(0)
        return len(self.pages) - 1

    def append(self, req: int, n: int) -> torch.Tensor:
        """Reserve ``n`` token slots at the end of request ``req``; returns int64 slots ``[n]``."""
        p = self.pool.page_size
        slots = []
        for t in range(self.lengths[req], self.lengths[req] + n):
            if t // p == len(self.pages[req]):
                self.pages[req].append(self.pool.alloc())
            slots.append(self.pages[req][t // p] * p + t % p)
        self.lengths[req] += n
        return torch.tensor(slots, dtype=torch.int64)

    def release(self, req: int) -> None:
        self.pool.free(self.pages[req])
        self.pages[req], self.lengths[req] = [], 0

    def tensors(self, device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``kv_indptr [B+1]``, ``kv_indices [nnz]``, ``kv_last_page_len [B]``, int32 on ``device``."""
        return page_table_tensors(self.lengths, self.pages, self.pool.page_size, device)


def page_table_tensors(lengths: list[int], pages: list[list[int]], page_size: int,
                       device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Build the int32 page table from host lists (pages beyond a request's length are dropped)."""
    indptr, indices, last = [0], [], []
    for n, pg in zip(lengths, pages):
        used = -(-n // page_size)
        indices.extend(pg[:used])
        indptr.append(len(indices))
        last.append(n - (used - 1) * page_size if used else 0)
    mk = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return mk(indptr), mk(indices), mk(last)
