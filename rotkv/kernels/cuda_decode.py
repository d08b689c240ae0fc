"""The CUDA INT2 decode body kernel (``cuda/int2_decode.cu``): build, load, launch.

The kernel is compiled with ``nvcc`` on first use (about 15 s) into
``$ROTKV_CACHE_DIR`` (default ``~/.cache/rotkv``), keyed by the source's hash and the GPU's
architecture, and loaded with ``ctypes``: no PyTorch extension build, no headers beyond CUDA's.
Where there is no ``nvcc``, no GPU of compute capability 8.0 or newer, or a shape it does not
cover, the decode plan (``rotkv.kernels.plan.plan_decode``) says why and runs the Triton body
kernel instead.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from rotkv.kernels import nvcc as nvcc_build
from rotkv.kernels.body import PagedBody, RefineTier, check_refine_tiers
from rotkv.quant.widths import CUDA_DECODE_KEY_WIDTHS, CUDA_DECODE_WIDTHS

SOURCE = Path(__file__).parent / "cuda" / "int2_decode.cu"
_nvcc = nvcc_build.nvcc_path
_arch = nvcc_build.arch
cache_dir = nvcc_build.cache_dir


VARIANT_MACROS = ("D", "NG", "TILES", "MINB", "PREFETCH", "VF16", "VFLUSH", "QF16", "VMETA8", "REFINE", "K4")


def build(device: torch.device | None = None, variant: tuple = (128, 2, 2, 4, 0)) -> ctypes.CDLL:
    """Compile (once per source, architecture and variant) and load one kernel instantiation.

    variant = (head_dim, groups per head, tiles per softmax step, min blocks per SM, prefetch 0/1,
    fp16 value product 0/1, steps between value-offset flushes or 0, fp16 query scores 0 (int8) / 1 / 2,
    e4m3 value metadata 0/1, reads the refine tier 0/1 (needs the fp16 value product), INT4 keys 0/1); missing
    trailing entries are 0.
    """
    device = device or torch.device("cuda", torch.cuda.current_device())
    return nvcc_build.load(SOURCE, "int2_decode", _macros(variant), device, True, _setup)


def _macros(variant: tuple) -> dict[str, int]:
    n = len(VARIANT_MACROS)
    return {f"ROTKV_{k}": int(v) for k, v in zip(VARIANT_MACROS, (*variant, *(0,) * n)[:n])}


def _compile_and_load(nvcc: str, arch: str, tag: str, key: str, variant: tuple) -> ctypes.CDLL:
    """nvcc the source into the cache unless it is there (rotkv.kernels.nvcc); load it (uncached in
    the process: build() is the entry point, this is the loader's own path for the tests)."""
    out = nvcc_build.compile_library(nvcc, SOURCE, "int2_decode", _macros(variant), arch, key, fast_math=True)
    lib = ctypes.CDLL(str(out))
    _setup(lib)
    return lib


def _setup(lib: ctypes.CDLL) -> None:
    fn = lib.rotkv_int2_decode
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_int] * 5 + [ctypes.c_void_p] * 13 + [ctypes.c_int] * 7
                   + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
                   + [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p])


MERGE_MAX_SLOTS = 512  # as in the source: the fused final merge keeps a weight per slot in shared memory
OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_COUNTERS: dict = {}
_KEEP: list = []  # counter buffers replaced by larger ones stay alive (a captured CUDA graph may hold them)


def merges_into(out: torch.Tensor | None, q: torch.Tensor, n_slots: int) -> bool:
    """Whether the fused final merge can write ``out`` for query ``q`` over ``n_slots`` partial slots."""
    return (out is not None and out.dtype in OUT_KINDS and out.is_contiguous() and out.shape == q.shape
            and n_slots <= MERGE_MAX_SLOTS)


