"""Split-K decode attention over INT2 pages plus a bf16 tier, merged by log-sum-exp (Triton).

K and V may each be INT4 instead (``K_BITS``, ``V_BITS``; the v1 body kernel, see
``_quarter_bf16``); the CUDA kernel (``cuda_decode``) serves INT2 K and V with int8 or bf16 scores, and
INT4 K with INT2 V in its ROTKV_K4 build (the ``cuda_key4`` switch).

Launch 1, grid ``(B * H_kv, n_int2_splits + n_tier_splits)``: a program takes one KV head of
one request and all ``n_rep`` query heads that read it (rows padded to ``HPAD >= 16`` for
``tl.dot``), and a contiguous token range: either of the INT2 body or of the bf16 tier. It
writes an unnormalized partial output, its running max and its sum (base-2 softmax).
Launch 2, grid ``(B * H_q,)``: merges the partials.

How the INT2 body is read without materializing K or V. Byte ``j`` of a row holds dims
``j + i*D/4`` (plane ``i`` = bits ``2i..2i+1``), so plane ``i`` dots against the query's
quarter ``i``; a plane lies inside one quantization group (``G >= D/4``). With
``x = c*s_g + lo_g`` per group:

- scores: ``q.k = sum_i s_g(i) * (q_i . c_i) + sum_i lo_g(i) * sum(q_i)``;
- output: ``sum_n p_n v_n[d] = sum_n (p_n s_n,g) c_n[d] + sum_n p_n lo_n,g``,
  so scale and lo leave the dot products: the tensor cores see only raw codes.

Codes enter the tensor cores either as bf16 ``128 + c`` (bit pattern ``0x4300 | c``: one
``prmt`` makes two of them, the ``+128`` is folded into the correction terms) or, for the
scores with ``QK_INT8``, as int8 ``c`` against a per-head int8 quantized query (exact int32
dots, scaled after). ``USE_ASM`` selects the inline-PTX unpack (4 codes per 32-bit op);
the portable shift-and-mask path runs under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rotkv.kernels.body import PagedBody, RefineTier, check_refine_tiers
from rotkv.kernels.plan import DecodeConfig, DecodePlan, merge_rotates, plan_decode, resolve_fuse  # noqa: F401 (DecodeConfig: re-exported)
from rotkv.kernels.plan import interpreting as _interpreting

LOG2E = 1.4426950408889634


@triton.jit
def _mma(x, F16: tl.constexpr):
    """Cast to the dot-operand type: bf16, or fp16 under the interpreter (its bf16 dot is wrong)."""
    if F16:
        return x.to(tl.float16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _field_bf16(byte, SHIFT: tl.constexpr, MASK: tl.constexpr, USE_ASM: tl.constexpr, F16: tl.constexpr):
    """uint8 tile -> bf16 ``128 + code`` of the bit field ``(byte >> SHIFT) & MASK`` (MASK 3 or 15)."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm=f"""{{
            .reg .b32 t, m;
            shr.b32 t, $2, {SHIFT};
            and.b32 t, t, {MASK * 0x01010101};
            mov.b32 m, 0x43434343;
            prmt.b32 $0, t, m, 0x5140;
            prmt.b32 $1, t, m, 0x7362;
            }}""",
            constraints="=r,=r,r", args=[byte], dtype=tl.bfloat16, is_pure=True, pack=4)
    else:
        return _mma(((byte >> SHIFT) & MASK).to(tl.float32) + 128.0, F16)


@triton.jit
def _field_i8(byte, SHIFT: tl.constexpr, MASK: tl.constexpr, USE_ASM: tl.constexpr):
    """uint8 tile -> int8 code ``(byte >> SHIFT) & MASK``."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            asm=f"""{{
            .reg .b32 t;
            shr.b32 t, $1, {SHIFT};
            and.b32 $0, t, {MASK * 0x01010101};
            }}""",
            constraints="=r,r", args=[byte], dtype=tl.int8, is_pure=True, pack=4)
    else:
        return ((byte >> SHIFT) & MASK).to(tl.int8)


@triton.jit
def _plane_bf16(byte, PLANE: tl.constexpr, USE_ASM: tl.constexpr, F16: tl.constexpr):
    """uint8 tile -> bf16 ``128 + code`` of 2-bit field ``PLANE``."""
    return _field_bf16(byte, 2 * PLANE, 3, USE_ASM, F16)


@triton.jit
def _plane_i8(byte, PLANE: tl.constexpr, USE_ASM: tl.constexpr):
    """uint8 tile -> int8 code of 2-bit field ``PLANE``."""
    return _field_i8(byte, 2 * PLANE, 3, USE_ASM)


@triton.jit
def _quarter_bf16(ca, cb, I: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr, F16: tl.constexpr):
    """Codes of dims ``[I*D/4, (I+1)*D/4)`` as bf16 ``128 + c`` from the row's byte tiles ``ca``
    (bytes ``[0, D/4)``) and ``cb`` (INT4: bytes ``[D/4, D/2)``). INT2: field ``I`` of ``ca``;
    INT4 (byte ``j`` holds dims ``j`` and ``j + D/2``): the low (I < 2) or high nibble of ``ca``
    (I even) or ``cb`` (I odd)."""
    if BITS == 2:
        return _field_bf16(ca, 2 * I, 3, USE_ASM, F16)
    elif I % 2 == 0:
        return _field_bf16(ca, 4 * (I // 2), 15, USE_ASM, F16)
    else:
        return _field_bf16(cb, 4 * (I // 2), 15, USE_ASM, F16)


@triton.jit
def _quarter_i8(ca, cb, I: tl.constexpr, BITS: tl.constexpr, USE_ASM: tl.constexpr):
    """As :func:`_quarter_bf16`, int8 ``c``."""
    if BITS == 2:
        return _field_i8(ca, 2 * I, 3, USE_ASM)
    elif I % 2 == 0:
        return _field_i8(ca, 4 * (I // 2), 15, USE_ASM)
    else:
        return _field_i8(cb, 4 * (I // 2), 15, USE_ASM)


@triton.jit
def _score_plane(q_bf, q_i8, ca, cb, PLANE: tl.constexpr, BITS: tl.constexpr, QK_INT8: tl.constexpr,
                 USE_ASM: tl.constexpr, F16: tl.constexpr):
    """``q_i . c_i`` for every (row, token): fp32 ``[HPAD, BLOCK_N]`` (bf16 path: of ``128 + c``)."""
    if QK_INT8:
        c = _quarter_i8(ca, cb, PLANE, BITS, USE_ASM)
        return tl.dot(q_i8, tl.trans(c), out_dtype=tl.int32).to(tl.float32)
    else:
        c = _quarter_bf16(ca, cb, PLANE, BITS, USE_ASM, F16)
        return tl.dot(q_bf, tl.trans(c))


@triton.jit
def _n_steps(tok_lo, tok_hi, BLOCK: tl.constexpr, STATIC_STEPS: tl.constexpr):
    # Under the interpreter (numpy 2) every scalar is a 1-element array that range() rejects:
    # there the loop runs STATIC_STEPS (a whole split) with masks; compiled, it stops at the
    # request's end.
    if STATIC_STEPS > 0:
        return STATIC_STEPS
    else:
        return tl.cdiv(tok_hi - tok_lo, BLOCK)


@triton.jit
def _split_range(indptr_ptr, last_ptr, b, s, P: tl.constexpr, tokens_per_split):
    """(first page-table slot, first token, end token) of split ``s`` of request ``b``."""
    start = tl.load(indptr_ptr + b)
    npages = tl.load(indptr_ptr + b + 1) - start
    seq = tl.where(npages > 0, (npages - 1) * P + tl.load(last_ptr + b), 0)
    tok_lo = s * tokens_per_split
    return start, tok_lo, tl.minimum(seq, tok_lo + tokens_per_split)


@triton.jit
def _online_softmax(sc, m_i, l_i):
    """One block of base-2 online softmax over scores ``sc [rows, N]``: (p, alpha, m_i, l_i)."""
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a fully masked block
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(sc - m_use[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _load_meta(ptr, row, g: tl.constexpr, NG: tl.constexpr, nmask):
    return tl.load(ptr + row * NG + g, mask=nmask, other=0.0).to(tl.float32)


@triton.jit
def _ring_rows(offs_n, nmask, npages, RK, RN, b, H, hh, P: tl.constexpr):
    """(mask, row) of a block's tokens in the refine ring ``[B, RK, H, P, D/4]``: the tokens of the request's
    RN newest pages (its refined pages), at slot ``page index % RK``."""
    pidx = offs_n // P  # the token's page index in its request
    return nmask & (pidx >= npages - RN), ((b.to(tl.int64) * RK + pidx % RK) * H + hh) * P + offs_n % P


@triton.jit
def _int2_part(
    q_ptr, kc_ptr, ks_ptr, kl_ptr, vc_ptr, vs_ptr, vl_ptr, indptr_ptr, indices_ptr, last_ptr,
    o_ptr, m_ptr, l_ptr, b, h, s, H, HQ, NS, qk_scale, tokens_per_split,
    REP: tl.constexpr, HPAD: tl.constexpr, D: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
    BLOCK_N: tl.constexpr, QK_INT8: tl.constexpr, USE_ASM: tl.constexpr, STATIC_STEPS: tl.constexpr,
    F16: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, rf_ptr, RK, RE, REFINE: tl.constexpr,
    rv_ptr, REFINE_V: tl.constexpr, s_out, REF_ONLY: tl.constexpr, rl_ptr,
):
    # s: the split (its tokens), s_out: the partial slot it writes. REF_ONLY (the refine split,
    # rotkv.kernels.refine_split): the splits cover only each request's refined pages (its newest rn_r),
    # another kernel reads the others; split 0 of KV head 0 also writes that kernel's kv_last_page_len,
    # ``rl_ptr [B]``: P - rn_r * P, so that its request ends where the refined pages start
    # REFINE (INT2 keys): the refine tier (rotkv.cache.refine), ``rf_ptr`` uint8 [B, RK, H, P, D/4]: the
    # refined pages of request b, its min(RK, ceil(npages / RE)) newest (rotkv.quant.refine.refined_pages;
    # RE >= 1), add (j - 1.5) / 4 * s to each key element, i.e. a second key of
    # scale s / 4 and minimum -3/8 s read like the codes (ring slot: the page's index in the request mod RK)
    # K_BITS, V_BITS in {2, 4}: a code row is D * bits / 8 bytes; quarter i of the dims is one bit
    # field of the first (INT2) or of the first or second D/4 bytes (INT4), see _quarter_bf16
    Q4: tl.constexpr = D // 4
    KROW: tl.constexpr = D * K_BITS // 8
    VROW: tl.constexpr = D * V_BITS // 8
    NG: tl.constexpr = D // G
    PPG: tl.constexpr = G // Q4  # planes per group
    start, tok_lo, tok_hi = _split_range(indptr_ptr, last_ptr, b, s, P, tokens_per_split)

    offs_r = tl.arange(0, HPAD)
    rmask = offs_r < REP
    qrow = (b * HQ + h * REP + offs_r).to(tl.int64)
    offs_c = tl.arange(0, Q4)
    qp = q_ptr + qrow[:, None] * D + offs_c[None, :]
    qf0 = tl.load(qp + 0 * Q4, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
    qf1 = tl.load(qp + 1 * Q4, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
    qf2 = tl.load(qp + 2 * Q4, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
    qf3 = tl.load(qp + 3 * Q4, mask=rmask[:, None], other=0.0).to(tl.float32) * qk_scale
    q0, q1, q2, q3 = _mma(qf0, F16), _mma(qf1, F16), _mma(qf2, F16), _mma(qf3, F16)
    # per-plane query sums (of the bf16 values the dots see, so the +128 folds out exactly)
    qs0 = tl.sum(q0.to(tl.float32), axis=1)
    qs1 = tl.sum(q1.to(tl.float32), axis=1)
    qs2 = tl.sum(q2.to(tl.float32), axis=1)
    qs3 = tl.sum(q3.to(tl.float32), axis=1)
    if QK_INT8:
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(qf0), axis=1), tl.max(tl.abs(qf1), axis=1)),
                          tl.maximum(tl.max(tl.abs(qf2), axis=1), tl.max(tl.abs(qf3), axis=1)))
        qsc = tl.where(amax > 0, amax / 127.0, 1.0)
        inv = (1.0 / qsc)[:, None]
        i0 = tl.floor(qf0 * inv + 0.5).to(tl.int8)
        i1 = tl.floor(qf1 * inv + 0.5).to(tl.int8)
        i2 = tl.floor(qf2 * inv + 0.5).to(tl.int8)
        i3 = tl.floor(qf3 * inv + 0.5).to(tl.int8)
        # the lo term uses the float query sums; the code term is sum_i s * qsc * (i_i . c_i)
        qs0, qs1, qs2, qs3 = tl.sum(qf0, axis=1), tl.sum(qf1, axis=1), tl.sum(qf2, axis=1), tl.sum(qf3, axis=1)
    else:
        qsc = tl.full([HPAD], 1.0, tl.float32)
        i0, i1, i2, i3 = q0, q1, q2, q3  # unused

    m_i = tl.full([HPAD], float("-inf"), tl.float32)
    l_i = tl.zeros([HPAD], tl.float32)
    a0 = tl.zeros([HPAD, Q4], tl.float32)
    a1 = tl.zeros([HPAD, Q4], tl.float32)
    a2 = tl.zeros([HPAD, Q4], tl.float32)
    a3 = tl.zeros([HPAD, Q4], tl.float32)
    hh = h.to(tl.int64)
    npages_r = tl.load(indptr_ptr + b + 1) - start  # the request's body pages
    # its refined pages, the newest rn_r: one per RE body pages, at most RK (RE >= 1; every = 0 is RE = 1)
    rn_r = tl.minimum((npages_r + RE - 1) // RE, RK)
    if REF_ONLY:
        seq = tl.where(npages_r > 0, (npages_r - 1) * P + tl.load(last_ptr + b), 0)
        tok_lo = (npages_r - rn_r) * P + s * tokens_per_split
        tok_hi = tl.minimum(seq, tok_lo + tokens_per_split)
        tl.store(rl_ptr + b, P - rn_r * P, mask=(s == 0) & (h == 0))
    for it in range(0, _n_steps(tok_lo, tok_hi, BLOCK_N, STATIC_STEPS)):
        offs_n = tok_lo + it * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = offs_n < tok_hi
        page = tl.load(indices_ptr + start + offs_n // P, mask=nmask, other=0).to(tl.int64)
        row = (page * H + hh) * P + offs_n % P  # int64 row of the [NP * H * P, ...] views
        kp = kc_ptr + row[:, None] * KROW + offs_c[None, :]
        vp = vc_ptr + row[:, None] * VROW + offs_c[None, :]
        kc = tl.load(kp, mask=nmask[:, None], other=0)
        vc = tl.load(vp, mask=nmask[:, None], other=0)
        if K_BITS == 4:
            kc2 = tl.load(kp + Q4, mask=nmask[:, None], other=0)
        else:
            kc2 = kc
        if V_BITS == 4:
            vc2 = tl.load(vp + Q4, mask=nmask[:, None], other=0)
        else:
            vc2 = vc
        # ---- scores [HPAD, BLOCK_N]
        d0 = _score_plane(q0, i0, kc, kc2, 0, K_BITS, QK_INT8, USE_ASM, F16)
        d1 = _score_plane(q1, i1, kc, kc2, 1, K_BITS, QK_INT8, USE_ASM, F16)
        d2 = _score_plane(q2, i2, kc, kc2, 2, K_BITS, QK_INT8, USE_ASM, F16)
        d3 = _score_plane(q3, i3, kc, kc2, 3, K_BITS, QK_INT8, USE_ASM, F16)
        if QK_INT8:
            off = 0.0
        else:
            off = 128.0  # the bf16 codes are 128 + c
        s0 = _load_meta(ks_ptr, row, 0, NG, nmask)
        z0 = _load_meta(kl_ptr, row, 0, NG, nmask) - off * s0
        if PPG == 4:
            sc = (s0[None, :] * (d0 + d1 + d2 + d3)) * qsc[:, None] + z0[None, :] * (qs0 + qs1 + qs2 + qs3)[:, None]
        elif PPG == 2:
            s1 = _load_meta(ks_ptr, row, 1, NG, nmask)
            z1 = _load_meta(kl_ptr, row, 1, NG, nmask) - off * s1
            sc = (s0[None, :] * (d0 + d1) + s1[None, :] * (d2 + d3)) * qsc[:, None]
            sc += z0[None, :] * (qs0 + qs1)[:, None] + z1[None, :] * (qs2 + qs3)[:, None]
        else:
            s1 = _load_meta(ks_ptr, row, 1, NG, nmask)
            z1 = _load_meta(kl_ptr, row, 1, NG, nmask) - off * s1
            s2 = _load_meta(ks_ptr, row, 2, NG, nmask)
            z2 = _load_meta(kl_ptr, row, 2, NG, nmask) - off * s2
            s3 = _load_meta(ks_ptr, row, 3, NG, nmask)
            z3 = _load_meta(kl_ptr, row, 3, NG, nmask) - off * s3
            sc = (s0[None, :] * d0 + s1[None, :] * d1 + s2[None, :] * d2 + s3[None, :] * d3) * qsc[:, None]
            sc += z0[None, :] * qs0[:, None] + z1[None, :] * qs1[:, None]
            sc += z2[None, :] * qs2[:, None] + z3[None, :] * qs3[:, None]
        # a block holds refined tokens only if its last token's page is among the rn_r newest (the blocks
        # before that skip the rings: their loads and dots)
        refined = (tl.minimum(tok_lo + it * BLOCK_N + BLOCK_N, tok_hi) - 1) // P >= npages_r - rn_r
        if REFINE:
            if refined:
                fmask, frow = _ring_rows(offs_n, nmask, npages_r, RK, rn_r, b, H, hh, P)
                fc = tl.load(rf_ptr + frow[:, None] * Q4 + offs_c[None, :], mask=fmask[:, None], other=0)
                f0 = _score_plane(q0, i0, fc, fc, 0, 2, QK_INT8, USE_ASM, F16)
                f1 = _score_plane(q1, i1, fc, fc, 1, 2, QK_INT8, USE_ASM, F16)
                f2 = _score_plane(q2, i2, fc, fc, 2, 2, QK_INT8, USE_ASM, F16)
                f3 = _score_plane(q3, i3, fc, fc, 3, 2, QK_INT8, USE_ASM, F16)
                zf = -(0.375 + 0.25 * off)  # the second key's minimum (and the bf16 codes' +128) per unit of s
                r0 = _load_meta(ks_ptr, row, 0, NG, nmask)
                if PPG == 4:
                    rt = (0.25 * r0[None, :] * (f0 + f1 + f2 + f3)) * qsc[:, None] + (zf * r0)[None, :] * (qs0 + qs1 + qs2 + qs3)[:, None]
                elif PPG == 2:
                    r1 = _load_meta(ks_ptr, row, 1, NG, nmask)
                    rt = (0.25 * r0[None, :] * (f0 + f1) + 0.25 * r1[None, :] * (f2 + f3)) * qsc[:, None]
                    rt += (zf * r0)[None, :] * (qs0 + qs1)[:, None] + (zf * r1)[None, :] * (qs2 + qs3)[:, None]
                else:
                    r1 = _load_meta(ks_ptr, row, 1, NG, nmask)
                    r2 = _load_meta(ks_ptr, row, 2, NG, nmask)
                    r3 = _load_meta(ks_ptr, row, 3, NG, nmask)
                    rt = (0.25 * (r0[None, :] * f0 + r1[None, :] * f1 + r2[None, :] * f2 + r3[None, :] * f3)) * qsc[:, None]
                    rt += (zf * r0)[None, :] * qs0[:, None] + (zf * r1)[None, :] * qs1[:, None]
                    rt += (zf * r2)[None, :] * qs2[:, None] + (zf * r3)[None, :] * qs3[:, None]
                sc += tl.where(fmask[None, :], rt, 0.0)
        sc = tl.where(nmask[None, :], sc, float("-inf"))
        # ---- online softmax (base 2: q carries log2(e))
        p, alpha, m_i, l_i = _online_softmax(sc, m_i, l_i)
        # ---- values: acc_i += (p * s_g) @ (128 + c_i) + sum(p * lo_g) - 128 * sum(p * s_g)
        vs0 = _load_meta(vs_ptr, row, 0, NG, nmask)
        ps0 = _mma(p * vs0[None, :], F16)
        cr0 = tl.sum(p * _load_meta(vl_ptr, row, 0, NG, nmask)[None, :] - 128.0 * ps0.to(tl.float32), axis=1)
        if PPG == 4:
            ps1, ps2, ps3, cr1, cr2, cr3 = ps0, ps0, ps0, cr0, cr0, cr0
        elif PPG == 2:
            ps1, cr1 = ps0, cr0
            vs2 = _load_meta(vs_ptr, row, 1, NG, nmask)
            ps2 = _mma(p * vs2[None, :], F16)
            cr2 = tl.sum(p * _load_meta(vl_ptr, row, 1, NG, nmask)[None, :] - 128.0 * ps2.to(tl.float32), axis=1)
            ps3, cr3 = ps2, cr2
        else:
            vs1 = _load_meta(vs_ptr, row, 1, NG, nmask)
            ps1 = _mma(p * vs1[None, :], F16)
            cr1 = tl.sum(p * _load_meta(vl_ptr, row, 1, NG, nmask)[None, :] - 128.0 * ps1.to(tl.float32), axis=1)
            vs2 = _load_meta(vs_ptr, row, 2, NG, nmask)
            ps2 = _mma(p * vs2[None, :], F16)
            cr2 = tl.sum(p * _load_meta(vl_ptr, row, 2, NG, nmask)[None, :] - 128.0 * ps2.to(tl.float32), axis=1)
            vs3 = _load_meta(vs_ptr, row, 3, NG, nmask)
            ps3 = _mma(p * vs3[None, :], F16)
            cr3 = tl.sum(p * _load_meta(vl_ptr, row, 3, NG, nmask)[None, :] - 128.0 * ps3.to(tl.float32), axis=1)
        a0 = tl.dot(ps0, _quarter_bf16(vc, vc2, 0, V_BITS, USE_ASM, F16), a0 * alpha[:, None]) + cr0[:, None]
        a1 = tl.dot(ps1, _quarter_bf16(vc, vc2, 1, V_BITS, USE_ASM, F16), a1 * alpha[:, None]) + cr1[:, None]
        a2 = tl.dot(ps2, _quarter_bf16(vc, vc2, 2, V_BITS, USE_ASM, F16), a2 * alpha[:, None]) + cr2[:, None]
        a3 = tl.dot(ps3, _quarter_bf16(vc, vc2, 3, V_BITS, USE_ASM, F16), a3 * alpha[:, None]) + cr3[:, None]
        # REFINE_V (INT2 values): the value ring ``rv_ptr`` (as rf_ptr's) adds (j - 1.5) / 4 * s to each value
        # element of the refined pages: a second value of scale s / 4 and minimum -3/8 s in p @ V
        if REFINE_V:
            if refined:
                vmask, vrow = _ring_rows(offs_n, nmask, npages_r, RK, rn_r, b, H, hh, P)
                gc = tl.load(rv_ptr + vrow[:, None] * Q4 + offs_c[None, :], mask=vmask[:, None], other=0)
                pr = tl.where(vmask[None, :], p, 0.0)
                w0 = 0.25 * _load_meta(vs_ptr, row, 0, NG, nmask)
                u0 = _mma(pr * w0[None, :], F16)
                e0 = tl.sum(pr * (-1.5 * w0)[None, :] - 128.0 * u0.to(tl.float32), axis=1)
                if PPG == 4:
                    u1, u2, u3, e1, e2, e3 = u0, u0, u0, e0, e0, e0
                elif PPG == 2:
                    u1, e1 = u0, e0
                    w2 = 0.25 * _load_meta(vs_ptr, row, 1, NG, nmask)
                    u2 = _mma(pr * w2[None, :], F16)
                    e2 = tl.sum(pr * (-1.5 * w2)[None, :] - 128.0 * u2.to(tl.float32), axis=1)
                    u3, e3 = u2, e2
                else:
                    w1 = 0.25 * _load_meta(vs_ptr, row, 1, NG, nmask)
                    u1 = _mma(pr * w1[None, :], F16)
                    e1 = tl.sum(pr * (-1.5 * w1)[None, :] - 128.0 * u1.to(tl.float32), axis=1)
                    w2 = 0.25 * _load_meta(vs_ptr, row, 2, NG, nmask)
                    u2 = _mma(pr * w2[None, :], F16)
                    e2 = tl.sum(pr * (-1.5 * w2)[None, :] - 128.0 * u2.to(tl.float32), axis=1)
                    w3 = 0.25 * _load_meta(vs_ptr, row, 3, NG, nmask)
                    u3 = _mma(pr * w3[None, :], F16)
                    e3 = tl.sum(pr * (-1.5 * w3)[None, :] - 128.0 * u3.to(tl.float32), axis=1)
                a0 = tl.dot(u0, _quarter_bf16(gc, gc, 0, 2, USE_ASM, F16), a0) + e0[:, None]
                a1 = tl.dot(u1, _quarter_bf16(gc, gc, 1, 2, USE_ASM, F16), a1) + e1[:, None]
                a2 = tl.dot(u2, _quarter_bf16(gc, gc, 2, 2, USE_ASM, F16), a2) + e2[:, None]
                a3 = tl.dot(u3, _quarter_bf16(gc, gc, 3, 2, USE_ASM, F16), a3) + e3[:, None]
    # ---- partials
    prow = (qrow * NS + s_out)
    tl.store(m_ptr + prow, m_i, mask=rmask)
    tl.store(l_ptr + prow, l_i, mask=rmask)
    op = o_ptr + prow[:, None] * D + offs_c[None, :]
    tl.store(op + 0 * Q4, a0, mask=rmask[:, None])
    tl.store(op + 1 * Q4, a1, mask=rmask[:, None])
    tl.store(op + 2 * Q4, a2, mask=rmask[:, None])
    tl.store(op + 3 * Q4, a3, mask=rmask[:, None])


@triton.jit
def _codes4(byte, I8: tl.constexpr, USE_ASM: tl.constexpr, F16: tl.constexpr):
    """uint8 ``[N, D/4]`` -> codes ``[N, D]`` in the column order ``k = 32 * (j // 8) + 8 * i + j % 8``
    (plane ``i`` of byte ``j``, i.e. dim ``i * D/4 + j``): runs of 8 bytes stay together, so a
    thread that holds 8 consecutive code bytes unpacks them with 4 ops per 32-bit word into the
    8 consecutive K values an int8 MMA operand register pair wants; the planes are placed by
    ``tl.join`` + ``tl.permute`` (register relabelling, no data movement).

    int8 ``c`` (``I8``) or bf16/fp16 ``128 + c``.
    """
    n: tl.constexpr = byte.shape[0]
    q4: tl.constexpr = byte.shape[1]
    x = tl.reshape(byte, (n, q4 // 8, 8))
    if I8:
        c0 = _plane_i8(x, 0, USE_ASM)
        c1 = _plane_i8(x, 1, USE_ASM)
        c2 = _plane_i8(x, 2, USE_ASM)
        c3 = _plane_i8(x, 3, USE_ASM)
    else:
        c0 = _plane_bf16(x, 0, USE_ASM, F16)
        c1 = _plane_bf16(x, 1, USE_ASM, F16)
        c2 = _plane_bf16(x, 2, USE_ASM, F16)
        c3 = _plane_bf16(x, 3, USE_ASM, F16)
    y = tl.join(tl.join(c0, c2), tl.join(c1, c3))  # [N, j // 8, j % 8, a, b]: plane 2a + b
    y = tl.permute(y, (0, 1, 3, 4, 2))  # [N, j // 8, a, b, j % 8]
    return tl.reshape(y, (n, 4 * q4))

@triton.jit
def _int2_part_v2(
    q_ptr, kc_ptr, ks_ptr, kl_ptr, vc_ptr, vs_ptr, vl_ptr, indptr_ptr, indices_ptr, last_ptr,
    o_ptr, m_ptr, l_ptr, b, h, s, H, HQ, NS, qk_scale, tokens_per_split,
    REP: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
    BLOCK_N: tl.constexpr, PB: tl.constexpr, QK_INT8: tl.constexpr, USE_ASM: tl.constexpr,
    STATIC_STEPS: tl.constexpr, F16: tl.constexpr,
):
    """INT2 body, v2: the MMA rows are (plane i, query head r), ``RQ = 4 * RP`` of them.

    Scores: one dot ``Qblk [RQ, D] @ C^T [D, N]`` where row ``(i, r)`` of ``Qblk`` holds head
    ``r``'s plane-``i`` dims (zero elsewhere) and ``C`` the four planes interleaved (``_codes4``):
    row ``(i, r)`` of the result is ``q_{r,i} . c_i``, so all 16 rows are useful at n_rep 4
    (v1 padded 4 rows to 16 and ran 4 dots). The per-plane metadata fold and the sum over planes
    run on ``[4, RP, N]``; the softmax on ``[RP, N]`` (no padded rows). Values: one dot
    ``A [RQ, N] @ V [N, D]`` with ``A[(i, r)] = p_r * s_g(i)``; only the diagonal blocks
    (row plane == column plane) are kept, at the store. Page indices load once per page
    (``PB = min(P, BLOCK_N)`` tokens share one page), not once per token.
    """
    Q4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    PPG: tl.constexpr = G // Q4  # planes per group
    RQ: tl.constexpr = 4 * RP
    NCH: tl.constexpr = BLOCK_N // PB
    start, tok_lo, tok_hi = _split_range(indptr_ptr, last_ptr, b, s, P, tokens_per_split)

    # ---- block query: row (i, r) = i * RP + r, column k = 4j + i' holds q_r[i' * Q4 + j] if i' == i
    offs_q = tl.arange(0, RQ)
    qi, qr = offs_q // RP, offs_q % RP
    offs_k = tl.arange(0, D)
    kpl, kj = (offs_k // 8) % 4, (offs_k // 32) * 8 + offs_k % 8  # column k: plane, byte (see _codes4)
    qrow = (b * HQ + h * REP + qr).to(tl.int64)
    qmask = (qr < REP)[:, None] & (kpl[None, :] == qi[:, None])
    qf = tl.load(q_ptr + qrow[:, None] * D + (kpl * Q4 + kj)[None, :], mask=qmask, other=0.0).to(tl.float32)
    qf = qf * qk_scale
    if QK_INT8:
        # one int8 scale per head (over all planes), as v1
        qsc = tl.max(tl.reshape(tl.max(tl.abs(qf), axis=1), (4, RP)), axis=0)
        qsc = tl.where(qsc > 0, qsc / 127.0, 1.0)
        qsc_q = tl.reshape(tl.broadcast_to(qsc[None, :], (4, RP)), (RQ,))
        qa = tl.floor(qf * (1.0 / qsc_q)[:, None] + 0.5).to(tl.int8)
        qs = tl.sum(qf, axis=1)  # the lo term uses the float query sums
        off = 0.0
    else:
        qa = _mma(qf, F16)
        qsc = tl.full([RP], 1.0, tl.float32)
        qs = tl.sum(qa.to(tl.float32), axis=1)  # of the values the dot sees: the +128 folds out exactly
        off = 128.0
    qsg = tl.sum(tl.reshape(qs, (NG, PPG, RP)), axis=1)  # [NG, RP] query sum over each group's dims

    offs_r = tl.arange(0, RP)
    offs_g = tl.arange(0, NG)
    m_i = tl.full([RP], float("-inf"), tl.float32)
    l_i = tl.zeros([RP], tl.float32)
    acc = tl.zeros([RQ, D], tl.float32)
    cacc = tl.zeros([RQ], tl.float32)  # the lo and -128 terms, added to acc once at the end
    hh = h.to(tl.int64)
    offs_c = tl.arange(0, Q4)
    for it in range(0, _n_steps(tok_lo, tok_hi, BLOCK_N, STATIC_STEPS)):
        base = tok_lo + it * BLOCK_N
        offs_n = base + tl.arange(0, BLOCK_N)
        nmask = offs_n < tok_hi
        # one page index per PB tokens (PB divides P; splits start at multiples of BLOCK_N)
        ch = base + tl.arange(0, NCH) * PB
        pg = tl.load(indices_ptr + start + ch // P, mask=ch < tok_hi, other=0).to(tl.int64)
        rbase = (pg * H + hh) * P + ch % P
        row = tl.reshape(rbase[:, None] + tl.arange(0, PB)[None, :], (BLOCK_N,))
        kc = tl.load(kc_ptr + row[:, None] * Q4 + offs_c[None, :], mask=nmask[:, None], other=0)
        vc = tl.load(vc_ptr + row[:, None] * Q4 + offs_c[None, :], mask=nmask[:, None], other=0)
        kcode = _codes4(kc, QK_INT8, USE_ASM, F16)
        vcode = _codes4(vc, False, USE_ASM, F16)
        # metadata: one [N, NG] tile per tensor (NG contiguous fp16 per token), used as [NG, N]
        moff = row[:, None] * NG + offs_g[None, :]
        ksg = tl.trans(tl.load(ks_ptr + moff, mask=nmask[:, None], other=0.0).to(tl.float32))
        klg = tl.trans(tl.load(kl_ptr + moff, mask=nmask[:, None], other=0.0).to(tl.float32))
        vsg = tl.trans(tl.load(vs_ptr + moff, mask=nmask[:, None], other=0.0).to(tl.float32))
        vlg = tl.trans(tl.load(vl_ptr + moff, mask=nmask[:, None], other=0.0).to(tl.float32))
        # ---- scores [RP, N] = qsc_r * sum_g s_g (sum over g's planes of q_i . c_i) + sum_g z_g qsum_g
        if QK_INT8:
            d = tl.dot(qa, tl.trans(kcode), out_dtype=tl.int32).to(tl.float32)
        else:
            d = tl.dot(qa, tl.trans(kcode))
        dg = tl.sum(tl.reshape(d, (NG, PPG, RP, BLOCK_N)), axis=1)  # [NG, RP, N]
        sc = tl.sum(dg * ksg[:, None, :], axis=0) * qsc[:, None]
        sc += tl.sum((klg - off * ksg)[:, None, :] * qsg[:, :, None], axis=0)
        sc = tl.where(nmask[None, :], sc, float("-inf"))
        # ---- online softmax (base 2: q carries log2(e))
        p, alpha, m_i, l_i = _online_softmax(sc, m_i, l_i)
        # ---- values: acc[(i, r)] += (p_r * s_g(i)) @ (128 + c); cacc[(i, r)] += sum(p_r * lo_g(i)) - 128 * sum(p_r * s_g(i))
        a = _mma(tl.reshape(tl.broadcast_to(p[None, None, :, :] * vsg[:, None, None, :], (NG, PPG, RP, BLOCK_N)),
                            (RQ, BLOCK_N)), F16)
        crl = tl.sum(p[None, :, :] * vlg[:, None, :], axis=2)  # [NG, RP]
        crl = tl.reshape(tl.broadcast_to(crl[:, None, :], (NG, PPG, RP)), (RQ,))
        alpha_q = tl.reshape(tl.broadcast_to(alpha[None, :], (4, RP)), (RQ,))
        cacc = cacc * alpha_q + crl - 128.0 * tl.sum(a.to(tl.float32), axis=1)
        acc = tl.dot(a, vcode, acc * alpha_q[:, None])
    acc += cacc[:, None]
    # ---- partials: row (i, r), column k (plane kpl, byte kj) -> dim kpl * Q4 + kj of head r
    rmask = offs_r < REP
    prow = (b * HQ + h * REP + offs_r).to(tl.int64) * NS + s
    tl.store(m_ptr + prow, m_i, mask=rmask)
    tl.store(l_ptr + prow, l_i, mask=rmask)
    orow = (b * HQ + h * REP + qr).to(tl.int64) * NS + s
    omask = (qr < REP)[:, None] & (kpl[None, :] == qi[:, None])
    tl.store(o_ptr + orow[:, None] * D + (kpl * Q4 + kj)[None, :], acc, mask=omask)


@triton.jit
def _bf16_part(
    q_ptr, tk_ptr, tv_ptr, indptr_ptr, indices_ptr, last_ptr,
    o_ptr, m_ptr, l_ptr, b, h, s, s_out, H, HQ, NS, qk_scale, tokens_per_split, tier_start,
    REP: tl.constexpr, HPAD: tl.constexpr, D: tl.constexpr, P: tl.constexpr, BLOCK_N: tl.constexpr,
    STATIC_STEPS: tl.constexpr, F16: tl.constexpr,
):
    # positions below tier_start hold no token (the cache aligns the window to a page boundary)
    start, tok_lo, tok_hi = _split_range(indptr_ptr, last_ptr, b, s, P, tokens_per_split)
    offs_r = tl.arange(0, HPAD)
    rmask = offs_r < REP
    qrow = (b * HQ + h * REP + offs_r).to(tl.int64)
    offs_d = tl.arange(0, D)
    q = (tl.load(q_ptr + qrow[:, None] * D + offs_d[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
         * qk_scale)
    q = _mma(q, F16)
    m_i = tl.full([HPAD], float("-inf"), tl.float32)
    l_i = tl.zeros([HPAD], tl.float32)
    acc = tl.zeros([HPAD, D], tl.float32)
    hh = h.to(tl.int64)
    for it in range(0, _n_steps(tok_lo, tok_hi, BLOCK_N, STATIC_STEPS)):
        offs_n = tok_lo + it * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = (offs_n < tok_hi) & (offs_n >= tier_start)
        page = tl.load(indices_ptr + start + offs_n // P, mask=nmask, other=0).to(tl.int64)
        row = (page * H + hh) * P + offs_n % P
        k = _mma(tl.load(tk_ptr + row[:, None] * D + offs_d[None, :], mask=nmask[:, None], other=0.0), F16)
        v = _mma(tl.load(tv_ptr + row[:, None] * D + offs_d[None, :], mask=nmask[:, None], other=0.0), F16)
        sc = tl.dot(q, tl.trans(k))
        sc = tl.where(nmask[None, :], sc, float("-inf"))
        p, alpha, m_i, l_i = _online_softmax(sc, m_i, l_i)
        acc = tl.dot(_mma(p, F16), v, acc * alpha[:, None])
    prow = qrow * NS + s_out
    tl.store(m_ptr + prow, m_i, mask=rmask)
    tl.store(l_ptr + prow, l_i, mask=rmask)
    tl.store(o_ptr + prow[:, None] * D + offs_d[None, :], acc, mask=rmask[:, None])


@triton.jit
def _split_kernel(
    q_ptr, kc_ptr, ks_ptr, kl_ptr, vc_ptr, vs_ptr, vl_ptr, indptr_ptr, indices_ptr, last_ptr,
    tk_ptr, tv_ptr, tindptr_ptr, tindices_ptr, tlast_ptr,
    o_ptr, m_ptr, l_ptr, H, HQ, NS, n_int2_splits, s0, qk_scale, tokens_per_split, tier_tokens_per_split,
    tier_start, REP: tl.constexpr, HPAD: tl.constexpr, D: tl.constexpr, G: tl.constexpr, P: tl.constexpr, PT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, QK_INT8: tl.constexpr, USE_ASM: tl.constexpr,
    HAS_INT2: tl.constexpr, HAS_TIER: tl.constexpr, STATIC_STEPS: tl.constexpr,
    TIER_STATIC_STEPS: tl.constexpr, F16: tl.constexpr, V2: tl.constexpr, RP: tl.constexpr, PB: tl.constexpr,
    K_BITS: tl.constexpr, V_BITS: tl.constexpr, rf_ptr, RK, RE, REFINE: tl.constexpr, rv_ptr, REFINE_V: tl.constexpr,
    REF_ONLY: tl.constexpr, rl_ptr,
):
    pid, s = tl.program_id(0), tl.program_id(1) + s0  # s0 > 0: the body's splits were written elsewhere
    b, h = pid // H, pid % H
    if REF_ONLY and s < n_int2_splits:  # the refine split: slots [s0, n_int2_splits) are the refined pages'
        _int2_part(q_ptr, kc_ptr, ks_ptr, kl_ptr, vc_ptr, vs_ptr, vl_ptr, indptr_ptr, indices_ptr, last_ptr,
                   o_ptr, m_ptr, l_ptr, b, h, s - s0, H, HQ, NS, qk_scale, tokens_per_split,
                   REP, HPAD, D, G, P, BLOCK_N, QK_INT8, USE_ASM, STATIC_STEPS, F16, K_BITS, V_BITS,
                   rf_ptr, RK, RE, REFINE, rv_ptr, REFINE_V, s, True, rl_ptr)
    elif HAS_INT2 and s < n_int2_splits:
        if V2:  # constexpr: only the selected body kernel is compiled
            _int2_part_v2(q_ptr, kc_ptr, ks_ptr, kl_ptr, vc_ptr, vs_ptr, vl_ptr, indptr_ptr, indices_ptr, last_ptr,
                          o_ptr, m_ptr, l_ptr, b, h, s, H, HQ, NS, qk_scale, tokens_per_split,
                          REP, RP, D, G, P, BLOCK_N, PB, QK_INT8, USE_ASM, STATIC_STEPS, F16)
        else:
            _int2_part(q_ptr, kc_ptr, ks_ptr, kl_ptr, vc_ptr, vs_ptr, vl_ptr, indptr_ptr, indices_ptr, last_ptr,
                       o_ptr, m_ptr, l_ptr, b, h, s, H, HQ, NS, qk_scale, tokens_per_split,
                       REP, HPAD, D, G, P, BLOCK_N, QK_INT8, USE_ASM, STATIC_STEPS, F16, K_BITS, V_BITS,
                       rf_ptr, RK, RE, REFINE, rv_ptr, REFINE_V, s, False, rl_ptr)
    elif HAS_TIER:
        _bf16_part(q_ptr, tk_ptr, tv_ptr, tindptr_ptr, tindices_ptr, tlast_ptr,
                   o_ptr, m_ptr, l_ptr, b, h, s - n_int2_splits, s, H, HQ, NS, qk_scale, tier_tokens_per_split,
                   tier_start, REP, HPAD, D, PT, BLOCK_T, TIER_STATIC_STEPS, F16)


@triton.jit
def _merge_kernel(o_ptr, m_ptr, l_ptr, out_ptr, NS, a_ptr, HQ, D: tl.constexpr, DB: tl.constexpr, CHUNK: tl.constexpr,
                  STATIC_STEPS: tl.constexpr, ROT: tl.constexpr, GROUP: tl.constexpr, K: tl.constexpr):
    # grid (rows, D // DB): a program writes one DB-wide slice of one query row. Plain: it merges that
    # slice of the row's partials. ROT: it merges the whole row (every program of the row does, no
    # barrier, no store and reload), rounds it to the output dtype, and turns it back by its group's split
    # matrix [hi; lo] (rotkv.kernels.rotate's arithmetic: the bf16 row times both parts, float32 sums, one
    # rounding), for its DB output columns only
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * DB + tl.arange(0, DB)
    if ROT:
        offs_m = tl.arange(0, D)
    else:
        offs_m = offs_d
    mx = tl.full([CHUNK], float("-inf"), tl.float32)
    for it in range(0, _n_steps(0, NS, CHUNK, STATIC_STEPS)):
        offs_s = it * CHUNK + tl.arange(0, CHUNK)
        mx = tl.maximum(mx, tl.load(m_ptr + row * NS + offs_s, mask=offs_s < NS, other=float("-inf")))
    m_all = tl.max(mx, axis=0)
    m_all = tl.where(m_all == float("-inf"), 0.0, m_all)  # no tokens at all: output 0
    if ROT:
        num = tl.zeros([D], tl.float32)
    else:
        num = tl.zeros([DB], tl.float32)
    den = tl.zeros([CHUNK], tl.float32)
    for it in range(0, _n_steps(0, NS, CHUNK, STATIC_STEPS)):
        offs_s = it * CHUNK + tl.arange(0, CHUNK)
        smask = offs_s < NS
        w = tl.exp2(tl.load(m_ptr + row * NS + offs_s, mask=smask, other=float("-inf")) - m_all)
        den += w * tl.load(l_ptr + row * NS + offs_s, mask=smask, other=0.0)
        o = tl.load(o_ptr + (row * NS + offs_s)[:, None] * D + offs_m[None, :], mask=smask[:, None], other=0.0)
        num += tl.sum(o * w[:, None], axis=0)
    d = tl.sum(den, axis=0)
    d = tl.where(d > 0, d, 1.0)
    res = num / d
    if ROT:
        x = res.to(out_ptr.dtype.element_ty).to(tl.float32)  # the whole row as the plain merge would store it
        a = a_ptr + ((row % HQ) // GROUP) * (K * D)
        hi = tl.load(a + offs_m[:, None] * D + offs_d[None, :]).to(tl.float32)
        lo = tl.load(a + (D + offs_m)[:, None] * D + offs_d[None, :]).to(tl.float32)
        res = tl.sum(x[:, None] * hi, axis=0) + tl.sum(x[:, None] * lo, axis=0)
    tl.store(out_ptr + row * D + offs_d, res.to(out_ptr.dtype.element_ty))


def _splits(max_len: int, bh: int, block: int, target: int, min_tokens: int,
            cap: int | None = None) -> tuple[int, int]:
    """(tokens_per_split, n_splits) for ``max_len`` tokens, a multiple of ``block``; ``cap``: at most that many
    tokens per split (not below ``min_tokens``)."""
    if max_len <= 0:
        return block, 0
    want = max(1, -(-target // bh))
    per = max(min_tokens, -(-max_len // want))
    if cap is not None:
        per = min(per, max(min_tokens, cap))
    per = -(-per // block) * block
    return per, -(-max_len // per)


_SIDE: dict = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One second stream per device, made at its first use (a warm-up call before a capture makes it
    outside the capture): the tier's launch beside the body kernel."""
    if device.index not in _SIDE:
        _SIDE[device.index] = torch.cuda.Stream(device)
    return _SIDE[device.index]


def decode_attention(q: torch.Tensor, body: PagedBody | None, table: tuple | None, max_len: int,
                     tier: tuple | None = None, tier_table: tuple | None = None, tier_max_len: int = 0,
                     sm_scale: float | None = None, cfg: DecodeConfig | None = None,
                     out: torch.Tensor | None = None, tier_start: int = 0,
                     plan: DecodePlan | None = None, refine: RefineTier | tuple | None = None,
                     refine_values: RefineTier | tuple | None = None,
                     out_rotation: torch.Tensor | None = None, max_split_tokens: int | None = None) -> torch.Tensor:
    """Attention of one decode token per request over an INT2 paged body and a bf16 paged tier.

    q ``[B, Hq, D]`` (rotated by R_K; any float dtype). body a :class:`~rotkv.kernels.body.PagedBody`,
    K and V each INT2 (codes ``[.., D/4]``) or INT4 (``[.., D/2]``, same planar packing), one group
    size; table ``(kv_indptr, kv_indices, kv_last_page_len)``; ``max_len``: the longest request's
    body length (host int, sizes the grid). tier ``(k, v)`` ``[NPT, H, PT, D]`` with ``tier_table``
    and ``tier_max_len`` likewise; tier positions below ``tier_start`` are skipped (they hold no token).
    ``plan``: the call's :class:`~rotkv.kernels.plan.DecodePlan` (``plan_decode(q, body, cfg, refine)``,
    looked up here when not given); it says which kernel runs, this function only launches it.
    ``refine``: the refine tier of an INT2-key body (:class:`~rotkv.kernels.body.RefineTier`, or ``(ring [B,
    K, H, P, D/4] uint8, K[, every])``; :mod:`rotkv.cache.refine`), which the plan was made for (its
    ``refine``: the Triton v1 body kernel reads the tier: it reads every page, or, where the plan
    splits the call (``plan.refine_split``, :mod:`rotkv.kernels.refine_split`), the refined pages only
    while the plan's launch reads the others; or the plan's CUDA launch reads it itself (``launch.refine``:
    ``refine_split=kernel``). ``refine_values``: the same for the INT2 values
    (``CacheSpec.refine_values``); both cover the same pages.
    ``out_rotation``: a split matrix ``[H', 2 D, D]`` bf16 (``rotkv.rotations.base.bf16x2_matrix``, no shift
    rows; query head ``h`` uses ``h // (Hq / H')``) that the merge applies to each output row, with a bf16 ``out``
    (``[B, Hq, D]`` contiguous): the graphed decode step's output turned back by ``R_V^T`` without a launch
    of its own, as ``rotkv.kernels.rotate.rotate_bf16x2`` of the output would (up to the sums' order); from
    ``cfg.merge_rotate_rows`` query rows on, by that kernel after the merge (:func:`~rotkv.kernels.plan.merge_rotates`).
    ``max_split_tokens``: at most this many body tokens per split (a CUDA graph's call, whose ``max_len`` is the
    capacity: ``cfg.graph_split_tokens``), so that rows shorter than ``max_len`` still fill the GPU.
    Returns ``[B, Hq, D]`` in q's dtype (or written into ``out``).
    """
    b_sz, hq, d = q.shape
    if out_rotation is not None:
        if out is None or out.dtype != torch.bfloat16 or out.shape != (b_sz, hq, d) or not out.is_contiguous():
            raise ValueError("decode_attention: out_rotation needs a contiguous bf16 out [B, Hq, D]")
        if out_rotation.dtype != torch.bfloat16 or out_rotation.dim() != 3 or out_rotation.shape[1:] != (2 * d, d) \
                or hq % out_rotation.shape[0] or not out_rotation.is_contiguous():
            raise ValueError(f"decode_attention: out_rotation has to be a contiguous bf16 [H, {2 * d}, {d}] split "
                             f"matrix over {hq} heads, got {tuple(out_rotation.shape)} {out_rotation.dtype}")
    given = (refine is not None, refine_values is not None)
    plan = plan or plan_decode(q, body, cfg, given)
    if not plan.covered:
        raise ValueError(plan.why)
    h = body.kv_heads if body is not None else tier[0].shape[1]
    # the plan picks the launch by the work (small bodies: Triton v2, cfg.small_*)
    work = b_sz * h * max_len if body is not None else 0
    launch = plan.launch(work)
    cfg, bits = launch.cfg, plan.bits
    q = q.contiguous()
    rep = hq // h
    hpad = max(16, triton.next_power_of_2(rep))
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    has_int2 = body is not None and max_len > 0
    has_tier = tier is not None and tier_max_len > 0
    ring = vring = None
    rk, re = 1, 0
    if has_int2 and plan.refine != given:
        raise ValueError(f"the plan reads refine tiers {plan.refine} (keys, values), the call gives {given}: "
                         "plan_decode(q, body, cfg, refine)")
    if has_int2 and (refine is not None or refine_values is not None):
        refine, refine_values = check_refine_tiers(refine, refine_values, b_sz, body)
        rk, re = (refine or refine_values)[1:]
        ring = refine.ring if refine is not None else None
        vring = refine_values.ring if refine_values is not None else None
    # the refine split (the plan's): v1 reads the refined pages (its own launch), ``launch`` the others
    split = plan.refine_split(work) if has_int2 else None
    ref_launch = split.refined if split is not None else None
    use_cuda = has_int2 and launch.kernel == "cuda" and (split is None or split.rest == "cuda")
    rest_ref = split is not None and split.rest == "reference"
    fuse_mode = resolve_fuse(cfg, d)
    fuse = use_cuda and fuse_mode != "none"  # the CUDA kernel pre-merges blocks of 4 splits
    if has_int2:
        g, p = body.group_size, body.page_size
        if rest_ref:  # the PyTorch reference writes the other pages' partials into one slot
            per, n_int2 = max_len, 1
        elif use_cuda:
            per, n_int2 = _splits(max_len, b_sz * h, 16 * cfg.cuda_tiles, cfg.cuda_target_warps,
                                  cfg.cuda_min_split_tokens, max_split_tokens)
            if fuse:  # whole blocks of 4 splits (trailing ones may be empty)
                n_int2 = -(-n_int2 // 4) * 4
        else:
            per, n_int2 = _splits(max_len, b_sz * h, cfg.block_n, cfg.target_programs, cfg.min_split_tokens,
                                  max_split_tokens)
    else:
        g, p, per, n_int2 = d, 16, cfg.block_n, 0
    if has_tier:
        pt = tier[0].shape[2]
        # beside an INT2 body the tier (a few hundred tokens) gets splits of >= 64 tokens, so that at
        # small batches its serial loop does not outlast the body's; alone, it is split like a body
        tper, n_tier = _splits(tier_max_len, b_sz * h, cfg.block_t, cfg.target_programs,
                               64 if has_int2 else cfg.min_split_tokens)
    else:
        pt, tper, n_tier = 16, cfg.block_t, 0
    body_slots = n_int2 // 4 if fuse else n_int2  # partial slots the body fills
    n_ref, per_ref, rest_last = 0, per, None
    if split is not None:  # the refined pages' splits, slots [body_slots, body_slots + n_ref): at most rk pages a request
        rcfg = ref_launch.cfg
        per_ref, n_ref = _splits(min(rk * p, max_len), b_sz * h, rcfg.block_n, rcfg.target_programs,
                                 rcfg.refine_min_split_tokens)
        rest_last = torch.empty(b_sz, dtype=torch.int32, device=q.device)  # written by the refined launch
    ns = max(1, body_slots + n_ref + n_tier)
    v2 = launch.v2
    dev = q.device
    # every program writes all of its rows, so the partials need no initialization
    o_part = torch.empty(b_sz, hq, ns, d, dtype=torch.float32, device=dev)
    m_part = torch.empty(b_sz, hq, ns, dtype=torch.float32, device=dev)
    l_part = torch.empty(b_sz, hq, ns, dtype=torch.float32, device=dev)
    if out is None:
        out = torch.empty(b_sz, hq, d, dtype=q.dtype, device=dev)
    if n_int2 + n_tier == 0:
        m_part.fill_(float("-inf")), l_part.zero_(), o_part.zero_()
    else:
        dummy = q
        triton_body = has_int2 and (not use_cuda or split is not None)  # all pages, or a split's refined ones
        bt = body.tensors() if triton_body else (dummy,) * 6
        tb = table if triton_body else (dummy,) * 3
        tt = tier if has_tier else (dummy,) * 2
        ttb = tier_table if has_tier else (dummy,) * 3
        # with the CUDA body kernel (or a split's rest) the tier runs first (its own launch, partial slots
        # after the body's), so that the fused kernel's last block per (request, KV head) can merge it too;
        # a split's refined pages run in that launch, before the tier (and write the rest's table)
        s0 = body_slots if (use_cuda or split is not None) else 0
        lc = ref_launch.cfg if split is not None else cfg  # the refined pages': v1's config (block_t the same)
        lper = per_ref if split is not None else per

        def launch_split():
            _split_kernel[(b_sz * h, body_slots + n_ref + n_tier - s0)](
                q, *bt, *tb, *tt, *ttb, o_part, m_part, l_part, h, hq, ns, body_slots + n_ref, s0, sm_scale * LOG2E,
                lper, tper, tier_start, REP=rep, HPAD=hpad, D=d, G=g, P=p, PT=pt, BLOCK_N=lc.block_n, BLOCK_T=cfg.block_t,
                QK_INT8=(ref_launch if split is not None else launch).qk_int8,
                USE_ASM=(not _interpreting()) if lc.use_asm is None else lc.use_asm,
                HAS_INT2=has_int2 and not use_cuda and split is None, HAS_TIER=has_tier,
                STATIC_STEPS=lper // lc.block_n if _interpreting() else 0,
                TIER_STATIC_STEPS=tper // cfg.block_t if _interpreting() else 0, F16=_interpreting(),
                V2=v2 and split is None, RP=max(4, triton.next_power_of_2(rep)), PB=min(p, lc.block_n),
                K_BITS=bits[0], V_BITS=bits[1],
                rf_ptr=ring if ring is not None else dummy, RK=rk, RE=max(re, 1), REFINE=ring is not None and triton_body,
                rv_ptr=vring if vring is not None else dummy, REFINE_V=vring is not None and triton_body,
                REF_ONLY=split is not None, rl_ptr=rest_last if rest_last is not None else dummy,
                num_warps=lc.num_warps, num_stages=lc.num_stages,
            )

        # the tier beside the CUDA body kernel (cfg.tier_stream): launched after it on a second stream, forked
        # before it and joined before the merge, so that its programs take the SMs the body's grid leaves free
        # instead of running before it; not with a refine split (the body reads the rest's table that launch
        # writes) or the merge inside the body kernel (its last block merges the tier's partials too)
        beside = (use_cuda and split is None and n_tier > 0 and cfg.tier_stream and fuse_mode != "all"
                  and q.is_cuda and not _interpreting())
        if beside:
            main, side = torch.cuda.current_stream(dev), _side_stream(dev)
            beside = side.cuda_stream != main.cuda_stream  # a caller already on the side stream: one stream
        if beside:
            side.wait_stream(main)  # fork: the tier waits for what came before the body, not for the body
        elif not use_cuda or n_tier > 0 or split is not None:
            launch_split()
        if rest_ref:
            from rotkv.kernels.refine_split import rest_partials_reference

            rest_partials_reference(q, body, (table[0], table[1], rest_last), o_part, m_part, l_part, 0, sm_scale)
        if use_cuda:
            if split is not None:  # the rest: the body's table, each request ending at its first refined page
                table = (table[0], table[1], rest_last)
            from rotkv.kernels.cuda_decode import body_partials, merges_into

            qb = q if q.dtype == torch.bfloat16 else q.to(torch.bfloat16)
            merge_here = fuse_mode == "all" and merges_into(out, q, ns) and out_rotation is None
            tiles, min_blocks, prefetch, vf16, vflush, qf16 = launch.cuda_variant[2:8]
            body_partials(qb, body, table, o_part, m_part, l_part, n_int2, per, sm_scale * LOG2E,
                          tiles=tiles, min_blocks=min_blocks, fuse=fuse, out=out if merge_here else None,
                          prefetch=bool(prefetch), value_f16=bool(vf16), value_flush=vflush, score_f16=qf16,
                          refine=refine if launch.refine else None,
                          refine_values=refine_values if launch.refine else None)
            if merge_here:
                return out
        if beside:
            with torch.cuda.stream(side):
                launch_split()
            main.wait_stream(side)  # join: the merge reads the tier's partials
    chunk = min(cfg.merge_chunk, triton.next_power_of_2(ns))  # slots merged per step
    final, rot = out, out_rotation
    if rot is not None and not merge_rotates(b_sz * hq, cfg):  # the plain merge, then one rotation launch
        out, rot = torch.empty_like(final), None
    # small batches: more programs for many slots; with a rotation of the output every program merges the whole
    # row and turns back merge_slice columns of it (also under the interpreter, so that the tests see DB < D)
    db = d if (b_sz * hq >= 1024 or _interpreting()) and rot is None else min(d, cfg.merge_slice)
    _merge_kernel[(b_sz * hq, d // db)](o_part, m_part, l_part, out, ns,
                                        rot if rot is not None else o_part, hq, D=d, DB=db,
                                        CHUNK=chunk, STATIC_STEPS=-(-ns // chunk) if _interpreting() else 0,
                                        ROT=rot is not None,
                                        GROUP=hq // rot.shape[0] if rot is not None else 1,
                                        K=rot.shape[1] if rot is not None else 0)
    if out is not final:
        from rotkv.kernels.rotate import rotate_bf16x2

        rotate_bf16x2(out[:, :, None], out_rotation, out=final[:, :, None])
    return final
