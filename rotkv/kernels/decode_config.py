"""The decode kernels' knobs (:class:`DecodeConfig`): plain values, no torch, so that the switches
(``rotkv.switches``) can check a tuning override before anything heavy loads.
:mod:`rotkv.kernels.plan` decides which kernel runs a call with them; docs/kernels.md has the
measurements behind the defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class DecodeConfig:
    """Tuning knobs of ``rotkv.kernels.decode.decode_attention`` (defaults chosen by
    ``benchmarks/bench_decode.py``)."""

    block_n: int = 64  # INT2 tokens per inner step
    block_t: int = 32  # bf16 tokens per inner step
    target_programs: int = 1024  # split so that B * H_kv * splits reaches about this many
    min_split_tokens: int = 256
    # a split call's refined pages (rotkv.kernels.refine_split: the v1 launch beside the body kernel, at most
    # the ring's pages a request) take splits of at least this many tokens, as the bf16 tier beside a body
    # takes 64, so that one program's serial loop over them does not outlast the body kernel
    refine_min_split_tokens: int = 64
    qk_int8: bool = True  # int8 query . codes for the scores; used when head_dim >= 128 (int8 MMA K >= 32)
    use_asm: bool | None = None  # None: inline PTX on a GPU, portable code under the interpreter
    num_warps: int = 1  # warps per program of the Triton body kernels
    num_stages: int = 2
    v2: bool = False  # the (plane, head)-row kernel `_int2_part_v2` (int8 scores at any head_dim)
    # INT2 body kernel: "cuda" (rotkv/kernels/cuda/int2_decode.cu, built with nvcc on first use),
    # "triton", or "auto" (CUDA where it is supported and builds, else Triton)
    backend: str = "auto"
    cuda_tiles: int = 1  # 16-token tiles per softmax step of the CUDA kernel
    cuda_min_blocks: int | None = None  # __launch_bounds__ min blocks of 4 warps per SM; None: 4 (128
    # registers) at head_dim <= 128 with <= 2 groups, 3 with more groups, 2 at head_dim 256
    # auto: bodies under this many token-heads (B * H_kv * max_len) take the Triton v2 kernel with
    # small_block_n-token blocks and small_num_warps warps (one launch fewer): the plan's "small"
    # launch (DecodePlan.small), chosen per call by the work
    small_work: int = 65536
    small_block_n: int = 128
    small_num_warps: int = 4
    cuda_target_warps: int = 2048  # CUDA kernel: split so that B * H_kv * splits reaches about this
    cuda_min_split_tokens: int = 64
    # CUDA kernel's partials: "none" (one per split, merged by the Triton merge kernel), "block" (the
    # 4 warps of a block, 4 splits of one request and KV head, merge theirs in shared memory: 4x
    # fewer partials for the merge kernel), or "all" (also the last block of each request and KV
    # head merges every partial and the tier's, launched first, into the output: no merge launch),
    # or "auto": "none" at head_dim <= 64, "block" above (docs/kernels.md)
    cuda_fuse: str = "auto"
    # CUDA kernel with a bf16 tier: the tier's launch on a second stream beside the body kernel (forked before it,
    # joined before the merge; in a captured graph, two parallel branches) instead of before it on the same stream
    tier_stream: bool = False
    # merge kernel: partial slots per step, and dims per program where B * Hq < 1024 (else all D)
    merge_chunk: int = 128
    merge_slice: int = 32
    # an output rotation (the graphed step's R_V^T) inside the merge below this many query rows (B * Hq): every
    # program of a row merges the whole row and loads its slice of the matrix; from here on the plain merge and
    # one rotation launch after it (a program per head and 16 rows, the matrix loaded once for them)
    merge_rotate_rows: int = 1024
    # a CUDA-graph step's body grid is sized for the capacity, not the rows' lengths: at most this many tokens
    # per split there, so that rows shorter than the capacity still spread over the GPU (past a row's pages a
    # split does nothing); the split rule alone would give a batch of 64 at 17K capacity 4 splits of 4352 tokens
    graph_split_tokens: int = 1024
    # CUDA kernel: two register buffers, the next step's loads issued before this step's math
    cuda_prefetch: bool = True
    # CUDA kernel: the value product in fp16 (0x6400 | code bits = 1024 + 4^i c, every plane in place,
    # one LOP3 per operand register, p * s_v by HMUL2) instead of bf16 (byte permutes, plane 3 shifted)
    cuda_value_f16: bool = True
    # CUDA kernel: every this many steps (a power of two) the value accumulators drop their
    # magic-number offset (0: only at the end). The tensor cores' truncation error grows with the
    # accumulators' size; the flush keeps the fp16 path's output error near the bf16 path's
    # (docs/kernels.md)
    cuda_value_flush: int = 8
    # scores of the quantized body: "int8" (query quantized to int8 per head: the CUDA kernel's
    # m16n8k32, and the Triton kernels where qk_int8 applies), "bf16" (query not quantized: Triton
    # with bf16 codes, the CUDA kernel with an fp16 query and exact 4^i c codes, m16n8k16), or
    # "auto": bf16 at head_dim <= 64 (where the int8 query loses the most top-1 agreement,
    # docs/kernels.md) and int8 above
    score: str = "auto"
    # CUDA kernel, score "bf16": how the exact code operand is made: 1 fp16 subnormals (one LOP3 per
    # register), 2 fp16 1024 + 4^i c minus 1024 (one LOP3 and one HSUB2)
    cuda_score_f16: int = 1
    # Triton v1 over a body with a 4-bit side (oscar-mix's INT4-key layers, which the CUDA kernel does
    # not read): its programs, warps and block; None: target_programs, num_warps, block_n (which are
    # tuned on INT2 bodies; studies/bench_mixed.py tunes these)
    wide_target_programs: int | None = 2048
    wide_num_warps: int | None = None
    wide_block_n: int | None = None

    def __post_init__(self):
        if self.backend not in ("auto", "cuda", "triton"):
            raise ValueError(f"backend must be 'auto', 'cuda' or 'triton', got {self.backend!r}")
        if self.score not in ("auto", "bf16", "int8"):
            raise ValueError(f"score must be 'auto', 'bf16' or 'int8', got {self.score!r}")
        if self.cuda_score_f16 not in (1, 2):
            raise ValueError(f"cuda_score_f16 must be 1 or 2, got {self.cuda_score_f16}")
        if self.cuda_fuse not in ("auto", "none", "block", "all"):
            raise ValueError(f"cuda_fuse must be 'auto', 'none', 'block' or 'all', got {self.cuda_fuse!r}")
        if not 0 <= self.cuda_value_flush <= 4096 or self.cuda_value_flush & (self.cuda_value_flush - 1):
            raise ValueError(f"cuda_value_flush must be 0 or a power of two up to 4096, got {self.cuda_value_flush}")
        if not 1 <= self.cuda_tiles <= 8:
            raise ValueError(f"cuda_tiles must be in 1..8, got {self.cuda_tiles}")
        if self.cuda_min_blocks is not None and not 1 <= self.cuda_min_blocks <= 8:
            raise ValueError(f"cuda_min_blocks must be None or in 1..8, got {self.cuda_min_blocks}")
        for name, v in (("merge_chunk", self.merge_chunk), ("merge_slice", self.merge_slice)):
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        for name in ("block_n", "block_t", "target_programs", "min_split_tokens", "cuda_target_warps",
                     "cuda_min_split_tokens", "small_block_n", "small_num_warps", "merge_rotate_rows",
                     "graph_split_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("wide_target_programs", "wide_num_warps", "wide_block_n"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be None or >= 1, got {v}")
        for name in ("block_n", "wide_block_n", "num_warps", "wide_num_warps"):
            v = getattr(self, name)
            if v is not None and v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")

    def for_bits(self, bits: tuple[int, int]) -> "DecodeConfig":
        """The config a Triton body launch over K/V widths ``bits`` runs: the ``wide_*`` knobs where a
        side is 4-bit and they are set, else this config."""
        if bits == (2, 2) or (self.wide_target_programs, self.wide_num_warps, self.wide_block_n) == (None,) * 3:
            return self
        pick = lambda wide, base: base if wide is None else wide  # noqa: E731
        return dataclasses.replace(self, target_programs=pick(self.wide_target_programs, self.target_programs),
                                   num_warps=pick(self.wide_num_warps, self.num_warps),
                                   block_n=pick(self.wide_block_n, self.block_n))


# the fields a tuning override may set (backend and score have their own switches), and their types
OPTIONAL_INT = ("cuda_min_blocks", "wide_target_programs", "wide_num_warps", "wide_block_n")
OPTIONAL_BOOL = ("use_asm",)
TUNABLE = tuple(f.name for f in dataclasses.fields(DecodeConfig) if f.name not in ("backend", "score"))