def counters(device: torch.device, n: int) -> torch.Tensor:
    """Arrival counters of the fused merge, one per (request, KV head): zero between calls (the
    kernel's last block resets its own), one buffer per (device, stream) so that calls on two streams
    never share one."""
    stream = torch.cuda.current_stream(device)
    key = (device.index, stream.cuda_stream)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _KEEP.append(buf)
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def body_partials(q: torch.Tensor, body: PagedBody, table: tuple, o_part: torch.Tensor, m_part: torch.Tensor,
                  l_part: torch.Tensor, n_splits: int, tokens_per_split: int, qk_scale: float,
                  tiles: int = 2, min_blocks: int = 4, fuse: bool = False,
                  out: torch.Tensor | None = None, prefetch: bool = False, value_f16: bool = False,
                  value_flush: int = 0, score_f16: int = 0, refine: RefineTier | None = None,
                  refine_values: RefineTier | None = None) -> None:
    """Write partials ``[:, :, :n_splits]`` of ``o/m/l_part`` for the INT2 body.

    q ``[B, Hq, D]`` bf16 contiguous; ``tokens_per_split`` a multiple of ``16 * tiles``.
    ``prefetch``: the kernel variant that loads the next step while computing this one.
    ``value_f16``: the variant whose value product runs in fp16 with the codes in place (one LOP3 per
    operand register instead of the bf16 path's byte permutes). ``value_flush``: steps between the
    subtractions of the value accumulators' offset (0: once, at the end). ``score_f16``: 0 scores with
    the int8 query, 1 or 2 with the fp16 query (the source's ROTKV_QF16). The values' metadata dtype
    (fp16 or e4m3) picks the build (ROTKV_VMETA8), and so does the keys' width: INT2, or INT4 beside INT2
    values (ROTKV_K4; 4-bit keys have no refine ring).
    ``fuse``: ``n_splits`` is a multiple of 4 and the 4 splits of a block are merged into partial
    ``s // 4`` (so the body fills ``[:n_splits // 4]``); with ``out`` (``[B, Hq, D]`` contiguous,
    float32/bf16/fp16) the last block of each (request, KV head) also merges every partial slot, the
    ones past the body's included (written by an earlier launch: the tier), into ``out``.
    ``refine``, ``refine_values``: the refine tier's rings of the keys and of the values
    (:class:`~rotkv.kernels.body.RefineTier`, ``ring uint8 [B, pages, H, P, D/4]`` contiguous; both, where
    given, of one ``pages`` and ``every``): the kernel reads each request's refined pages with their 2 more
    bits (the build ROTKV_REFINE, with ``value_f16``), as the Triton v1 kernel does.
    """
    b_sz, hq, d = q.shape
    h, p, ng = body.kv_heads, body.page_size, body.k.groups
    vmeta8 = int(body.v.meta == torch.float8_e4m3fn)  # the values' e4m3 metadata (oscar-mix): its own build
    kbits = body.k.bits
    if kbits not in CUDA_DECODE_KEY_WIDTHS or body.v.bits not in CUDA_DECODE_WIDTHS:
        raise ValueError(f"the CUDA decode kernel reads INT2 or INT4 keys with INT2 values, got bits {body.bits}")
    rings, rk, re = _rings(q, body, refine, refine_values)
    if rings != (None, None) and not value_f16:
        raise ValueError("the CUDA kernel reads the refine tier with the fp16 value product only (value_f16=True)")
    lib = build(q.device, (d, ng, tiles, min_blocks, int(prefetch), int(value_f16), int(value_flush), int(score_f16),
                           vmeta8, int(rings != (None, None)), int(kbits == 4)))
    indptr, indices, last = (t.to(torch.int32).contiguous() for t in table)
    stream = torch.cuda.current_stream(q.device).cuda_stream
    if fuse and n_splits % 4:
        raise ValueError(f"fuse needs n_splits % 4 == 0, got {n_splits}")
    if out is not None and not (fuse and merges_into(out, q, o_part.shape[2])):
        raise ValueError(f"out needs fuse=True, a contiguous [B, Hq, D] float32/bf16/fp16 tensor and at most "
                         f"{MERGE_MAX_SLOTS} partial slots (got {o_part.shape[2]})")
    cnt = counters(q.device, b_sz * h) if out is not None else None
    rc = lib.rotkv_int2_decode(d, ng, tiles, min_blocks, kbits, q.data_ptr(), *(t.data_ptr() for t in body.tensors()),
                               indptr.data_ptr(), indices.data_ptr(), last.data_ptr(),
                               o_part.data_ptr(), m_part.data_ptr(), l_part.data_ptr(),
                               b_sz, h, hq, p, o_part.shape[2], n_splits, tokens_per_split, qk_scale,
                               int(fuse), cnt.data_ptr() if cnt is not None else None,
                               out.data_ptr() if out is not None else None,
                               OUT_KINDS[out.dtype] if out is not None else 0,
                               *(r.data_ptr() if r is not None else None for r in rings), rk, re, stream)
    if rc != 0:
        raise RuntimeError(f"rotkv_int2_decode failed with code {rc}")


def _rings(q: torch.Tensor, body: PagedBody, refine: RefineTier | None,
           refine_values: RefineTier | None) -> tuple[tuple, int, int]:
    """((key ring or None, value ring or None), pages, every as the kernel's RE >= 1), checked
    (:func:`~rotkv.kernels.body.check_refine_tiers`), and each ring on the query's device, contiguous and
    16-byte aligned (the kernel's vector loads)."""
    tiers = check_refine_tiers(refine, refine_values, q.shape[0], body)
    given = [t for t in tiers if t is not None]
    if not given:
        return (None, None), 1, 1
    for t in given:
        r = t.ring
        if r.device != q.device:
            raise ValueError(f"refine ring on {r.device}, the query on {q.device}")
        if not r.is_contiguous() or r.data_ptr() % 16:
            raise ValueError("the CUDA kernel reads contiguous, 16-byte aligned refine rings")
    return tuple(t.ring if t is not None else None for t in tiers), given[0].pages, max(given[0].every, 1)
