"""How rotkv's INT2 body pages sit in vLLM's KV-cache blocks.

One vLLM block is one body page of ``P`` tokens (``block_size = P = 16``) of keys and values: per token
and KV head, the key codes (``D * k_bits / 8`` bytes), the key ``scale`` and ``lo`` (``D / G`` each in the
key metadata dtype), then the same for values. vLLM sees ``page_bytes`` bytes per block and per layer
(:meth:`BlockLayout.page_bytes`), so its block accounting (``num_gpu_blocks``) counts INT2 pages.

vLLM hands a layer one uint8 tensor of ``num_blocks * page_bytes`` bytes. Inside it the six parts are laid
out part-major (as FlashAttention's cache is K-major then V-major): ``k_codes`` of every block, then
``k_scale`` of every block, ... So every part is a contiguous ``[num_blocks, H, P, W]`` tensor, a view at a
byte offset (:meth:`BlockLayout.body`), which is the layout rotkv's kernels (Triton and CUDA decode, the
fused write, the dequantizer) read and write; block ``b`` of vLLM's block table is page ``b`` of every part.
Every part starts on a 16-byte boundary (each part's bytes per block are a multiple of 16 at ``P = 16``).
A layer whose parts need fewer bytes than the group's page (layers with 2-bit keys next to 4-bit ones)
leaves the tail of its tensor unused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rotkv.kernels.body import PagedBody, TokenPart
from rotkv.quant.quantizer import meta_dtype

PARTS = ("k_codes", "k_scale", "k_lo", "v_codes", "v_scale", "v_lo")


@dataclass(frozen=True)
class BlockLayout:
    """The bytes of one block of one layer: ``kv_heads`` heads of ``head_dim`` dims, ``page`` tokens, keys and
    values at ``bits`` = (key bits, value bits) in groups of ``group_size``, metadata ``metas`` (torch dtypes)."""

    kv_heads: int
    head_dim: int
    page: int
    bits: tuple[int, int]
    group_size: int
    metas: tuple[torch.dtype, torch.dtype]

    @classmethod
    def of(cls, kv_heads: int, head_dim: int, page: int, key_codec, value_codec) -> "BlockLayout":
        """The layout of a layer with these (key, value) :class:`~rotkv.cache.codecs.TokenCodec` s."""
        if key_codec.group_size != value_codec.group_size:
            raise ValueError(f"keys and values must share the group size, got {key_codec.group_size} and "
                             f"{value_codec.group_size}")
        return cls(kv_heads, head_dim, page, (key_codec.bits, value_codec.bits), key_codec.group_size,
                   (meta_dtype(key_codec.bits, key_codec.meta), meta_dtype(value_codec.bits, value_codec.meta)))

    def __post_init__(self):
        if self.head_dim % self.group_size:
            raise ValueError(f"group_size {self.group_size} has to divide head_dim {self.head_dim}")
        for name, n in self.part_bytes().items():
            if n % 16:
                raise ValueError(f"part {name} takes {n} bytes per block, not a multiple of 16 (page {self.page})")

    def slot_bytes(self) -> int:
        """Bytes of one token of one KV head, keys and values with their metadata."""
        d, ng = self.head_dim, self.head_dim // self.group_size
        return sum(d * b // 8 + 2 * ng * torch.empty(0, dtype=m).element_size() for b, m in zip(self.bits, self.metas))

    def part_bytes(self) -> dict[str, int]:
        """Bytes per block of every part, in :data:`PARTS` order."""
        rows = self.kv_heads * self.page
        ng = self.head_dim // self.group_size
        out = {}
        for side, b, m in zip("kv", self.bits, self.metas):
            meta = rows * ng * torch.empty(0, dtype=m).element_size()
            out.update({f"{side}_codes": rows * self.head_dim * b // 8, f"{side}_scale": meta, f"{side}_lo": meta})
        return out

    def page_bytes(self) -> int:
        """Bytes of one block (one page of keys and values): ``page * kv_heads * slot_bytes``."""
        return sum(self.part_bytes().values())

    def shapes(self, num_blocks: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of every part's view over ``num_blocks`` blocks."""
        h, p, ng = self.kv_heads, self.page, self.head_dim // self.group_size
        out = {}
        for side, b, m in zip("kv", self.bits, self.metas):
            out[f"{side}_codes"] = ((num_blocks, h, p, self.head_dim * b // 8), torch.uint8)
            out[f"{side}_scale"] = ((num_blocks, h, p, ng), m)
            out[f"{side}_lo"] = ((num_blocks, h, p, ng), m)
        return out

    def views(self, buffer: torch.Tensor, num_blocks: int) -> dict[str, torch.Tensor]:
        """The six part views of a layer's flat uint8 ``buffer`` of at least ``num_blocks * page_bytes`` bytes."""
        flat = buffer.reshape(-1)
        if flat.dtype != torch.uint8:
            flat = flat.view(torch.uint8)
        if flat.numel() < num_blocks * self.page_bytes():
            raise ValueError(f"a KV buffer of {flat.numel()} bytes cannot hold {num_blocks} blocks of "
                             f"{self.page_bytes()} bytes")
        out, off = {}, 0
        sizes = self.part_bytes()
        for name, (shape, dtype) in self.shapes(num_blocks).items():
            n = num_blocks * sizes[name]
            out[name] = flat[off:off + n].view(dtype).view(shape)
            off += n
        return out

    def body(self, buffer: torch.Tensor, num_blocks: int) -> PagedBody:
        """The :class:`~rotkv.kernels.body.PagedBody` the kernels read, over ``buffer`` (no copy)."""
        v = self.views(buffer, num_blocks)
        return PagedBody(TokenPart(v["k_codes"], v["k_scale"], v["k_lo"], self.bits[0], self.group_size, self.head_dim),
                         TokenPart(v["v_codes"], v["v_scale"], v["v_lo"], self.bits[1], self.group_size, self.head_dim))


def group_page_bytes(layouts) -> int:
    """The page size every layer of one vLLM KV-cache group reports: the largest layer's."""
    return max(layout.page_bytes() for layout in layouts)


def blocks_in(buffer: torch.Tensor, page_bytes: int) -> int:
    """Blocks a layer's KV tensor holds at ``page_bytes`` per block."""
    n = buffer.numel() * buffer.element_size()
    if n % page_bytes:
        raise ValueError(f"a KV tensor of {n} bytes is not a whole number of {page_bytes}-byte blocks")
    return n // page_bytes
