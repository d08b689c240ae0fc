"""Rotation of bf16 heads by a split bf16 matrix (Triton): ``y = (x - mu) R`` without a copy of ``x``.

The GPU arithmetic of ``rotkv.rotations.base`` ("bf16x2", its docstring has the precision): the
matrix is stored as ``[R_hi; R_lo (; -c_hi; -c_lo; 0 x 6)]`` (:func:`~rotkv.rotations.base.bf16x2_matrix`)
and ``y = x R_hi + x R_lo (- c_hi - c_lo)`` with float32 accumulation, rounded to bf16 once. Its
PyTorch form (``_rotate_bf16x2``) feeds cuBLAS ``[x, x (, 1, 1, 0..)]``: a concatenated copy of
``x`` at twice its size, a visible share of an INT2 prefill (docs/kernel-notes.md). Here one program loads a ``[BLOCK_T, D]`` tile of one head straight from
the caller's strides (the projections' ``[B, T, H, D]`` memory seen as ``[B, H, T, D]``) and runs
two ``tl.dot`` per K block into one float32 accumulator: reads ``x`` once, writes ``y`` once. With one token per
row (a decode step) a program instead takes 16 batch rows of one head, so that the head's matrix is loaded once for
them rather than once per row.

Heads come in groups: query head ``h`` uses matrix ``h // (Hq // H)`` (GQA), as ``_per_group``.

``rows`` (the CUDA-graph decode step): each batch row's result goes to its own place in ``out``, an
element offset per row (a tier page and slot, ``page * stride0 + slot * stride2`` of the
``[pages, H, P, D]`` pool), so the rotated key or value of a decode token is written straight into
the cache's tier: no ``[B, H, 1, D]`` temporary and no scatter kernel after it.

:func:`rotate_many` runs up to three such rotations (a decode step's keys, values and queries) in one launch,
each job's (row, head) pairs a range of the grid's first axis.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rotkv.kernels.plan import interpreting, require_rotate, rotate_block


@triton.jit
def _times_matrix(xrow, xmask, a, offs_e, ROWS: tl.constexpr, D: tl.constexpr, SHIFT: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr):
    """``[ROWS, BLOCK_E]`` float32: the rows at ``xrow`` (pointers ``[ROWS, 1]``, ``xmask`` ``[ROWS]``) times the split
    matrix at ``a`` (``R_hi``, ``R_lo`` and, with SHIFT, the shift rows), columns ``offs_e``; under the interpreter
    already rounded to bf16's nearest-even (its float32 -> bf16 cast truncates)."""
    acc = tl.zeros((ROWS, BLOCK_E), dtype=tl.float32)
    for k0 in tl.static_range(0, D, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(xrow + offs_k[None, :], mask=xmask[:, None], other=0.0)
        hi = tl.load(a + offs_k[:, None] * D + offs_e[None, :])
        lo = tl.load(a + (D + offs_k)[:, None] * D + offs_e[None, :])
        if F32_DOT:  # the interpreter's bf16 dot is wrong; bf16 products are exact in float32 anyway
            xf = x.to(tl.float32)
            acc += tl.dot(xf, hi.to(tl.float32), input_precision="ieee")  # (its dot drops an accumulator)
            acc += tl.dot(xf, lo.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(x, hi, acc)
            acc = tl.dot(x, lo, acc)
    if SHIFT:  # rows 2D and 2D + 1: -c_hi and -c_lo (c = mu R)
        acc += tl.load(a + 2 * D * D + offs_e).to(tl.float32)[None, :]
        acc += tl.load(a + (2 * D + 1) * D + offs_e).to(tl.float32)[None, :]
    if F32_DOT:
        acc = round_bf16(acc)
    return acc


@triton.jit
def round_bf16(x):
    """float32 ``x`` rounded to bf16's nearest even, still float32: what a GPU's cast does, for the interpreter,
    whose float32 -> bf16 cast truncates."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rotate_tile(x_ptr, sxb, sxh, sxt, a_ptr, y_ptr, syb, syh, syt, rows_ptr, b, h, pid_t, pid_e, T,
                 GROUP: tl.constexpr, D: tl.constexpr, K: tl.constexpr, SHIFT: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, HAS_ROWS: tl.constexpr):
    """Tokens ``pid_t * BLOCK_T ..`` of head ``h`` of batch row ``b``, output columns ``pid_e * BLOCK_E ..``."""
    a = a_ptr + (h // GROUP).to(tl.int64) * (K * D)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    tmask = offs_t < T
    xrow = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + offs_t.to(tl.int64)[:, None] * sxt
    acc = _times_matrix(xrow, tmask, a, offs_e, BLOCK_T, D, SHIFT, BLOCK_E, BLOCK_K, F32_DOT)
    if HAS_ROWS:  # each row's own place in y (a tier slot)
        ybase = y_ptr + tl.load(rows_ptr + b)
    else:
        ybase = y_ptr + b.to(tl.int64) * syb
    yrow = ybase + h.to(tl.int64) * syh + offs_t.to(tl.int64)[:, None] * syt
    tl.store(yrow + offs_e[None, :], acc.to(tl.bfloat16), mask=tmask[:, None])


@triton.jit
def _rotate_rows_tile(x_ptr, sxb, sxh, a_ptr, y_ptr, syb, syh, rows_ptr, B, h, pid_b, pid_e,
                      GROUP: tl.constexpr, D: tl.constexpr, K: tl.constexpr, SHIFT: tl.constexpr, BLOCK_B: tl.constexpr,
                      BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, HAS_ROWS: tl.constexpr):
    """One token per row (a decode step): batch rows ``pid_b * BLOCK_B ..`` of head ``h``, output columns
    ``pid_e * BLOCK_E ..``. The rows of one head share its matrix, so a program loads it once for BLOCK_B rows
    (the per-row tile loads it for every row and fills one of its 16 dot rows)."""
    a = a_ptr + (h // GROUP).to(tl.int64) * (K * D)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    bmask = offs_b < B
    xrow = x_ptr + offs_b.to(tl.int64)[:, None] * sxb + h.to(tl.int64) * sxh
    acc = _times_matrix(xrow, bmask, a, offs_e, BLOCK_B, D, SHIFT, BLOCK_E, BLOCK_K, F32_DOT)
    if HAS_ROWS:
        ybase = y_ptr + tl.load(rows_ptr + offs_b, mask=bmask, other=0)
    else:
        ybase = y_ptr + offs_b.to(tl.int64) * syb
    yrow = ybase[:, None] + h.to(tl.int64) * syh
    tl.store(yrow + offs_e[None, :], acc.to(tl.bfloat16), mask=bmask[:, None])


@triton.jit
def _tile(x_ptr, sxb, sxh, sxt, a_ptr, y_ptr, syb, syh, syt, rows_ptr, pid, pid_t, pid_e, T, HQ, NB,
          GROUP: tl.constexpr, D: tl.constexpr, K: tl.constexpr, SHIFT: tl.constexpr, BLOCK_T: tl.constexpr,
          BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, HAS_ROWS: tl.constexpr,
          BY_HEAD: tl.constexpr, B):
    """Program ``pid`` of one job: BY_HEAD (one token per row) head ``pid // NB``, row block ``pid % NB``; else
    row ``pid // HQ``, head ``pid % HQ``."""
    if BY_HEAD:
        _rotate_rows_tile(x_ptr, sxb, sxh, a_ptr, y_ptr, syb, syh, rows_ptr, B, pid // NB, pid % NB, pid_e,
                          GROUP, D, K, SHIFT, BLOCK_T, BLOCK_E, BLOCK_K, F32_DOT, HAS_ROWS)
    else:
        _rotate_tile(x_ptr, sxb, sxh, sxt, a_ptr, y_ptr, syb, syh, syt, rows_ptr, pid // HQ, pid % HQ, pid_t, pid_e,
                     T, GROUP, D, K, SHIFT, BLOCK_T, BLOCK_E, BLOCK_K, F32_DOT, HAS_ROWS)


@triton.jit
def _rotate_kernel(x_ptr, sxb, sxh, sxt, a_ptr, y_ptr, syb, syh, syt, rows_ptr, T, HQ, B, NB,
                   GROUP: tl.constexpr, D: tl.constexpr, K: tl.constexpr, SHIFT: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
                   HAS_ROWS: tl.constexpr, BY_HEAD: tl.constexpr):
    pid, pid_t, pid_e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    _tile(x_ptr, sxb, sxh, sxt, a_ptr, y_ptr, syb, syh, syt, rows_ptr, pid, pid_t, pid_e, T, HQ, NB,
          GROUP, D, K, SHIFT, BLOCK_T, BLOCK_E, BLOCK_K, F32_DOT, HAS_ROWS, BY_HEAD, B)


@triton.jit
def _rotate3_kernel(x0, sxb0, sxh0, sxt0, a0, y0, syb0, syh0, syt0, r0, T0, HQ0, B0, NB0,
                    x1, sxb1, sxh1, sxt1, a1, y1, syb1, syh1, syt1, r1, T1, HQ1, B1, NB1,
                    x2, sxb2, sxh2, sxt2, a2, y2, syb2, syh2, syt2, r2, T2, HQ2, B2, NB2, N0, N01,
                    GROUP0: tl.constexpr, K0: tl.constexpr, SHIFT0: tl.constexpr, ROWS0: tl.constexpr,
                    GROUP1: tl.constexpr, K1: tl.constexpr, SHIFT1: tl.constexpr, ROWS1: tl.constexpr,
                    GROUP2: tl.constexpr, K2: tl.constexpr, SHIFT2: tl.constexpr, ROWS2: tl.constexpr,
                    D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                    F32_DOT: tl.constexpr, BY_HEAD: tl.constexpr):
    """Up to three rotations in one launch: programs ``0 .. N0 - 1`` are job 0's, ``N0 .. N01 - 1`` job 1's, the
    rest job 2's (a job with no rows gets no program)."""
    pid, pid_t, pid_e = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if pid < N0:
        _tile(x0, sxb0, sxh0, sxt0, a0, y0, syb0, syh0, syt0, r0, pid, pid_t, pid_e, T0, HQ0, NB0,
              GROUP0, D, K0, SHIFT0, BLOCK_T, BLOCK_E, BLOCK_K, F32_DOT, ROWS0, BY_HEAD, B0)
    elif pid < N01:
        _tile(x1, sxb1, sxh1, sxt1, a1, y1, syb1, syh1, syt1, r1, pid - N0, pid_t, pid_e, T1, HQ1, NB1,
              GROUP1, D, K1, SHIFT1, BLOCK_T, BLOCK_E, BLOCK_K, F32_DOT, ROWS1, BY_HEAD, B1)
    else:
        _tile(x2, sxb2, sxh2, sxt2, a2, y2, syb2, syh2, syt2, r2, pid - N01, pid_t, pid_e, T2, HQ2, NB2,
              GROUP2, D, K2, SHIFT2, BLOCK_T, BLOCK_E, BLOCK_K, F32_DOT, ROWS2, BY_HEAD, B2)


def _block_t(t: int, d: int) -> int:
    """Tokens per program: 16 (tl.dot's least) for a decode step's few tokens, else 64 (32 above head_dim 128);
    with one token per row (:func:`_programs`), the rows per program of one head."""
    if t <= 16:
        return 16
    return 64 if d <= 128 else 32


def _programs(b: int, hq: int, t: int, block_t: int, by_head: bool) -> tuple[int, int]:
    """(programs on the grid's first axis, row blocks per head) of one job: ``by_head`` (one token per row, a
    decode step) a program takes ``block_t`` rows of one head (the matrix loaded once for them), else one (row,
    head)."""
    if by_head:
        nb = triton.cdiv(b, block_t)
        return hq * nb, nb
    return (b * hq if t else 0), 1


def _check_out(x: torch.Tensor, a: torch.Tensor, out: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor:
    """The checked destination of one rotation (:func:`rotate_bf16x2`'s contract); allocates it where ``out``
    is None."""
    require_rotate(x, a)
    b, hq, t, d = x.shape
    y = torch.empty(b, hq, t, d, dtype=torch.bfloat16, device=x.device) if out is None else out
    if rows is not None:
        if out is None or out.dim() != 4 or out.dtype != torch.bfloat16 or out.shape[1] != hq \
                or out.shape[2] < t or out.shape[3] != d or out.stride(-1) != 1:
            raise ValueError(f"rotate_bf16x2: rows need an out [N, {hq}, >= {t}, {d}] bf16 pool, got "
                             f"{None if out is None else (tuple(out.shape), out.dtype)}")
        if rows.dtype != torch.int64 or rows.shape != (b,) or rows.device != x.device:
            raise ValueError(f"rotate_bf16x2: rows has to be int64 [{b}] on {x.device}")
    elif y.shape != x.shape or y.stride(-1) != 1:
        raise ValueError(f"rotate_bf16x2: out {tuple(y.shape)} does not fit x {tuple(x.shape)}")
    return y


def rotate_bf16x2(x: torch.Tensor, a: torch.Tensor, out: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """``x [B, Hq, T, D]`` bf16 (any strides, last dim contiguous) -> ``(x - mu) R`` per head group,
    bf16 ``[B, Hq, T, D]`` (contiguous, or ``out``). ``a``: :func:`~rotkv.rotations.base.bf16x2_matrix`.
    ``rows`` (int64 ``[B]``, with ``out``): row ``b``'s result starts ``rows[b]`` elements into
    ``out``, whose dims 1 and 2 are the heads and the tokens (``out [N, Hq, >= T, D]``, a tier pool)."""
    y = _check_out(x, a, out, rows)
    a = a.contiguous()
    if x.numel() == 0:
        return y
    b, hq, t, d = x.shape
    blk, block_t = rotate_block(d), _block_t(t, d)
    n, nb = _programs(b, hq, t, block_t, t == 1)
    grid = (n, triton.cdiv(t, block_t), d // blk)  # rows x heads on axis 0 (the others cap at 65535)
    _rotate_kernel[grid](x, x.stride(0), x.stride(1), x.stride(2), a, y, y.stride(0), y.stride(1), y.stride(2),
                         rows if rows is not None else y, t, hq, b, nb, GROUP=hq // a.shape[0], D=d, K=a.shape[1],
                         SHIFT=a.shape[1] > 2 * d, BLOCK_T=block_t, BLOCK_E=blk, BLOCK_K=blk,
                         F32_DOT=interpreting(), HAS_ROWS=rows is not None, BY_HEAD=t == 1, num_warps=4)
    return y


def rotate_many(jobs) -> None:
    """Up to three rotations of one head_dim in one launch: ``jobs`` a list of ``(x, a, out, rows)``, each
    :func:`rotate_bf16x2`'s arguments with ``out`` given (its contract, checked for every job before anything
    is written). A decode step's keys, values and queries thus cost one launch instead of three."""
    jobs = list(jobs)
    if not 1 <= len(jobs) <= 3:
        raise ValueError(f"rotate_many: 1 to 3 jobs, got {len(jobs)}")
    if any(out is None for _, _, out, _ in jobs):
        raise ValueError("rotate_many: every job writes into its given out")
    d = jobs[0][0].shape[-1]
    if any(x.shape[-1] != d for x, _, _, _ in jobs) or len({x.device for x, _, _, _ in jobs}) != 1:
        raise ValueError("rotate_many: the jobs' head_dims and devices have to agree")
    args, consts, counts = [], {}, []
    t_max = max(x.shape[2] for x, _, _, _ in jobs)
    by_head = all(x.shape[2] == 1 for x, _, _, _ in jobs)  # a decode step: a program per head and row block
    blk, block_t = rotate_block(d), _block_t(t_max, d)
    for i, (x, a, out, rows) in enumerate(jobs):
        _check_out(x, a, out, rows)
        b, hq, t, _ = x.shape
        a = a.contiguous()
        n, nb = _programs(b, hq, t, block_t, by_head)
        counts.append(n)
        args += [x, x.stride(0), x.stride(1), x.stride(2), a, out, out.stride(0), out.stride(1), out.stride(2),
                 rows if rows is not None else out, t, hq, b, nb]
        consts.update({f"GROUP{i}": hq // a.shape[0], f"K{i}": a.shape[1], f"SHIFT{i}": a.shape[1] > 2 * d,
                       f"ROWS{i}": rows is not None})
    for i in range(len(jobs), 3):  # absent jobs: job 0's arguments, no programs
        args += args[:14]
        counts.append(0)
        consts.update({f"GROUP{i}": consts["GROUP0"], f"K{i}": consts["K0"], f"SHIFT{i}": consts["SHIFT0"],
                       f"ROWS{i}": consts["ROWS0"]})
    if sum(counts) == 0 or t_max == 0:
        return
    grid = (sum(counts), triton.cdiv(t_max, block_t), d // blk)
    _rotate3_kernel[grid](*args, counts[0], counts[0] + counts[1], D=d, BLOCK_T=block_t, BLOCK_E=blk, BLOCK_K=blk,
                          F32_DOT=interpreting(), BY_HEAD=by_head, num_warps=4, **consts)
