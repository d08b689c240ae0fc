"""Fused quantize-on-write (Triton): ``(x - mu) R`` -> clip -> per-group INT2/INT4 -> planar pack -> pool.

:func:`quant_write` runs the CUDA kernel of ``rotkv.kernels.cuda_write`` instead where that one
covers the call (the default backend, "auto").

One program takes ``BLOCK_T`` tokens of one KV head and does everything in registers:
the rotation is a ``tl.dot`` in 3xTF32 (near-fp32; the reference rotates in fp32), the
clipping threshold is the ``r``-th largest ``|x|`` of the row found by ``r`` max-and-remove
rounds that count ties (so it equals ``kthvalue``), the metadata is rounded to fp16 the way
``rotkv.quant.quantizer`` does it (lo down, scale up, by one fp16 ulp when round-to-nearest
went the wrong way), codes use IEEE division and round-half-even, exactly as the reference.
The width (2 or 4 bits) and the group size are the body part's (``rotkv.kernels.body``); the
packing is ``rotkv.quant.packing``'s planar one (byte ``j`` holds dims ``j + i * D/per``).
Bytes: reads ``T*H*D`` inputs, writes ``T*H*(D*bits/8 + 4*D/G)``.

:func:`flush_pages` is the vLLM backend's graphed flush on the same quantization: keys and values of whole
pages in one launch, each token read at its side-pool slot, a page bound for block 0 skipped, and a refine
tier's bits (``rotkv.quant.refine``) written beside the codes.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from rotkv.kernels.body import TokenPart
from rotkv.kernels.plan import plan_write, require_part

_RNE = tl.constexpr(12582912.0)  # 1.5 * 2**23: (y + _RNE) - _RNE rounds |y| < 2**22 to nearest-even in fp32


def clip_rank(ratio: float, head_dim: int) -> int:
    """The clip threshold is the ``r``-th largest ``|x|`` of a row (1-based); 0 = no clipping."""
    if ratio >= 1.0:
        return 0
    if not 0.0 < ratio:
        raise ValueError(f"clip ratio must be in (0, 1], got {ratio}")
    return head_dim - int(ratio * head_dim)


@triton.jit
def _fp16_step(h, up: tl.constexpr):
    """fp16 ``h`` moved one ulp toward +inf (up) or -inf, through its bits."""
    b = h.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    f = h.to(tl.float32)
    if up:
        nb = tl.where(f >= 0, b + 1, b - 1)
        nb = tl.where(b == 0x8000, 1, nb)
    else:
        nb = tl.where(f > 0, b - 1, b + 1)
        nb = tl.where(f == 0, 0x8001, nb)
    return nb.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _fp8_round(x, up: tl.constexpr):
    """float32 ``x`` -> e4m3fn, rounded towards +inf (``up``) or -inf, as ``rotkv.quant.quantizer.
    _round_dir`` does: returns ``(byte, value)``, the code as int32 (sign bit 128) and its float32 value.

    Integer arithmetic only: no float8 type is touched. Triton's own float32 -> e4m3 conversion,
    stored from a [BLOCK_T, NG] tile, scrambled the bytes on a GPU (rows 8-15 of every 16 held other
    rows' codes: ``test_fp8_rounding_steps_every_way``; docs/kernel-notes.md), and its interpreter does
    not carry a rounded-up mantissa into the exponent (1.96 -> 1.0). Here the code is the magnitude's
    top 3 mantissa bits below its exponent (normal: ``(e + 7) << 3 | m``; below 2^-6, ``floor(|x| *
    512)``, which meets the normal codes at 8), plus one where a remainder was cut and the rounding
    goes away from zero; past 448 (or inf/NaN) the code is 127, e4m3fn's NaN: the caller's check raises
    (the reference raises), as it did for a saturated conversion."""
    bits = x.to(tl.int32, bitcast=True)
    neg = bits < 0  # the sign bit: -0.0 stays -0.0 (byte 128), as the conversion keeps it
    abits = bits & 0x7FFFFFFF
    e = (abits >> 23) - 127
    small = abits < 0x3C800000  # |x| < 2^-6: e4m3's subnormals, multiples of 2^-9
    s = tl.abs(x) * 512.0  # exact where it is used: a power-of-two scale of a value below 2^-6
    sf = tl.floor(s)
    code = tl.where(small, sf.to(tl.int32), ((e + 7) << 3) | ((abits >> 20) & 7))
    cut = tl.where(small, s != sf, (abits & 0xFFFFF) != 0)
    away = (~neg) if up else neg
    code = tl.where(cut & away, code + 1, code)
    code = tl.where(small, code, tl.where((e > 8) | (code > 126), 127, code))
    val = tl.where(code < 8, code.to(tl.float32) * 0.001953125,
                   ((((code >> 3) + 120) << 23) | ((code & 7) << 20)).to(tl.float32, bitcast=True))
    return code | tl.where(neg, 128, 0), tl.where(neg, -val, val)


@triton.jit
def _quantize_store(x, offs_t, tmask, h, H, slot_ptr, codes_ptr, scale_ptr, lo_ptr, D: tl.constexpr, G: tl.constexpr,
                    P: tl.constexpr, CLIP_R: tl.constexpr, BITS: tl.constexpr, META_FP8: tl.constexpr,
                    BLOCK_T: tl.constexpr, ring_ptr=None, ring_off=None, REFINE: tl.constexpr = False):
    """Clip, quantize and pack the float32 rows ``x [BLOCK_T, D]`` of head ``h`` (tokens ``offs_t``, valid where
    ``tmask``) and store them at their slots (``slot_ptr``, indexed by ``offs_t``) of the part's pools. ``REFINE``
    (2-bit): also each row's refinement (``rotkv.quant.refine.refine_codes`` of the unclipped row against its
    2-bit reading ``code * scale + lo``), packed 2-bit, at ``ring_ptr + ring_off`` (``[BLOCK_T]`` int64 offsets
    of the rows' ``D / 4`` ring bytes)."""
    NG: tl.constexpr = D // G
    PER: tl.constexpr = 8 // BITS  # codes per byte (planes)
    Q4: tl.constexpr = D // PER  # bytes per row
    LEVELS: tl.constexpr = (1 << BITS) - 1
    exact = x
    if CLIP_R > 0:
        # r-th largest |x| with ties counted: take the max, count and drop its copies, r times
        a = tl.abs(x)
        t = tl.zeros([BLOCK_T], tl.float32)
        removed = tl.zeros([BLOCK_T], tl.int32)
        for _ in tl.static_range(CLIP_R):
            m = tl.max(a, axis=1)
            hit = a == m[:, None]
            t = tl.where(removed < CLIP_R, m, t)
            removed += tl.sum(hit.to(tl.int32), axis=1)
            a = tl.where(hit, -1.0, a)
        x = tl.minimum(tl.maximum(x, -t[:, None]), t[:, None])
    xg = tl.reshape(x, [BLOCK_T, NG, G])
    lo = tl.min(xg, axis=2)
    hi = tl.max(xg, axis=2)
    if META_FP8:  # bytes (the launcher passes uint8 views of e4m3 scale and lo)
        lom, lof = _fp8_round(lo, False)
        sm, sf = _fp8_round(tl.div_rn(hi - lof, LEVELS * 1.0), True)
        lom, sm = lom.to(tl.uint8), (sm & 127).to(tl.uint8)  # hi - lo >= 0: the sign bit goes (-0 - -0 can be -0)
    else:
        lom = lo.to(tl.float16)
        lom = tl.where(lom.to(tl.float32) > lo, _fp16_step(lom, False), lom)
        lof = lom.to(tl.float32)
        sc = tl.div_rn(hi - lof, LEVELS * 1.0)
        sm = sc.to(tl.float16)
        sm = tl.where(sm.to(tl.float32) < sc, _fp16_step(sm, True), sm)
        sf = sm.to(tl.float32)
    safe = tl.where(sf > 0, sf, 1.0)
    y = tl.div_rn(xg - lof[:, :, None], safe[:, :, None])
    c = (y + _RNE) - _RNE
    c = tl.minimum(tl.maximum(c, 0.0), LEVELS * 1.0)
    if REFINE:  # j = round((x - (c s + lo)) / s * 4 + 1.5) clamped to 0..3, as refine_codes (s 0: 1)
        base = c * sf[:, :, None]
        base = base + lof[:, :, None]
        jv = tl.div_rn(tl.reshape(exact, [BLOCK_T, NG, G]) - base, safe[:, :, None]) * 4.0 + 1.5
        j = tl.minimum(tl.maximum((jv + _RNE) - _RNE, 0.0), 3.0).to(tl.int32)
        j = tl.reshape(j, [BLOCK_T, 4, D // 4])
        jpacked = tl.sum(j * (1 << (2 * tl.arange(0, 4)))[None, :, None], axis=1).to(tl.uint8)
        tl.store(ring_ptr + ring_off[:, None] + tl.arange(0, D // 4)[None, :], jpacked, mask=tmask[:, None])
    c = c.to(tl.int32)
    # planar pack: byte j = sum_i code[i * D/PER + j] << (BITS * i)
    c = tl.reshape(c, [BLOCK_T, PER, Q4])
    w = 1 << (BITS * tl.arange(0, PER))
    packed = tl.sum(c * w[None, :, None], axis=1).to(tl.uint8)
    # store
    slot = tl.load(slot_ptr + offs_t, mask=tmask, other=0)
    page, off = slot // P, slot % P
    row = (page * H + h) * P + off  # int64 row of the [NP * H * P, ...] views
    offs_q = tl.arange(0, Q4)
    tl.store(codes_ptr + row[:, None] * Q4 + offs_q[None, :], packed, mask=tmask[:, None])
    offs_g = tl.arange(0, NG)
    mptr = row[:, None] * NG + offs_g[None, :]
    tl.store(scale_ptr + mptr, sm, mask=tmask[:, None])
    tl.store(lo_ptr + mptr, lom, mask=tmask[:, None])


@triton.jit
def _quant_write_kernel(
    x_ptr, stride_xt, stride_xh,  # x [T, H, D], last dim contiguous
    rot_ptr, mean_ptr,  # [H, D, D] fp32, [H, D] fp32 (used if ROTATE / HAS_MEAN)
    slot_ptr,  # [T] int64: page * P + offset
    codes_ptr, scale_ptr, lo_ptr,  # [NP, H, P, D*BITS/8] uint8, [NP, H, P, NG] fp16 (e4m3 if META_FP8)
    T, H,
    D: tl.constexpr, G: tl.constexpr, P: tl.constexpr, CLIP_R: tl.constexpr,
    ROTATE: tl.constexpr, HAS_MEAN: tl.constexpr, KC: tl.constexpr, BLOCK_T: tl.constexpr,
    BITS: tl.constexpr, ROT_TF32X3: tl.constexpr, META_FP8: tl.constexpr,
):
    pid_t, h = tl.program_id(0), tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = offs_t < T
    offs_d = tl.arange(0, D)
    rows = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt + h.to(tl.int64) * stride_xh
    if ROTATE:
        x = tl.zeros([BLOCK_T, D], tl.float32)
        for k0 in tl.static_range(0, D, KC):
            offs_k = k0 + tl.arange(0, KC)
            xk = tl.load(rows + offs_k[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
            if HAS_MEAN:
                xk = xk - tl.load(mean_ptr + h * D + offs_k)[None, :]
            r = tl.load(rot_ptr + h.to(tl.int64) * D * D + offs_k[:, None] * D + offs_d[None, :])
            if ROT_TF32X3:
                x = tl.dot(xk, r, x, input_precision="tf32x3")
            else:  # one TF32 pass: codes may differ from the fp32 reference at rounding ties
                x = tl.dot(xk, r, x, input_precision="tf32")
    else:
        x = tl.load(rows + offs_d[None, :], mask=tmask[:, None], other=0.0).to(tl.float32)
        if HAS_MEAN:
            x = x - tl.load(mean_ptr + h * D + offs_d)[None, :]
    _quantize_store(x, offs_t, tmask, h, H, slot_ptr, codes_ptr, scale_ptr, lo_ptr, D, G, P, CLIP_R, BITS, META_FP8,
                    BLOCK_T)


@triton.jit
def _flush_side(side_ptr, s0, s1, s2, page_ptr, off_ptr, slot_ptr, codes_ptr, scale_ptr, lo_ptr, r, h, H,
                ring_ptr, ring_row_ptr, ring_index_ptr, RK,
                D: tl.constexpr, G: tl.constexpr, P: tl.constexpr, CLIP_R: tl.constexpr, BITS: tl.constexpr,
                META_FP8: tl.constexpr, REFINE: tl.constexpr):
    """Page ``r`` (tokens ``r * P ..``) of one side, head ``h``: each token read at its side-pool page and slot;
    ``REFINE``: its refinements into slot ``ring_index[r] % RK`` of ring row ``ring_row[r]`` (``[rows, RK, H, P,
    D / 4]``)."""
    offs_i = tl.arange(0, P)
    offs_t = r * P + offs_i
    page = tl.load(page_ptr + offs_t).to(tl.int64)
    off = tl.load(off_ptr + offs_t).to(tl.int64)
    rows = side_ptr + page * s0 + h.to(tl.int64) * s1 + off * s2
    x = tl.load(rows[:, None] + tl.arange(0, D)[None, :]).to(tl.float32)
    ring_off = offs_i.to(tl.int64)
    if REFINE:
        slot = tl.load(ring_row_ptr + r).to(tl.int64) * RK + tl.load(ring_index_ptr + r).to(tl.int64) % RK
        ring_off = ((slot * H + h) * P + offs_i) * (D // 4)
    _quantize_store(x, offs_t, offs_t >= 0, h, H, slot_ptr, codes_ptr, scale_ptr, lo_ptr, D, G, P, CLIP_R, BITS,
                    META_FP8, P, ring_ptr, ring_off, REFINE)


@triton.jit
def _flush_kernel(k_ptr, ks0, ks1, ks2, v_ptr, vs0, vs1, vs2, page_ptr, off_ptr, slot_ptr, block_ptr,
                  kc_ptr, ksc_ptr, klo_ptr, vc_ptr, vsc_ptr, vlo_ptr, H, rk_ptr, rv_ptr, ring_row_ptr, ring_index_ptr,
                  RK, D: tl.constexpr, P: tl.constexpr, G_K: tl.constexpr, CLIP_K: tl.constexpr, BITS_K: tl.constexpr,
                  FP8_K: tl.constexpr, G_V: tl.constexpr, CLIP_V: tl.constexpr, BITS_V: tl.constexpr,
                  FP8_V: tl.constexpr, SKIP_NULL: tl.constexpr, REFINE_K: tl.constexpr, REFINE_V: tl.constexpr):
    """One page of one head per program: programs ``(r, h)`` with ``h < H`` quantize key page ``r``, the others
    value page ``r`` (head ``h - H``); with ``SKIP_NULL`` a page bound for block 0 (none) is not written."""
    r, hh = tl.program_id(0), tl.program_id(1)
    live = True
    if SKIP_NULL:
        live = tl.load(block_ptr + r) != 0
    if live:
        if hh < H:
            _flush_side(k_ptr, ks0, ks1, ks2, page_ptr, off_ptr, slot_ptr, kc_ptr, ksc_ptr, klo_ptr, r, hh, H,
                        rk_ptr, ring_row_ptr, ring_index_ptr, RK, D, G_K, P, CLIP_K, BITS_K, FP8_K, REFINE_K)
        else:
            _flush_side(v_ptr, vs0, vs1, vs2, page_ptr, off_ptr, slot_ptr, vc_ptr, vsc_ptr, vlo_ptr, r, hh - H, H,
                        rv_ptr, ring_row_ptr, ring_index_ptr, RK, D, G_V, P, CLIP_V, BITS_V, FP8_V, REFINE_V)


def check_part(x: torch.Tensor, part: TokenPart) -> None:
    """A ValueError unless the write kernels can store ``x [T, H, D]`` into ``part``: a token
    part of a kernel width (``rotkv.quant.widths``) with fp16 or e4m3 metadata (``rotkv.kernels.plan.part_reason``),
    over x's heads and dims."""
    if not isinstance(part, TokenPart):
        raise TypeError(f"the write kernels store into a TokenPart, got {type(part).__name__}")
    require_part(part, x.device)
    if x.dim() != 3 or x.shape[1:] != (part.codes.shape[1], part.head_dim):
        raise ValueError(f"x {tuple(x.shape)} does not fit the part ({part.codes.shape[1]} heads, head_dim "
                         f"{part.head_dim})")


def quant_write(x: torch.Tensor, slots: torch.Tensor, part: TokenPart,
                rot: torch.Tensor | None = None, mean: torch.Tensor | None = None, clip: float = 1.0,
                block_t: int = 32, num_warps: int | None = None, rot_precision: str | None = None,
                backend: str | None = None) -> None:
    """Quantize ``x [T, H, D]`` into the body part ``part`` at ``slots [T]``; see the module docstring.

    part: a :class:`~rotkv.kernels.body.TokenPart` of 2 or 4 bits with fp16 or e4m3 metadata (e4m3:
    this Triton kernel, on sm_89+ GPUs); rot
    ``[H, D, D]``, mean ``[H, D]`` (any float dtype; used in fp32).

    The kernel is the write plan's (:func:`rotkv.kernels.plan.plan_write`). backend: "auto"
    (default, or ``ROTKV_WRITE_BACKEND``): the CUDA kernel (``rotkv.kernels.cuda_write``) for a
    rotating or clipping write where it covers the call (where it is the faster one),
    else this Triton kernel; "cuda" raises where it does not cover the call. num_warps: None picks
    the default (Triton 4; CUDA 4 with "bf16x2", 8 with "bf16" where the shared memory
    allows). rot_precision (None: near-fp32 on either backend): "tf32x3" or "tf32" (one pass,
    faster, codes may differ from the fp32 reference near rounding boundaries) on Triton; "bf16x2"
    (R as two bf16 parts, near fp32) or "bf16" (one bf16 MMA) on CUDA. docs/kernels.md has the
    measurements.
    """
    check_part(x, part)
    wp = plan_write(x, part, rot is not None, clip, backend, rot_precision, num_warps)
    if wp.kernel == "cuda":
        from rotkv.kernels import cuda_write

        cuda_write.launch(x, slots, part, rot, mean, clip_rank(clip, x.shape[-1]), wp.rot_precision, wp.num_warps)
        return
    rot_precision, num_warps = wp.rot_precision, wp.num_warps
    t, h, d = x.shape
    if t == 0:
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    rot = None if rot is None else rot.float().contiguous()
    mean = None if mean is None else mean.float().contiguous()
    dummy = part.codes  # never read when the matching flag is off
    fp8 = part.meta == torch.float8_e4m3fn
    meta = _meta(part)
    grid = (triton.cdiv(t, block_t), h)
    _quant_write_kernel[grid](
        x, x.stride(0), x.stride(1), rot if rot is not None else dummy, mean if mean is not None else dummy,
        slots.to(device=x.device, dtype=torch.int64), part.codes, *meta, t, h,
        D=d, G=part.group_size, P=part.codes.shape[2], CLIP_R=clip_rank(clip, d), ROTATE=rot is not None,
        HAS_MEAN=mean is not None, KC=min(d, 64), BLOCK_T=block_t, BITS=part.bits,
        ROT_TF32X3=rot_precision == "tf32x3", META_FP8=fp8, num_warps=num_warps,
    )


def _meta(part: TokenPart) -> tuple[torch.Tensor, torch.Tensor]:
    """The part's scale and lo as the kernels store them (uint8 views of e4m3 metadata)."""
    if part.meta == torch.float8_e4m3fn:
        return part.scale.view(torch.uint8), part.lo.view(torch.uint8)
    return part.scale, part.lo


def flush_pages(side_k: torch.Tensor, side_v: torch.Tensor, page: torch.Tensor, off: torch.Tensor,
                slots: torch.Tensor, blocks: torch.Tensor, part_k: TokenPart, part_v: TokenPart,
                clip_k: float = 1.0, clip_v: float = 1.0, skip_null: bool = True, rings: tuple = (None, None),
                ring_target: tuple | None = None) -> None:
    """Quantize ``n`` pages of the bf16 side pools (``side_k``, ``side_v`` ``[pages, H, P, D]``) into the body
    parts, keys and values in one launch. Token ``i`` of page ``r`` is read at side-pool page ``page[r * P + i]``
    and slot ``off[r * P + i]`` and written at body slot ``slots[r * P + i]`` (int64 ``[n * P]`` each); page
    ``r`` goes to body block ``blocks[r]``, and with ``skip_null`` a page whose block is 0 (vLLM's null block: a
    row with nothing to flush this step) is not written. The same bytes as :func:`quant_write` of the gathered
    pages (the graphed decode step's flush without its gathers, ``rotkv.integrations.vllm.graph``). ``rings``:
    the (key, value) refine rings (``uint8 [rows, K, H, P, D / 4]``, ``rotkv.cache.refine.RefineRing.data``) or
    None per side: page ``r``'s refinements go to slot ``index[r] % K`` of ring row ``rows[r]``, ``ring_target =
    (rows, index)`` (int64 ``[n]``), where ``RefineRings.write`` puts them."""
    h, p, d = side_k.shape[1:]
    n = blocks.shape[0]
    for side, part in ((side_k, part_k), (side_v, part_v)):
        if side.dim() != 4 or side.shape[1:] != (h, p, d) or side.stride(-1) != 1:
            raise ValueError(f"flush_pages: the side pools have to be [pages, {h}, {p}, {d}] with a contiguous "
                             f"last dim, got {tuple(side.shape)}")
        check_part(side[0].transpose(0, 1), part)
        if part.codes.shape[2] != p or not all(t.is_contiguous() for t in part.tensors):
            raise ValueError(f"flush_pages: a body part of {part.codes.shape[2]}-token pages (contiguous) for "
                             f"{p}-token side pages")
    for name, t in (("page", page), ("off", off), ("slots", slots)):
        if t.shape != (n * p,) or t.dtype != torch.int64 or t.device != side_k.device:
            raise ValueError(f"flush_pages: {name} has to be int64 [{n * p}] on {side_k.device}")
    rk = next((r.shape[1] for r in rings if r is not None), 1)
    for name, ring, part in zip(("key", "value"), rings, (part_k, part_v)):
        if ring is None:
            continue
        if ring.dtype != torch.uint8 or ring.dim() != 5 or ring.shape[1:] != (rk, h, p, d // 4) \
                or not ring.is_contiguous() or part.bits != 2:
            raise ValueError(f"flush_pages: the {name} ring has to be a contiguous uint8 [rows, {rk}, {h}, {p}, "
                             f"{d // 4}] beside a 2-bit part, got {tuple(ring.shape)} ({part.bits}-bit part)")
        if ring_target is None or any(t.shape != (n,) or t.dtype != torch.int64 for t in ring_target):
            raise ValueError(f"flush_pages: the rings need ring_target (rows, index), int64 [{n}] each")
    if n == 0:
        return
    ks, vs = side_k.stride(), side_v.stride()
    dummy = part_k.codes
    rrow, rindex = ring_target if ring_target is not None else (blocks, blocks)
    _flush_kernel[(n, 2 * h)](
        side_k, ks[0], ks[1], ks[2], side_v, vs[0], vs[1], vs[2], page, off, slots, blocks,
        part_k.codes, *_meta(part_k), part_v.codes, *_meta(part_v), h,
        rings[0] if rings[0] is not None else dummy, rings[1] if rings[1] is not None else dummy, rrow, rindex, rk,
        D=d, P=p, G_K=part_k.group_size, CLIP_K=clip_rank(clip_k, d), BITS_K=part_k.bits,
        FP8_K=part_k.meta == torch.float8_e4m3fn, G_V=part_v.group_size, CLIP_V=clip_rank(clip_v, d),
        BITS_V=part_v.bits, FP8_V=part_v.meta == torch.float8_e4m3fn, SKIP_NULL=skip_null,
        REFINE_K=rings[0] is not None, REFINE_V=rings[1] is not None, num_warps=4)
