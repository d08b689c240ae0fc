"""Which kernel runs a call: decided once per shape and configuration, then looked up.

flashinfer's split: ``plan()`` sees the shapes, dtypes and configuration and picks the kernel;
the call only runs it. Every decision of whether a kernel covers a call lives here, and the
switches that pick kernels (``rotkv.switches``) are read here only:

- :func:`plan_decode`: the decode attention of one step (``rotkv.kernels.decode``): the CUDA body
  kernel, the Triton v1 / v2 body kernels, or none (the caller runs its PyTorch reference), from the
  body's layout (widths, metadata dtypes, page size), the query's heads, head dim and device, the
  config, the refine tier and the switches; used by the cache layer, its CUDA graph (which captures
  the plan's kernel) and the benchmarks. :func:`plan_step` is the cache's: None where it runs PyTorch.
  :func:`plan_refine_split`: whether a call over a refined body splits its pages between the kernel
  that reads the refine tier and the plan's body kernel (``rotkv.kernels.refine_split``);
- :func:`plan_write`: the quantize-on-write kernel (``rotkv.kernels.write``): CUDA or Triton;
- :func:`plan_pools`, :func:`plan_encode`: which of a layer's pools' writes and
  reads run kernels; :func:`plan_rotate`, :func:`rotation_math`: how a rotation is computed;
  :func:`check_graph`: whether a CUDA-graph decode can run a cache;
- :func:`decode_builds_for` / :func:`write_builds_for`: the CUDA builds the default plans run at
  one attention shape, without a GPU (``rotkv build-kernels``, ``rotkv.kernels.prebuild``).

Plans are cached per (body layout, query heads, device, configuration, refine tier): a decode step
looks one up in a dict; the cache is dropped when the switches change. The widths come from
``rotkv.quant.widths``; nothing here needs triton (:func:`have_triton` only asks whether it is there).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass

import torch

from rotkv import switches
from rotkv.kernels.body import BodyLayout, PagedBody, TokenPart
from rotkv.kernels.decode_config import DecodeConfig
from rotkv.quant.widths import CUDA_DECODE_KEY_WIDTHS, CUDA_DECODE_WIDTHS, KERNEL_WIDTHS

CUDA_HEAD_DIMS = (64, 128, 256)  # the CUDA kernels' instantiations
CUDA_MIN_CAPABILITY = (8, 0)  # mma.sync int8 m16n8k32, movmatrix, redux.sync, bf16 mma.sync
MAX_CUDA_REP = 8  # the CUDA decode kernel's GQA group


def interpreting() -> bool:
    """Triton runs under its interpreter (``TRITON_INTERPRET``, the CPU tests)."""
    return switches.get().triton_interpret


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def device_capability(device: torch.device | str) -> tuple[int, int] | None:
    """A CUDA device's compute capability, None elsewhere (the interpreter has no limits)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


FP8_MIN_CAPABILITY = (8, 9)  # Triton's e4m3 (fp8e4nv) conversions


def _device_key(t: torch.Tensor) -> tuple:
    """(device type, index, compute capability, interpreting): a plan's device part."""
    if t.is_cuda:
        index = t.get_device()
        return "cuda", index, _capability(index), interpreting()
    return t.device.type, None, (0, 0), interpreting()


_SEEN: list = [None]  # the switches the cached plans were made under


def _switches() -> switches.Switches:
    """The switches; the cached plans are dropped when they changed (``rotkv.switches`` configure,
    override, reload)."""
    sw = switches.get()
    if sw is not _SEEN[0]:
        clear_plans()
        _SEEN[0] = sw
    return sw


