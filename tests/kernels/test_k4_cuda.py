"""The CUDA body kernel's INT4-key build (ROTKV_K4, the ``cuda_key4`` switch): layers with INT4 keys and INT2
values (oscar-mix's and oscar-refine's 4-bit-key layers).

On any machine: the kernel's key operands emulated on the bytes of ``rotkv.quant.packing.pack(codes, 4)`` (the
thread's loads at row stride D/2, the plane nibbles of the int8 and fp16 products, and the refined tile's H / L
words they equal), and the dequantization convention the kernel assumes (element = lo + s c). On a CUDA GPU: the
kernel against the PyTorch reference, with and without the values' refine ring, for every score form, value
metadata and partial merging (the plan's CPU side: tests/test_plan.py)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_kernels import _build  # noqa: E402

from rotkv import switches  # noqa: E402
from rotkv.kernels import plan as kplan  # noqa: E402
from rotkv.kernels.body import RefineTier  # noqa: E402
from rotkv.kernels.decode import DecodeConfig, decode_attention  # noqa: E402
from rotkv.kernels.reference import decode_reference  # noqa: E402
from rotkv.quant.packing import pack  # noqa: E402
from rotkv.quant.quantizer import QuantizedRows, dequantize  # noqa: E402

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
M32 = 0xFFFFFFFF


# ---- the kernel's index maps (int2_decode.cu KMap<D>), for thread lane t = 0..3 ---------------------
def kw_count(d):
    return {64: 1, 128: 2, 256: 4}[d]


def byte_off(d, t, w):
    if d == 64:
        return 4 * t
    if d == 128:
        return 8 * t + 4 * w
    return 32 * (w >> 1) + 8 * t + 4 * (w & 1)


def chunk_map(d, cc, t):
    """(lo word, hi word, lo plane, hi plane, lo dim, hi dim) of chunk cc (32 dims) for lane t."""
    if d == 64:
        return 0, 0, 2 * cc, 2 * cc + 1, 2 * cc * 16 + 4 * t, (2 * cc + 1) * 16 + 4 * t
    if d == 128:
        return 0, 1, cc, cc, 32 * cc + 8 * t, 32 * cc + 8 * t + 4
    c = cc & 1
    base = 64 * (cc >> 1) + 32 * c + 8 * t
    return 2 * c, 2 * c + 1, cc >> 1, cc >> 1, base, base + 4


def word(row: torch.Tensor, o: int) -> int:
    """The little-endian 32-bit word at byte offset o of a uint8 row."""
    b = row[o:o + 4].tolist()
    return b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24


def load_words(row: torch.Tensor, d: int, t: int) -> tuple[list[int], list[int]]:
    """The thread's key words of one token as the K4 build loads them (load_kw at the thread's base
    byte_off(t, 0) of a D/2-byte row: one word, or 8-byte pairs 32 bytes apart), and kx at base + D/4."""
    base, kw_n = byte_off(d, t, 0), kw_count(d)
    offs = [base] if kw_n == 1 else [base + 32 * (w >> 1) + 4 * (w & 1) for w in range(kw_n)]
    return [word(row, o) for o in offs], [word(row, o + d // 4) for o in offs]


def prmt_lanes(x: int, sel: int) -> int:
    """prmt.b32(x, 0, sel) for sel 0x4140 (bytes 0, 1) and 0x4342 (bytes 2, 3): a byte in each 16-bit lane."""
    lo = 0 if sel == 0x4140 else 2
    return ((x >> 8 * lo) & 0xFF) | ((x >> 8 * (lo + 1)) & 0xFF) << 16


@pytest.mark.parametrize("d", [64, 128, 256])
def test_int4_words_are_the_refined_tiles_merged_codes(d):
    """The INT2-layout word at byte offset o of an INT4 row's high and low bits: H = ((a >> 2) & 0x33333333) |
    (b & 0xCCCCCCCC), L = (a & 0x33333333) | ((b << 2) & 0xCCCCCCCC), a and b the INT4 row's words at o and
    o + D/4; so an INT4 tile is a refined tile with base H and ring L (codes 4 h + j)."""
    gen = torch.Generator().manual_seed(d)
    codes = torch.randint(0, 16, (37, d), generator=gen, dtype=torch.uint8)
    p4, ph, pl = pack(codes, 4), pack(codes >> 2, 2), pack(codes & 3, 2)
    assert p4.shape[-1] == d // 2 and ph.shape[-1] == d // 4
    for n in range(codes.shape[0]):
        for o in range(0, d // 4, 4):
            a, b = word(p4[n], o), word(p4[n], o + d // 4)
            h = ((a >> 2) & 0x33333333) | (b & 0xCCCCCCCC)
            lo = (a & 0x33333333) | ((b << 2) & 0xCCCCCCCC & M32)
            assert h == word(ph[n], o) and lo == word(pl[n], o), (n, o)
    # the same in vectorized uint32 words (all rows at once)
    w4 = p4.view(torch.int32).to(torch.int64) & M32
    nw = d // 16
    a, b = w4[:, :nw], w4[:, nw:2 * nw]
    hw = ((a >> 2) & 0x33333333) | (b & 0xCCCCCCCC)
    lw = (a & 0x33333333) | ((b << 2) & 0xCCCCCCCC)
    assert torch.equal(hw, ph.view(torch.int32).to(torch.int64) & M32)
    assert torch.equal(lw, pl.view(torch.int32).to(torch.int64) & M32)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_k4_operands_hold_the_dims_the_query_fragments_cover(d):
    """Every key operand the K4 build feeds its MMAs, emulated from the loaded words: the int8 product's bytes
    (chunk cc: plane i's nibbles, kw for planes 0 and 2, kx for 1 and 3) are the codes of the dims of the query
    fragments qb0 / qb1; the fp16 products' 16-bit lanes are 4^i c <= 960 of the dims of qh0 / qh1 (plane i,
    word w), exactly representable in both operand makers (subnormal, and 1024 + x minus 1024)."""
    gen = torch.Generator().manual_seed(100 + d)
    codes = torch.randint(0, 16, (16, d), generator=gen, dtype=torch.uint8)
    codes[0], codes[1] = 15, 0  # the extremes
    p4 = pack(codes, 4)
    masks = (0x000F000F, 0x003C003C, 0x00F000F0, 0x03C003C0)
    for n in range(codes.shape[0]):
        c = codes[n].tolist()
        for t in range(4):
            kw, kx = load_words(p4[n], d, t)
            assert kw == [word(p4[n], byte_off(d, t, w)) for w in range(kw_count(d))]
            # int8 query (m16n8k32): a0 / a2 bytes e are k = 4t + e / 16 + 4t + e
            for cc in range(d // 32):
                lw, hw, lp, hp, ld, hd = chunk_map(d, cc, t)
                nib = lambda w, i: ((kx[w] if i & 1 else kw[w]) >> (4 * (i >> 1))) & 0x0F0F0F0F  # noqa: E731
                a0, a2 = nib(lw, lp), nib(hw, hp)
                assert [(a0 >> 8 * e) & 0xFF for e in range(4)] == c[ld:ld + 4], (n, t, cc)
                assert [(a2 >> 8 * e) & 0xFF for e in range(4)] == c[hd:hd + 4], (n, t, cc)
                assert ld // (d // 4) == lp and hd // (d // 4) == hp  # the plane of the dims
            # fp16 query (m16n8k16 per word w and plane i): lanes (byte 0, 1) and (2, 3) of the plane's word
            for w in range(kw_count(d)):
                for i in range(4):
                    d0 = i * (d // 4) + byte_off(d, t, w)
                    for sel, dims in ((0x4140, (d0, d0 + 1)), (0x4342, (d0 + 2, d0 + 3))):
                        v = prmt_lanes(kx[w] if i & 1 else kw[w], sel)
                        m = (v << 2 if i & 1 else v) & masks[i]
                        lanes = [m & 0xFFFF, m >> 16]
                        assert lanes == [4 ** i * c[k] for k in dims], (n, t, w, i)
                        assert max(lanes) <= 960
                        # QF16 = 2: fp16 (1024 + x) - 1024 == x; QF16 = 1: the subnormal x * 2^-24
                        half = torch.tensor([x | 0x6400 for x in lanes], dtype=torch.int16).view(torch.float16)
                        assert (half.float() - 1024).tolist() == [float(x) for x in lanes]
                        sub = torch.tensor(lanes, dtype=torch.int16).view(torch.float16).float()
                        assert (sub * 2.0 ** 24).tolist() == [float(x) for x in lanes]


@pytest.mark.parametrize("d,g", [(64, 64), (128, 32)])
def test_int4_keys_dequantize_as_lo_plus_scale_times_code(d, g):
    """The convention the K4 build assumes (the page's own scale and minimum, no refine offset): a 4-bit key
    element is lo + s c, so q . k = sum_g s_g (q_g . c_g) + sum_g lo_g sum(q_g) (the kernel's score split)."""
    gen = torch.Generator().manual_seed(d + g)
    codes = torch.randint(0, 16, (5, d), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(5, d // g, generator=gen) + 0.1).half()
    lo = (torch.randn(5, d // g, generator=gen)).half()
    x = dequantize(QuantizedRows(pack(codes, 4), scale, lo, 4, g))
    s, m = scale.float().repeat_interleave(g, -1), lo.float().repeat_interleave(g, -1)
    assert torch.equal(x, m + s * codes.float())
    q = torch.randn(d, generator=gen, dtype=torch.float64)
    cg, qg = codes.double().view(5, d // g, g), q.view(d // g, g)
    split = (scale.double() * (cg * qg).sum(-1)).sum(-1) + (lo.double() * qg.sum(-1)).sum(-1)
    assert torch.allclose(split, x.double() @ q, rtol=1e-9, atol=1e-9)


# ---- on the GPU ---------------------------------------------------------------------------------------
CASES = [  # (body lens, tier lens, kv heads, n_rep, head_dim, group, page, score, ring pages, every)
    # SmolLM2's layout (fp16 query); an empty request, one shorter than a page, one of exactly a page
    ([300, 0, 9, 16], [5, 20, 3, 0], 3, 3, 64, 64, 16, "bf16", 4, 0),
    ([300, 0, 9, 16], [5, 20, 3, 0], 3, 3, 64, 64, 16, "int8", 4, 0),
    # Qwen3-8B's layout (int8 query), 2 groups; one refined page per 3
    ([700, 45], [9, 4], 2, 4, 128, 64, 16, "int8", 8, 3),
    ([500, 33, 7], [3, 2, 1], 2, 2, 64, 32, 16, "bf16", 3, 1),  # 2 groups at head_dim 64
    ([400, 130], [4, 4], 1, 8, 128, 32, 32, "int8", 5, 2),  # 4 groups, 32-token pages, GQA 8
    ([260, 90, 0], [4, 1, 2], 2, 1, 128, 128, 16, "bf16", 4, 0),  # the fp16 query at head_dim 128, GQA 1
    ([333, 12], [6, 0], 2, 2, 256, 64, 16, "int8", 4, 0),  # head_dim 256, 4 groups
]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _decode(q, body, table, ml, tier, ttable, tml, cfg, ring, key4, mode="kernel"):
    with switches.override(cuda_key4=key4, refine_split=mode):
        plan = kplan.plan_decode(q, body, cfg, (False, ring is not None))
        launch = plan.launch(q.shape[0] * body.kv_heads * ml)
        out = decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg, plan=plan, refine_values=ring)
    return out, launch, plan


@cuda_only
@pytest.mark.parametrize("fuse", ["none", "block", "all"])
@pytest.mark.parametrize("v_meta", ["fp16", "e4m3"])
@pytest.mark.parametrize("refined", [False, True])
@pytest.mark.parametrize("lens,tier_lens,h,rep,d,g,p,score,k,every", CASES)
def test_cuda_k4_kernel_matches_the_reference(lens, tier_lens, h, rep, d, g, p, score, k, every, refined, v_meta,
                                              fuse):
    meta = torch.float8_e4m3fn if v_meta == "e4m3" else torch.float16
    if meta == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 metadata needs compute capability 8.9+")
    body, table, tier, ttable, ml, tml = _build(lens, tier_lens, h, d, g, p, 16, "cuda", seed=k + d, bits=(4, 2),
                                                v_meta=meta)
    assert body.bits == (4, 2) and body.k.codes.shape[-1] == d // 2
    q = torch.randn(len(lens), h * rep, d, generator=torch.Generator().manual_seed(k + 7)).to("cuda", torch.bfloat16)
    ring = None
    if refined:
        gen = torch.Generator().manual_seed(k + 11)
        ring = RefineTier(torch.randint(0, 256, (len(lens), k, h, p, d // 4), generator=gen, dtype=torch.uint8).cuda(),
                          k, every)
    # the fp16 query's second operand maker (QF16=2) rides on the "block" runs
    cfg = DecodeConfig(backend="auto", score=score, small_work=0, cuda_min_split_tokens=64, cuda_target_warps=64,
                       cuda_fuse=fuse, cuda_score_f16=2 if fuse == "block" else 1)
    out, launch, plan = _decode(q, body, table, ml, tier, ttable, tml, cfg, ring, key4=True)
    assert launch.kernel == "cuda" and kplan.variant_key_bits(launch.cuda_variant) == 4, launch
    assert launch.refine == refined and (not refined or plan.refine_split(len(lens) * h * ml) is None)
    triton, tlaunch, _ = _decode(q, body, table, ml, tier, ttable, tml, cfg, ring, key4=False)
    assert tlaunch.kernel == "triton"
    ref = decode_reference(q.float(), body, table, tier[0], tier[1], ttable, refine_values=ring)
    tol = 2e-2 if score == "int8" else 1e-2
    err, err_triton = _rel(out, ref), _rel(triton, ref)
    assert torch.isfinite(out).all()
    assert err < tol, (err, err_triton)
    assert err < 1.5 * err_triton + 2e-3, (err, err_triton)  # as close as the Triton kernel gets
    if refined:  # the split: v1 over the refined pages, the K4 build over the others
        split, slaunch, splan = _decode(q, body, table, ml, tier, ttable, tml, cfg, ring, key4=True, mode="1")
        assert slaunch.kernel == "cuda" and not slaunch.refine and splan.refine_split(len(lens) * h * ml) is not None
        assert _rel(split, ref) < tol, (_rel(split, ref), err)
        plain = decode_reference(q.float(), body, table, tier[0], tier[1], ttable)
        assert _rel(plain, ref) > 3 * err, (_rel(plain, ref), err)  # the ring counts: the test can fail


@cuda_only
def test_cuda_k4_kernel_without_the_switch_runs_triton_and_refuses_a_key_ring():
    body, table, tier, ttable, ml, tml = _build([100, 20], [3, 4], 2, 64, 64, 16, 16, "cuda", seed=1, bits=(4, 2))
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(2)).to("cuda", torch.bfloat16)
    cfg = DecodeConfig(small_work=0)
    _, launch, _ = _decode(q, body, table, ml, tier, ttable, tml, cfg, None, key4=False)
    assert launch.kernel == "triton"
    from rotkv.kernels.cuda_decode import body_partials

    o = torch.empty(2, 6, 4, 64, device="cuda")
    m, l_ = torch.empty(2, 6, 4, device="cuda"), torch.empty(2, 6, 4, device="cuda")
    ring = RefineTier(torch.zeros(2, 2, 2, 16, 16, dtype=torch.uint8, device="cuda"), 2)
    with pytest.raises(ValueError, match="refines INT2 keys, not INT4"):
        body_partials(q, body, table, o, m, l_, 4, 32, 1.0, tiles=1, value_f16=True, refine=ring)
