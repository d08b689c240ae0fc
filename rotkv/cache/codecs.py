"""Block codecs: how one page of tokens of the quantized body is encoded.

A block batch is ``[nb, kv_heads, P, D]`` (nb pages of P tokens). ``encode`` returns a dict of
tensors that all have the leading page dimension, so pages can be concatenated and sliced;
``decode`` inverts it to float32 ``[nb, kv_heads, P, D]``.
"""

from __future__ import annotations

import torch

from rotkv.kernels import backend as kernels
from rotkv.quant.grid import check_grid, dequantize_grid, quantize_grid
from rotkv.quant.outliers import merge_outliers, split_outliers
from rotkv.quant.packing import pack
from rotkv.quant.quantizer import QuantizedRows, check_group, dequantize, meta_dtype, quantize
from rotkv.quant.vq import decode_pq, encode_pq


class TokenCodec:
    """Per-token groups: each token's head vector is clipped, then quantized in groups of G dims."""

    def __init__(self, bits: int, group_size: int, clip: float = 1.0, meta: str | None = None):
        self.bits, self.group_size, self.clip, self.meta = bits, group_size, clip, meta

    @property
    def default_meta(self) -> bool:
        """The metadata dtype the kernels read (fp16 at 2 and 4 bits)."""
        return self.meta is None or self.meta == "float16" and self.bits <= 4

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        check_group(self.group_size, x.shape[-1])
        if self.default_meta:
            fast = kernels.token_encode(x, self.bits, self.group_size, self.clip)  # CUDA: Triton, same bytes
            if fast is not None:
                return fast
        q = quantize(x, self.bits, self.group_size, self.clip, self.meta)
        return {"codes": q.codes, "scale": q.scale, "lo": q.lo}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return dequantize(QuantizedRows(parts["codes"], parts["scale"], parts["lo"], self.bits, self.group_size))

    def empty_parts(self, kv_heads: int, page: int, head_dim: int, device=None) -> dict[str, torch.Tensor]:
        """Zero-page parts with :meth:`encode`'s shapes and dtypes (``codes [0, H, P, D * bits / 8]``
        uint8, ``scale, lo [0, H, P, D / G]``), made without encoding anything."""
        check_group(self.group_size, head_dim)
        width = pack(torch.zeros(1, head_dim, dtype=torch.uint8), self.bits).shape[-1]
        meta = meta_dtype(self.bits, self.meta)
        groups = (0, kv_heads, page, head_dim // self.group_size)
        return {"codes": torch.zeros(0, kv_heads, page, width, dtype=torch.uint8, device=device),
                "scale": torch.zeros(groups, dtype=meta, device=device), "lo": torch.zeros(groups, dtype=meta, device=device)}


class ChannelCodec:
    """KIVI keys: per channel, over the P tokens of a page (one group per channel and page)."""

    def __init__(self, bits: int):
        self.bits = bits

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        xt = x.transpose(-1, -2)  # [nb, H, D, P]: quantize each channel's P tokens as one group
        q = quantize(xt, self.bits, xt.shape[-1])
        return {"codes": q.codes.contiguous(), "scale": q.scale, "lo": q.lo}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        p = parts["codes"].shape[-1] * 8 // self.bits
        q = QuantizedRows(parts["codes"], parts["scale"], parts["lo"], self.bits, p)
        return dequantize(q).transpose(-1, -2)


class SparseTokenCodec:
    """Dense-and-sparse (KVQuant): the ``count`` largest-magnitude entries of each page and KV head in an fp16
    side table (``ovals`` fp16, ``oidx`` int16 flat positions), the rest zeroed there and quantized by the
    token codec. The side table is a part of the page, so the pools count its bytes. PyTorch path only."""

    def __init__(self, bits: int, group_size: int, clip: float, meta: str | None, count: int):
        self.dense = TokenCodec(bits, group_size, clip, meta)
        self.bits, self.group_size, self.clip, self.meta, self.count = bits, group_size, clip, meta, count

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        dense, vals, idx = split_outliers(x, self.count)
        q = quantize(dense, self.bits, self.group_size, self.clip, self.meta)
        return {"codes": q.codes, "scale": q.scale, "lo": q.lo, "ovals": vals, "oidx": idx}

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return merge_outliers(self.dense.decode(parts), parts["ovals"], parts["oidx"])


class GridTokenCodec:
    """Per-token groups with a non-uniform grid per KV head (``grid [H, 2^b]`` in units of the group's range,
    fitted at calibration: rotkv.quant.grid.lloyd_max); the bytes per token are the uniform codec's. PyTorch
    path only."""

    def __init__(self, bits: int, group_size: int, clip: float, meta: str | None, grid: torch.Tensor):
        check_grid(grid, bits)
        self.bits, self.group_size, self.clip, self.meta, self.grid = bits, group_size, clip, meta, grid.float()

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return quantize_grid(x, self.grid, self.bits, self.group_size, self.clip, self.meta)

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return dequantize_grid(parts, self.grid, self.bits, self.group_size)


class PQCodec:
    """Product-quantized rows (rotkv.quant.vq): per row an fp16 RMS scale and one uint8 centroid index per
    sub-vector of a per-KV-head calibrated codebook ``[H, K, m]``, after a calibrated per-coordinate scale
    ``sigma [H, D]``. PyTorch path only."""

    def __init__(self, codebook: torch.Tensor, sigma: torch.Tensor):
        self.codebook, self.sigma = codebook.float(), sigma.float()

    @property
    def table_bytes(self) -> int:
        """The codebook and sigma in fp16 (what a deployment stores once per layer)."""
        return (self.codebook.numel() + self.sigma.numel()) * 2

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return encode_pq(x, self.codebook, self.sigma)

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return decode_pq(parts, self.codebook, self.sigma)


def make_codecs(codec: str, bits: int, group_size: int, clip_k: float, clip_v: float, key_bits: int | None = None,
                meta_k: str | None = None, meta_v: str | None = None):
    """(key codec, value codec) for a CacheSpec codec name. ``key_bits``: the keys' own width (a
    per-layer ``k_bits`` entry); keys at a width other than ``bits`` are not clipped."""
    if codec == "token":
        kb = bits if key_bits is None else key_bits
        return (TokenCodec(kb, group_size, clip_k if kb == bits else 1.0, meta_k),
                TokenCodec(bits, group_size, clip_v, meta_v))
    if codec == "kivi":
        return ChannelCodec(bits), TokenCodec(bits, group_size, 1.0)
    raise ValueError(f"`codec` has to be one of ['token', 'kivi'] but got {codec!r}")


def fixed_codecs(spec, width, group_size: int, clip_k: float, clip_v: float):
    """(key codec, value codec) of a fixed-width layer of ``spec`` whose widths ``width`` resolved
    (:class:`rotkv.cache.widths.LayerWidth`): the token codec at ``width.key`` / ``width.value`` bits (keys
    unclipped where ``width.clip_key`` is False), or the spec's other codec at ``spec.bits``."""
    if spec.codec == "token":
        return (TokenCodec(width.key, group_size, clip_k if width.clip_key else 1.0, spec.meta_k),
                TokenCodec(width.value, group_size, clip_v, spec.meta_v))
    return make_codecs(spec.codec, spec.bits, group_size, clip_k, clip_v)


def with_key_table(spec, artifact, layer: int, codecs):
    """``codecs`` with the key codec of ``layer`` replaced by ``spec.k_table``'s calibrated format (from the
    artifact's ``k_grid`` or ``pq_book``/``pq_sigma``) where the layer's keys are at ``spec.bits``."""
    if spec.k_table is None or codecs is None:
        return codecs
    kc, vc = codecs
    if kc.bits != spec.bits:
        return codecs
    names = {"grid": ("k_grid",), "pq": ("pq_book", "pq_sigma")}[spec.k_table]
    missing = [n for n in names if artifact is None or n not in artifact.tensors]
    if missing:
        raise ValueError(f"`k_table`={spec.k_table!r} needs the artifact tensors {missing}; make them with "
                         f"`python studies/key_tables.py --table {spec.k_table} --base-artifact A --out B`")
    t = [artifact.tensors[n][layer] for n in names]
    if spec.k_table == "grid":
        return GridTokenCodec(kc.bits, kc.group_size, kc.clip, kc.meta, t[0]), vc
    return PQCodec(t[0], t[1]), vc