@functools.lru_cache(maxsize=1)
def have_triton() -> bool:
    """triton is installed (the ``kernels`` extra)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernels_enabled(t: torch.Tensor) -> bool:
    """The cache runs the GPU kernels for tensors on ``t``'s device: CUDA, triton installed, and the
    ``ROTKV_KERNELS`` switch on; elsewhere it runs its PyTorch reference code."""
    return t.is_cuda and switches.get().kernels and have_triton()


def decode_config(score: str | None = None) -> DecodeConfig:
    """The cache's decode config: ``ROTKV_DECODE_BACKEND``, the score (``score``, else the
    ``decode_score`` switch) and the ``ROTKV_TUNING`` knobs; one object per switches and score."""
    return _switches().decode_config(score)


# ---- rotation ------------------------------------------------------------------------------------
def rotation_math(x: torch.Tensor, dtype: torch.dtype | None) -> str:
    """``"bf16x2"`` or ``"fp32"``: how ``x`` is rotated into a result of ``dtype`` (None: float32).
    The ``rotation_math`` switch: "auto" (bf16x2 for bf16 CUDA tensors into bf16, else fp32), "fp32"
    (always float32), "bf16x2" (also on the CPU: the tests of the GPU arithmetic)."""
    how = switches.get().rotation_math
    if how == "fp32" or dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or x.dim() != 4:
        return "fp32"
    return "bf16x2" if (x.is_cuda or how == "bf16x2") else "fp32"


def rotate_block(d: int) -> int | None:
    """The rotation kernel's K and E block: the largest of 64, 32, 16 that divides ``d`` (tl.dot
    needs >= 16), or None."""
    return next((s for s in (64, 32, 16) if d % s == 0), None)


def rotate_reason(x: torch.Tensor, a: torch.Tensor) -> str | None:
    """Why the rotation kernel (``rotkv.kernels.rotate``) cannot take ``x`` with the split matrix
    ``a`` (None: it can)."""
    if x.dtype != torch.bfloat16 or a.dtype != torch.bfloat16:
        return "bf16 inputs only"
    if x.dim() != 4 or a.dim() != 3:
        return "x has to be [B, Hq, T, D] and a [H, K, D]"
    d = x.shape[-1]
    if rotate_block(d) is None:
        return f"head_dim {d} is not a multiple of 16"
    if a.shape[2] != d or a.shape[1] not in (2 * d, 2 * d + 8):
        return f"a {tuple(a.shape)} is not a split matrix for head_dim {d}"
    if x.shape[1] % a.shape[0]:
        return f"{x.shape[1]} heads do not split into {a.shape[0]} groups"
    if x.stride(-1) != 1:
        return "x's last dim is not contiguous"
    return None


def require_rotate(x: torch.Tensor, a: torch.Tensor) -> None:
    """A ValueError unless the rotation kernel takes ``x`` with ``a`` (its callers' contract)."""
    why = rotate_reason(x, a)
    if why is not None:
        raise ValueError(f"rotate_bf16x2: {why}")


def plan_rotate(x: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether the bf16x2 rotation of ``x`` by ``a`` runs the rotation kernel: on CUDA, with the
    kernels on, in a shape it takes (else the PyTorch bf16x2 GEMMs)."""
    return kernels_enabled(x) and rotate_reason(x, a) is None


# ---- the prefill's log-sum-exp merge ------------------------------------------------------------
def lse_merge_reason(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> str | None:
    """Why the merge kernel (``rotkv.kernels.lse_merge``) cannot take these outputs and log-sum-exps (None: it
    can)."""
    if o1.dim() != 4 or o1.shape != o2.shape:
        return "o1 and o2 have to be [B, Hq, C, D] of one shape"
    if l1.shape != (*o1.shape[:3], 1) or l2.shape != l1.shape or l1.dtype != torch.float32 or l2.dtype != l1.dtype:
        return "l1 and l2 have to be [B, Hq, C, 1] float32"
    if o1.stride(-1) != 1 or o2.stride(-1) != 1:
        return "the outputs' last dim is not contiguous"
    if o1.shape[-1] > 256:
        return f"head_dim {o1.shape[-1]} > 256"
    return None


def plan_lse_merge(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> bool:
    """Whether a prefill's two attention outputs merge in the kernel (on CUDA with the kernels on, in a shape it
    takes), else in PyTorch."""
    return kernels_enabled(o1) and lse_merge_reason(o1, l1, o2, l2) is None


def resolve_score(cfg: DecodeConfig, head_dim: int) -> str:
    """The score variant a call runs: ``cfg.score``, or for "auto" bf16 at head_dim <= 64 and int8
    above."""
    if cfg.score != "auto":
        return cfg.score
    return "bf16" if head_dim <= 64 else "int8"


def resolve_fuse(cfg: DecodeConfig, head_dim: int) -> str:
    """The CUDA kernel's partial merging a call runs: ``cfg.cuda_fuse``, or for "auto" "none" at
    head_dim <= 64 and "block" above."""
    if cfg.cuda_fuse != "auto":
        return cfg.cuda_fuse
    return "none" if head_dim <= 64 else "block"


def min_blocks(cfg: DecodeConfig, d: int, ng: int, key_bits: int = 2) -> int:
    """4 blocks of 4 warps per SM (128 registers) where that does not spill (nvcc -Xptxas -v); the INT4-key
    build (``key_bits`` 4) holds twice the key words, and at head_dim 128 with 2 groups (4) takes 3 (2)."""
    if cfg.cuda_min_blocks is not None:
        return cfg.cuda_min_blocks
    if key_bits == 4 and d == 128 and ng >= 2:
        return 3 if ng == 2 else 2
    if d <= 128 and ng <= 2:
        return 4
    return 3 if d <= 128 else 2


# the CUDA variant's entries past cuda_variant's nine (rotkv.kernels.cuda_decode.VARIANT_MACROS)
VARIANT_REFINE, VARIANT_K4 = 9, 10


def cuda_variant(cfg: DecodeConfig, d: int, ng: int, score: str | None = None,
                 value_meta: torch.dtype = torch.float16, key_bits: int = 2) -> tuple[int, ...]:
    """The CUDA kernel build a call runs: (head_dim, groups, tiles, min blocks, prefetch, fp16 values,
    value flush, fp16 query, e4m3 value metadata); prefetch as cfg.cuda_prefetch, except at head_dim
    256 with 8 groups, where the second buffer spills; fp16 query (cfg.cuda_score_f16) where the score
    is "bf16" (``score`` None: :func:`resolve_score`), else 0 (int8 query); the last 1 where the
    values' metadata is e4m3 (``value_meta``). INT4 keys (``key_bits`` 4): two more entries, reads the
    refine tier 0 and INT4 keys 1 (the ROTKV_K4 build)."""
    score = score or resolve_score(cfg, d)
    variant = (d, ng, cfg.cuda_tiles, min_blocks(cfg, d, ng, key_bits),
               int(cfg.cuda_prefetch and not (d >= 256 and ng >= 8)), int(cfg.cuda_value_f16), cfg.cuda_value_flush,
               cfg.cuda_score_f16 if score == "bf16" else 0, int(value_meta == torch.float8_e4m3fn))
    return (*variant, 0, 1) if key_bits == 4 else variant


def variant_key_bits(variant: tuple) -> int:
    """The key width a CUDA build ``variant`` reads: 4 for the ROTKV_K4 build, else 2."""
    return 4 if len(variant) > VARIANT_K4 and variant[VARIANT_K4] else 2


# (head_dim, groups, key bits) -> the most blocks per SM of the build that reads the refine tier: it holds the
# rings' words beside the prefetch buffer, and at the plain build's register bound these builds spill (nvcc
# -Xptxas -v, sm_90; tests/kernels/test_cuda_build.py compiles each)
REFINE_MAX_BLOCKS = {(128, 1, 2): 3, (128, 2, 2): 3, (128, 4, 2): 2, (128, 1, 4): 3}


def with_refine(variant: tuple, cfg: DecodeConfig | None = None) -> tuple:
    """The build ``variant`` that reads the refine tier (ROTKV_REFINE), with at most :data:`REFINE_MAX_BLOCKS`
    blocks per SM, unless ``cfg`` sets ``cuda_min_blocks``."""
    minb = variant[3]
    if cfg is None or cfg.cuda_min_blocks is None:
        minb = min(minb, REFINE_MAX_BLOCKS.get((variant[0], variant[1], variant_key_bits(variant)), minb))
    return (*variant[:3], minb, *variant[4:VARIANT_REFINE], 1, *variant[VARIANT_REFINE + 1:])


def shape_reason(head_dim: int, group_size: int) -> str | None:
    """Why the CUDA kernels (decode and write) do not cover this head_dim / group size, or None."""
    if head_dim not in CUDA_HEAD_DIMS:
        return f"head_dim {head_dim} not in {CUDA_HEAD_DIMS}"
    if group_size % 32:
        return f"group_size {group_size} is not a multiple of 32"
    return None


# ---- coverage: pure functions of a layout (no tensors, no GPU) -----------------------------------
def part_reason(bits: int, meta: torch.dtype, fmt: str = "token",
                capability: tuple[int, int] | None = None) -> str | None:
    """Why the Triton kernels (write, dequant, decode) do not read a body part, or None: token parts
    of a kernel width with fp16 or e4m3 metadata (e4m3 on a GPU of compute capability 8.9+:
    ``capability``, None off CUDA). The CUDA kernels read fp16 metadata only (their own reasons)."""
    if fmt != "token":
        return f"the kernels read token parts, not {fmt}"
    if bits not in KERNEL_WIDTHS:
        return f"the kernels read widths {list(KERNEL_WIDTHS)}, got {bits}"
    if meta not in (torch.float16, torch.float8_e4m3fn):
        return f"the kernels read fp16 or e4m3 metadata, got {meta}"
    if meta == torch.float8_e4m3fn and capability is not None:
        if not switches.get().fp8_kernels:
            return "e4m3 metadata in the GPU kernels is off (ROTKV_TUNING fp8_kernels=0)"
        if capability < FP8_MIN_CAPABILITY:
            return f"e4m3 metadata needs compute capability 8.9+, this GPU has {capability[0]}.{capability[1]}"
    return None


def dequant_reason(part, capability: tuple[int, int] | None = None) -> str | None:
    """Why the dequant kernel (``rotkv.kernels.dequant``) does not read a body part, or None: a token part the
    Triton kernels read (:func:`part_reason`), or a channel part (KIVI keys) of a kernel width with fp16
    metadata, power-of-two pages of at least 8 tokens and a power-of-two head_dim."""
    if part.format != "channel":
        return part_reason(part.bits, part.meta, part.format, capability)
    p, d = part.page_size, part.head_dim
    if part.bits not in KERNEL_WIDTHS:
        return f"the dequant kernel reads widths {list(KERNEL_WIDTHS)}, got {part.bits}"
    if part.meta != torch.float16:
        return f"the channel dequant kernel reads fp16 metadata, got {part.meta}"
    if p < 8 or p & (p - 1) or d & (d - 1):
        return f"the channel dequant kernel needs power-of-two pages of 8+ tokens and head_dim, got {p} and {d}"
    return None


def triton_decode_reason(layout: BodyLayout, capability: tuple[int, int] | None = None) -> str | None:
    """Why the Triton decode kernels do not read this body, or None."""
    for name, b, meta, fmt in zip("KV", layout.bits, layout.metas, layout.formats):
        why = part_reason(b, meta, fmt, capability)
        if why:
            return f"{name}: {why}"
    gk, gv = layout.group_sizes
    if gk != gv:
        return f"K and V must share the group size (got {gk} and {gv})"
    if 4 * gk < layout.head_dim:  # a head quarter (one 2-bit plane) lies inside one group
        return f"the Triton decode kernel needs group_size >= head_dim / 4 ({layout.head_dim // 4}), got {gk}"
    return None


def cuda_decode_reason(layout: BodyLayout, rep: int, score: str, capability: tuple[int, int] = (9, 0)) -> str | None:
    """Why the CUDA decode body kernel does not read this body, or None (nvcc and the build aside): INT2 K
    and V, or INT4 K and INT2 V (its ROTKV_K4 build) where the ``cuda_key4`` switch is on."""
    kb, vb = layout.bits
    if kb not in CUDA_DECODE_KEY_WIDTHS or vb not in CUDA_DECODE_WIDTHS or score not in ("int8", "bf16"):
        return (f"the CUDA decode kernel reads INT2 K and V with int8 or bf16 scores, got bits {layout.bits}, "
                f"score {score!r}")
    if kb not in CUDA_DECODE_WIDTHS and not switches.get().cuda_key4:
        return (f"the CUDA decode kernel reads INT2 K and V; its INT{kb}-key build is off (ROTKV_TUNING cuda_key4=1 "
                "turns it on)")
    if capability < CUDA_MIN_CAPABILITY:
        return "needs compute capability 8.0+ (mma.sync int8 m16n8k32, movmatrix)"
    gk, gv = layout.group_sizes
    # expected reasons, as the widths: the Triton kernel reads what this one does not
    if layout.metas[0] != torch.float16 or layout.metas[1] not in (torch.float16, torch.float8_e4m3fn):
        return (f"the CUDA decode kernel reads fp16 key metadata and fp16 or e4m3 value metadata, got "
                f"{layout.metas} (the Triton kernel runs)")
    if layout.metas[1] == torch.float8_e4m3fn and not switches.get().fp8_kernels:
        return "the CUDA decode kernel's e4m3 value metadata is off (ROTKV_TUNING fp8_kernels=0)"
    if gk != gv or any(f != "token" for f in layout.formats):
        return "K and V need token parts with one group size"
    why = shape_reason(layout.head_dim, gk)
    if why:
        return why
    if layout.page_size % 16:
        return f"page size {layout.page_size} is not a multiple of 16"
    if rep > MAX_CUDA_REP:
        return f"GQA group {rep} > {MAX_CUDA_REP}"
    if layout.num_pages * layout.kv_heads * layout.page_size >= 2**32:
        return "the pool has 2^32 or more token rows (the kernel indexes rows in 32 bits)"
    if not layout.aligned:
        return "body tensors must be contiguous and 16-byte aligned"
    return None


def require_part(part: TokenPart, device: torch.device | str) -> None:
    """A ValueError unless the Triton write and dequant kernels read ``part`` on ``device``
    (:func:`part_reason`)."""
    why = part_reason(part.bits, part.meta, part.format, device_capability(device))
    if why:
        raise ValueError(why)


def plan_encode(x: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether ``TokenCodec.encode`` of a page batch ``x [nb, H, P, D]`` runs the write kernel
    (``rotkv.kernels.backend.token_encode``): the kernels on for x's device, a kernel width with fp16
    metadata, and whole groups."""
    return (kernels_enabled(x) and part_reason(bits, torch.float16) is None and x.dim() == 4
            and x.shape[-1] % group_size == 0)


# ---- the cache's pools ---------------------------------------------------------------------------
@dataclass(frozen=True)
class PoolsPlan:
    """The kernels a layer's page pools run, decided when the pools are made: ``write[i]``: side i
    (keys, values) is flushed by the write kernel (else the codec's reference encoder); ``dequant``:
    dense reads of the body run the dequant kernel (else the PyTorch decoder)."""

    write: tuple[bool, bool]
    dequant: bool


def plan_pools(t: torch.Tensor, body: PagedBody | None) -> PoolsPlan:
    """The kernels of pools on ``t``'s device over the typed ``body`` (None: codecs the kernels do
    not read): the write kernel for a part the kernels read (:func:`part_reason`, at the device's compute
    capability), the dequant kernel where it reads both parts (:func:`dequant_reason`), with the kernels on
    for the device (:func:`kernels_enabled`)."""
    on = kernels_enabled(t)
    cap = device_capability(t.device) if on else None
    parts = body.parts if body is not None else (None, None)
    ok = tuple(on and body is not None and part_reason(pt.bits, pt.meta, pt.format, cap) is None for pt in parts)
    dequant = on and body is not None and all(dequant_reason(pt, cap) is None for pt in parts)
    return PoolsPlan(write=ok, dequant=dequant)


def refine_reason() -> str | None:
    """Why no decode kernel reads a refine tier now (the ``refine_kernel`` switch), or None."""
    if not _switches().refine_kernel:
        return "the refine tier's decode kernel is off (ROTKV_TUNING refine_kernel=0)"
    return None


def plan_step(q: torch.Tensor, body: PagedBody | None, cfg: DecodeConfig | None, readable: bool,
              refine: tuple[bool, bool] = (False, False), salient: bool = False) -> "DecodePlan | None":
    """The decode plan of one of the cache's decode steps with queries ``q [B, Hq, D]`` over ``body``,
    or None where the cache runs its PyTorch reader: the kernels off for q's device, a body no kernel
    reads (``readable`` False), salient pages (``rotkv.cache.salient``: no kernel reads them), or a plan
    that covers nothing (:func:`plan_decode`)."""
    if salient or not (readable and kernels_enabled(q)):
        return None
    p = plan_decode(q, body, cfg, refine)
    return p if p.covered else None


def check_graph(refine: bool, salient: bool = False) -> None:
    """A ValueError where a CUDA-graph decode cannot run a cache (it runs the decode kernels only);
    ``refine``: the cache has a refine tier; ``salient``: salient pages, which no decode kernel reads."""
    if salient:
        raise ValueError("CUDA-graph decode runs the decode kernels, and no decode kernel reads salient pages "
                         "(refine_salient): run without cuda_graph, or without refine_salient")
    why = refine_reason() if refine else None
    if why:
        raise ValueError(f"CUDA-graph decode runs the decode kernels, and {why}: turn it on, or run without cuda_graph")


_DEFAULT = DecodeConfig()


# ---- decode ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    """One way to run a decode call: the body kernel (``"cuda"`` or ``"triton"``), the knobs it runs
    with, and the variant switches the launcher passes on."""

    kernel: str
    cfg: DecodeConfig
    v2: bool = False  # Triton: the (plane, head)-row kernel
    qk_int8: bool = False  # Triton: int8 query . codes for the scores
    cuda_variant: tuple | None = None
    refine: bool = False  # CUDA: the kernel reads the refine tier itself (its ROTKV_REFINE build)

    @property
    def name(self) -> str:
        if self.kernel == "cuda":
            return f"cuda {self.cuda_variant}{' +refine' if self.refine else ''}"
        return f"triton {'v2' if self.v2 else 'v1'} n{self.cfg.block_n} w{self.cfg.num_warps}"


REST_KERNELS = ("cuda", "reference")


@dataclass(frozen=True)
class RefineSplit:
    """A decode call over a refined body split in two (``rotkv.kernels.refine_split``): ``refined`` (the
    Triton v1 kernel) reads each request's refined pages, ``rest`` the others: ``"cuda"`` (the CUDA body
    kernel, the plan's launch) or ``"reference"`` (the PyTorch reference,
    :func:`~rotkv.kernels.refine_split.rest_partials_reference`)."""

    rest: str
    refined: Launch

    def __post_init__(self):
        if self.rest not in REST_KERNELS:
            raise ValueError(f"RefineSplit.rest has to be one of {list(REST_KERNELS)} but got {self.rest!r}")


def cuda_refine_reason(variant: tuple) -> str | None:
    """Why the CUDA body kernel's build ``variant`` (:func:`cuda_variant`) cannot read the refine tier, or None:
    its merged 4-bit value codes need the fp16 value product (``cfg.cuda_value_f16``)."""
    if not variant[5]:
        return "the CUDA kernel reads the refine tier with the fp16 value product only (cuda_value_f16)"
    return None


# head dims whose refine builds the default ("auto") gives the refine tier: their builds keep the plain build's
# registers without spills; at head_dim 128 the default (prefetching) build spills and "auto" keeps the split.
# The INT4-key build reading the values' ring spills with 2 or more groups at head_dim 64: "auto" splits there.
AUTO_REFINE_HEAD_DIMS = (64,)


def cuda_reads_refine(variant: tuple, mode: str) -> bool:
    """Whether the CUDA body kernel's build ``variant`` reads a refine tier itself: its build can
    (:func:`cuda_refine_reason`) and ``mode`` (the ``refine_split`` switch) asks for it: "kernel" at every
    head_dim, "auto" (the default) at :data:`AUTO_REFINE_HEAD_DIMS` (the INT4-key build: with one group)."""
    if cuda_refine_reason(variant) is not None:
        return False
    auto = variant[0] in AUTO_REFINE_HEAD_DIMS and (variant_key_bits(variant) == 2 or variant[1] == 1)
    return mode == "kernel" or (mode == "auto" and auto)


def plan_refine_kernel(launch: Launch, mode: str) -> Launch | None:
    """The launch that reads a refined body in one CUDA launch, no split: ``launch`` (the plain plan's, over
    the body) reading the tier itself, where ``launch`` is the CUDA kernel and :func:`cuda_reads_refine`;
    else None."""
    if launch.kernel == "cuda" and cuda_reads_refine(launch.cuda_variant, mode):
        return dataclasses.replace(launch, refine=True, cuda_variant=with_refine(launch.cuda_variant, launch.cfg))
    return None


def plan_refine_split(launch: Launch, mode: str, refined: Launch) -> RefineSplit | None:
    """The split of a call over a refined body whose plain plan runs ``launch`` over the body, or None
    (``refined``, the v1 kernel, reads every page, or the CUDA kernel reads them all itself:
    :func:`plan_refine_kernel`): ``mode``, the ``refine_split`` switch: "1" splits where ``launch`` is the
    CUDA kernel, "kernel" and "auto" too where that kernel does not read the tier itself, "reference" always,
    "0" never."""
    if mode == "reference":
        return RefineSplit("reference", refined)
    if mode == "1" and launch.kernel == "cuda":
        return RefineSplit("cuda", refined)
    if mode in ("kernel", "auto") and launch.kernel == "cuda" and not cuda_reads_refine(launch.cuda_variant, mode):
        return RefineSplit("cuda", refined)
    if mode not in switches.REFINE_SPLITS:
        raise ValueError(f"the refine split mode has to be one of {list(switches.REFINE_SPLITS)} but got {mode!r}")
    return None


_CUDA_WARNED: set = set()


class DecodePlan:
    """The kernels of a decode call at one layout, query-head count, device and config.

    ``covered``: a kernel reads this body (else ``why`` says why not and the caller runs its
    reference). ``launch(work)`` is the launch for ``work = B * H_kv * max_len`` token-heads:
    ``small`` (Triton v2, ``cfg.small_*``) below ``cfg.small_work`` where the config lets the plan
    choose (backend "auto" on CUDA), else ``main``. ``main`` is the CUDA body kernel where it
    covers the call and builds, else Triton; the CUDA library is built (or loaded) the first time
    ``main`` is asked for, once per plan. ``refine`` (keys, values): the body has a refine tier on
    that side (``rotkv.cache.refine``); the Triton v1 body kernel reads it, so a call with body
    tokens runs that kernel (``refine_launch``), or none where the ``refine_kernel`` switch is off;
    or, where :meth:`refine_split` splits the call (the ``refine_split`` switch), that kernel reads
    the refined pages and ``launch`` is the one that reads the others; or, with ``refine_split=kernel`` (or
    ``auto``, the default, at its head dims) where the body kernel is the CUDA one (:func:`plan_refine_kernel`),
    that kernel reads every page, the refined ones with their tier, in one launch (``launch(work).refine``).
    """

    def __init__(self, layout: BodyLayout | None, hq: int, head_dim: int, device: tuple, cfg: DecodeConfig,
                 refine: tuple[bool, bool] = (False, False)):
        dev_type, index, capability, interp = device
        self.layout, self.hq, self.head_dim, self.device, self.cfg = layout, hq, head_dim, device, cfg
        self.score = resolve_score(cfg, head_dim)
        on_cuda = dev_type == "cuda"
        if cfg.backend == "cuda" and not on_cuda:
            raise ValueError("backend='cuda' needs CUDA tensors")
        if layout is None:  # the tier alone
            self.rep, self.triton_why, self.cuda_why, self.cuda_expected = hq, None, "no body", True
        else:
            if layout.head_dim != head_dim:
                raise ValueError(f"the body's head_dim {layout.head_dim} is not the query's {head_dim}")
            if hq % layout.kv_heads:
                raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({layout.kv_heads})")
            self.rep = hq // layout.kv_heads
            self.triton_why = triton_decode_reason(layout, capability if on_cuda and not interp else None)
            # expected reasons (the config or the device): no warning; the others are warned about once
            self.cuda_expected = True
            if cfg.backend == "triton":
                self.cuda_why = "backend='triton'"
            elif interp or not on_cuda:
                self.cuda_why = "not on CUDA"
            else:
                self.cuda_why = cuda_decode_reason(layout, self.rep, self.score, capability)
                self.cuda_expected = (self.cuda_why is not None
                                      and self.cuda_why.startswith("the CUDA decode kernel reads"))
                if self.cuda_why is None and _nvcc_path() is None:
                    self.cuda_why = "nvcc not found"
            if cfg.backend == "cuda" and self.cuda_why:
                if self.cuda_expected:
                    raise ValueError(self.cuda_why)
                raise ValueError(f"the CUDA INT2 decode kernel cannot run here: {self.cuda_why}")
        self.covered = self.triton_why is None or self.cuda_why is None
        self.why = None if self.covered else self.triton_why
        p = layout.page_size if layout is not None else 16
        self.small = None
        self.small_below = 0
        if (cfg.backend == "auto" and layout is not None and on_cuda and self.triton_why is None):
            small = dataclasses.replace(cfg, backend="triton", v2=True, block_n=cfg.small_block_n,
                                        num_warps=cfg.small_num_warps)
            self.small, self.small_below = self._triton(small, p), cfg.small_work
        self._main: Launch | None = None
        self._refine_main: Launch | None = None  # main reading the refine tier (plan_refine_kernel)
        self._tier = self._triton(cfg, p)  # no body tokens: the tier kernel alone
        self.refine = tuple(refine) if layout is not None else (False, False)
        self.refine_launch: Launch | None = None
        self.split_mode = "0"
        if any(self.refine):
            why = refine_reason() or self.triton_why
            if why is not None:
                self.covered, self.why = False, why
            else:
                self.refine_launch = self._triton(dataclasses.replace(cfg.for_bits(self.bits), v2=False), p)
                self.split_mode = _switches().refine_split

    @property
    def bits(self) -> tuple[int, int]:
        return self.layout.bits if self.layout is not None else (2, 2)

    def _triton(self, cfg: DecodeConfig, page_size: int) -> Launch:
        bits = self.layout.bits if self.layout is not None else (2, 2)
        # v2 reads a page in power-of-2 chunks, INT2 only; INT4 K or V runs v1
        v2 = cfg.v2 and page_size & (page_size - 1) == 0 and bits == (2, 2)
        qk_int8 = self.score == "int8" and cfg.qk_int8 and (self.head_dim >= 128 or v2)
        return Launch("triton", cfg, v2, qk_int8)

    @property
    def main(self) -> Launch:
        if self._main is None:
            self._main = self._resolve_main()
        return self._main

    def _resolve_main(self) -> Launch:
        cfg, layout = self.cfg, self.layout
        p = layout.page_size if layout is not None else 16
        why = self.cuda_why
        if why is None:
            variant = cuda_variant(cfg, self.head_dim, self.head_dim // layout.group_sizes[0], self.score,
                                   layout.metas[1], layout.bits[0])
            try:
                from rotkv.kernels import cuda_decode

                cuda_decode.build(torch.device("cuda", self.device[1]), variant)
                return Launch("cuda", cfg, cuda_variant=variant)
            except RuntimeError as e:
                why = str(e)
                if cfg.backend == "cuda":
                    raise ValueError(f"the CUDA INT2 decode kernel cannot run here: {why}") from e
        if self.triton_why is not None:
            raise ValueError(self.triton_why if why is None or self.cuda_expected else f"{self.triton_why} ({why})")
        if layout is not None and not self.cuda_expected and why not in _CUDA_WARNED:
            _CUDA_WARNED.add(why)
            warnings.warn(f"rotkv: CUDA INT2 decode kernel not used ({why}); using the Triton kernel", stacklevel=5)
        return self._triton(cfg.for_bits(self.bits), p)

    def launch(self, work: int) -> Launch:
        """The launch for a call over ``work`` token-heads of body (``B * H_kv * max_len``): with a
        refine tier the one that reads it (the CUDA kernel itself where :func:`plan_refine_kernel` says so,
        else v1), unless the call splits (:meth:`refine_split`): then the one that reads the unrefined pages."""
        if work > 0 and self.refine_launch is not None:
            plain = self._plain(work)
            if plain.kernel == "cuda":  # plain is main (the one CUDA launch)
                if self._refine_main is None:
                    self._refine_main = plan_refine_kernel(plain, self.split_mode) or plain
                if self._refine_main.refine:
                    return self._refine_main
            if self.refine_split(work) is None:
                return self.refine_launch
        return self._plain(work)

    def _plain(self, work: int) -> Launch:
        """The launch without a refine tier."""
        if self.small is not None and work < self.small_below:
            return self.small
        return self.main if work > 0 else self._tier

    def refine_split(self, work: int) -> RefineSplit | None:
        """The split of a call over ``work`` token-heads of a refined body, or None (no refine tier, no
        body tokens, or the v1 kernel reads every page): :func:`plan_refine_split` of the launch that
        the body would run without the tier."""
        if work <= 0 or self.refine_launch is None or self.split_mode == "0":
            return None
        return plan_refine_split(self._plain(work), self.split_mode, self.refine_launch)

    def describe(self) -> str:
        """One line: what runs (the CUDA kernel named as planned, before its first build)."""
        if not self.covered:
            return f"reference (no kernel: {self.why})"
        if self.refine_launch is not None:
            if self.split_mode == "reference":
                return f"{self.refine_launch.name} over the refined pages, the PyTorch reference over the others"
            if self.split_mode == "1":
                return (f"{self.refine_launch.name} (reads the refine tier; over the refined pages only where the "
                        "body kernel is CUDA, which reads the others)")
            if self.split_mode in ("kernel", "auto"):
                where = "" if self.split_mode == "kernel" else f" at head_dim {'/'.join(map(str, AUTO_REFINE_HEAD_DIMS))}"
                return (f"{self.refine_launch.name} (reads the refine tier) where the body kernel is not CUDA; the "
                        f"CUDA kernel reads the tier itself{where} where its build can (the fp16 value product), else "
                        "over the unrefined pages beside v1")
            return f"{self.refine_launch.name} (reads the refine tier)"
        if self._main is not None:
            main = self._main.name
        elif self.cuda_why is None:
            lay = self.layout
            variant = cuda_variant(self.cfg, self.head_dim, self.head_dim // lay.group_sizes[0], self.score,
                                   lay.metas[1], lay.bits[0])
            main = f"cuda {variant}"
        else:
            main = f"{self._tier.name} ({self.cuda_why})"
        if self.small is not None:
            return f"{self.small.name} below {self.small_below} token-heads, else {main}"
        return main


def _nvcc_path():
    from rotkv.kernels.nvcc import nvcc_path

    return nvcc_path()


_DECODE_PLANS: dict = {}  # (id(layout), Hq, D, device, id(cfg), refine) -> (layout, cfg, plan)
_EQUAL: dict = {}  # (layout, Hq, D, device, cfg, refine) -> plan


def plan_decode(q: torch.Tensor, body: PagedBody | None, cfg: DecodeConfig | None = None,
                refine: tuple[bool, bool] = (False, False)) -> DecodePlan:
    """The decode plan of a call with query ``q [B, Hq, D]`` over ``body`` (None: the tier alone),
    ``refine``: which sides of the body have a refine tier (keys, values); everything else that
    decides is in the body's layout (widths, metadata dtypes), q's shape and device, the config and
    the switches. Cached per (body layout, Hq, D, device, config, refine); raises ValueError for a
    config the call cannot run (``backend="cuda"`` where the CUDA kernel does not cover it,
    mismatched heads)."""
    cfg = cfg or _DEFAULT
    layout = body.layout if body is not None else None
    refine = (bool(refine[0]), bool(refine[1]))
    _switches()
    # keyed by the layout's and the config's identity (hashing them costs more than the rest of the
    # lookup); the entry holds both, so their ids stay theirs while it lives
    key = (id(layout), q.shape[1], q.shape[-1], _device_key(q), id(cfg), refine)
    hit = _DECODE_PLANS.get(key)
    if hit is not None:
        return hit[2]
    # an equal layout and config seen before (another body of the same shape, an equal config object)
    eq_key = (layout, *key[1:4], cfg, refine)
    plan = _EQUAL.get(eq_key)
    if plan is None:
        plan = DecodePlan(layout, q.shape[1], q.shape[-1], key[3], cfg, refine)
    if len(_DECODE_PLANS) >= 4096:  # a long-lived process over many shapes: start over
        _DECODE_PLANS.clear(), _EQUAL.clear()
    _EQUAL[eq_key] = plan
    _DECODE_PLANS[key] = (layout, cfg, plan)
    return plan


def clear_plans() -> None:
    """Forget every cached plan (tests; a changed environment such as ROTKV_NVCC; changed switches)."""
    _DECODE_PLANS.clear()
    _EQUAL.clear()
    _write_plan.cache_clear()


# ---- write -------------------------------------------------------------------------------------
CUDA_PRECISIONS = ("bf16x2", "bf16")
TRITON_PRECISIONS = ("tf32x3", "tf32")
WRITE_BACKENDS = ("auto", "cuda", "triton")


@dataclass(frozen=True)
class WritePlan:
    """The write kernel of a call: ``kernel`` "cuda" or "triton", the rotation precision and warps."""

    kernel: str
    rot_precision: str
    num_warps: int


def cuda_write_reason(head_dim: int, group_size: int, dtype: torch.dtype, rotate: bool, rot_precision: str,
                      num_warps: int, capability: tuple[int, int] = (9, 0),
                      meta: torch.dtype = torch.float16) -> str | None:
    """Why the CUDA write kernel does not cover a write of this shape, or None (layout only: the
    input's strides and nvcc are checked by :func:`plan_write`)."""
    from rotkv.kernels import cuda_write

    if meta == torch.float8_e4m3fn:
        sw = switches.get()
        if not (sw.cuda_write_fp8 and sw.fp8_kernels):
            return ("the CUDA write kernel's e4m3 build is off (ROTKV_TUNING cuda_write_fp8=1 turns it on; "
                    "the Triton write stores e4m3 metadata)")
    elif meta != torch.float16:
        return f"the CUDA write kernel stores fp16 or e4m3 metadata, the part's is {meta}"
    if capability < CUDA_MIN_CAPABILITY:
        return "needs compute capability 8.0+ (redux.sync, bf16 mma.sync)"
    why = shape_reason(head_dim, group_size)
    if why:
        return why
    if dtype not in cuda_write.DTYPES or (rotate and dtype != torch.bfloat16):
        return f"input dtype {dtype} (bf16, or fp16/fp32 without rotation)"
    if rotate and rot_precision not in cuda_write.PRECISIONS:
        return f"rot_precision {rot_precision!r} is not one of {list(cuda_write.PRECISIONS)}"
    if rotate and cuda_write.smem(head_dim, cuda_write.PRECISIONS[rot_precision], num_warps) > cuda_write.SMEM_LIMIT:
        return f"R and the product tiles need more than {cuda_write.SMEM_LIMIT} bytes of shared memory"
    return None


def plan_write(x: torch.Tensor, part: TokenPart, rotate: bool, clip: float, backend: str | None = None,
               rot_precision: str | None = None, num_warps: int | None = None) -> WritePlan:
    """The write kernel that stores ``x [T, H, D]`` into ``part``; cached per shape and options.

    backend: "auto" (default, or ``ROTKV_WRITE_BACKEND``): the CUDA kernel for a rotating or
    clipping write where it covers the call (where it is the faster one: docs/kernel-notes.md), else Triton;
    "cuda" raises where it does not cover the call. Raises ValueError for options that contradict."""
    backend = backend or _switches().write_backend
    # what varies per call beyond the shape: the input's strides and alignment (the rotating kernel
    # reads bf16 pairs) and the pool's contiguity
    x_ok = x.stride(-1) == 1 and not (rotate and (x.stride(0) % 2 or x.stride(1) % 2 or x.data_ptr() % 4))
    part_ok = all(t.is_contiguous() for t in part.tensors)
    return _write_plan(x.shape[-1], part.group_size, x.dtype, _device_key(x), x_ok, part_ok, rotate, clip < 1.0,
                       backend, rot_precision, num_warps, part.meta)


def flush_reason(side: torch.Tensor, parts) -> str | None:
    """Why the one-launch flush of side-pool pages into the body (``rotkv.kernels.write.flush_pages``) does not
    take the side pools ``[pages, H, P, D]`` like ``side`` and the body ``parts`` (keys, values), or None. The
    caller checks that the kernels are on for the device (the graphed decode step's flush)."""
    if not all(isinstance(p, TokenPart) for p in parts):
        return "the body parts are not token parts"
    for name, part in zip("KV", parts):
        why = part_reason(part.bits, part.meta, part.format, device_capability(side.device))
        if why:
            return f"{name}: {why}"
    _, _, p, d = side.shape
    if p & (p - 1) or d & (d - 1) or p < 2:
        return f"pages of {p} tokens and head_dim {d}: the kernel takes powers of two"
    if _switches().write_backend == "cuda":
        return "the write backend is pinned to the CUDA kernel (ROTKV_WRITE_BACKEND=cuda)"
    if not _switches().graph_fusion:
        return "ROTKV_TUNING graph_fusion=0"
    return None


def plan_graph_rotations() -> bool:
    """Whether the graphed decode step rotates its queries, keys and values in one launch
    (``rotkv.kernels.rotate.rotate_many``; ``ROTKV_TUNING graph_fusion``), else one launch each."""
    return _switches().graph_fusion


def merge_rotates(rows: int, cfg: DecodeConfig) -> bool:
    """Whether the decode merge turns its ``rows`` query rows back by an output rotation itself (below
    ``cfg.merge_rotate_rows``: each program loads a slice of the matrix for one row), else the plain merge and
    one launch of ``rotkv.kernels.rotate.rotate_bf16x2`` after it (a program per head and 16 rows)."""
    return rows < cfg.merge_rotate_rows


def plan_flush(side: torch.Tensor, parts) -> bool:
    """Whether the graphed decode step flushes its pages with one launch of ``flush_pages`` (:func:`flush_reason`)."""
    return flush_reason(side, parts) is None


@functools.lru_cache(maxsize=4096)
def _write_plan(d, g, dtype, device, x_ok, part_ok, rotate, clipping, backend, rot_precision, num_warps,
                meta=torch.float16) -> WritePlan:
    from rotkv.kernels import cuda_write

    if backend not in WRITE_BACKENDS:
        raise ValueError(f"the write backend must be one of {list(WRITE_BACKENDS)}, got {backend!r}")
    if rot_precision is not None and rot_precision not in TRITON_PRECISIONS + CUDA_PRECISIONS:
        raise ValueError(f"rot_precision must be one of {list(TRITON_PRECISIONS + CUDA_PRECISIONS)}, "
                         f"got {rot_precision!r}")
    if backend == "triton" and rot_precision in CUDA_PRECISIONS:
        raise ValueError(f"rot_precision={rot_precision!r} is a CUDA option; the Triton kernel takes "
                         f"{list(TRITON_PRECISIONS)}")
    # the plain unclipped write is Triton's (the faster one there: docs/kernel-notes.md)
    wanted = backend == "cuda" or rot_precision in CUDA_PRECISIONS or (backend == "auto" and (rotate or clipping))
    if wanted and rot_precision not in TRITON_PRECISIONS:
        prec = rot_precision or "bf16x2"
        warps = num_warps or cuda_write.default_warps(d, prec, rotate)
        dev_type, _, capability, _ = device
        if dev_type != "cuda":
            why = "not on CUDA"
        else:
            why = cuda_write_reason(d, g, dtype, rotate, prec, warps, capability, meta)
            if why is None and not x_ok:
                why = "x must have a contiguous last dim (and even strides, 4-byte aligned, to rotate)"
            if why is None and not part_ok:
                why = "pool tensors must be contiguous"
            if why is None and _nvcc_path() is None:
                why = "nvcc not found"
        if why is None:
            return WritePlan("cuda", prec, warps)
        if backend == "cuda" or rot_precision in CUDA_PRECISIONS:
            what = "backend='cuda'" if backend == "cuda" else f"rot_precision={rot_precision!r}"
            raise ValueError(f"{what} needs the CUDA write kernel, which does not cover this call: {why}")
    elif backend == "cuda":
        raise ValueError(f"rot_precision={rot_precision!r} is a Triton option; the CUDA kernel takes "
                         f"{list(CUDA_PRECISIONS)}")
    return WritePlan("triton", rot_precision or "tf32x3", num_warps or 4)


# ---- ahead-of-time builds ------------------------------------------------------------------------
def decode_builds_for(head_dim: int, group_size: int, bits: int = 2, cfg: DecodeConfig | None = None,
                      value_meta: torch.dtype | None = None, refine: bool = False,
                      key_bits: int | None = None) -> tuple[tuple | None, str | None]:
    """(CUDA decode variant, None) where the default plan runs the CUDA body kernel for a body of
    this shape (page size 16, GQA group <= 8, on an sm_80+ GPU), else (None, a note on what runs).
    ``value_meta``: the values' metadata dtype (None: float16; e4m3 has its own build); ``refine``: the body
    has a refine tier, and the variant is the build that reads it where the ``refine_split`` switch has the
    CUDA kernel read it (:func:`cuda_reads_refine`; else the plain build, beside the Triton v1 kernel);
    ``key_bits``: the keys' width where it differs from ``bits`` (INT4 keys beside INT2 values: the ROTKV_K4
    build, with the ``cuda_key4`` switch on)."""
    cfg = cfg or DecodeConfig()
    value_meta = value_meta or torch.float16
    kb = bits if key_bits is None else key_bits
    layout = BodyLayout(head_dim, 1, 16, 1, (kb, bits), (group_size, group_size), (torch.float16, value_meta),
                        ("token", "token"), True, "cuda")
    score = resolve_score(cfg, head_dim)
    if bits not in CUDA_DECODE_WIDTHS or (kb != bits and kb not in CUDA_DECODE_KEY_WIDTHS):
        what = f"INT{bits} pages" if kb == bits else f"INT{kb} keys with INT{bits} values"
        return None, f"decode: {what} run the Triton kernel"
    why = cuda_decode_reason(layout, 1, score)
    if why:
        return None, f"decode: {why} (Triton runs)"
    variant = cuda_variant(cfg, head_dim, head_dim // group_size, score, value_meta, kb)
    if refine and cuda_reads_refine(variant, _switches().refine_split):
        variant = with_refine(variant, cfg)  # cuda_decode.VARIANT_MACROS: ROTKV_REFINE
    return variant, None


def write_builds_for(head_dim: int, group_size: int, rotate: bool = True,
                     rot_precision: str = "bf16x2") -> tuple[list[tuple[bool, str, int]], str | None]:
    """The CUDA write builds the default plan runs at this shape: ([(rotating, precision, warps)],
    None), or ([], a note) where Triton runs. ``rotate``: the preset rotates keys or values (the
    rotating variant runs as well as the plain one, which flushes tiers and clips)."""
    from rotkv.kernels import cuda_write

    why = shape_reason(head_dim, group_size)
    if why:
        return [], f"write: {why} (Triton runs)"
    out = []
    for rot in ((True, False) if rotate else (False,)):
        warps = cuda_write.default_warps(head_dim, rot_precision, rot)
        why = cuda_write_reason(head_dim, group_size, torch.bfloat16, rot, rot_precision, warps)
        if why is None:
            out.append((rot, rot_precision, warps))
    return out, None
