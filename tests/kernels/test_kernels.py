"""Triton kernels vs their PyTorch references (rotkv.kernels.reference).

On a CPU machine the grid is small (the interpreter takes seconds per launch); on CUDA the
``cuda``-marked cases add long, multi-split and >2**31-byte-offset cases.
"""

import dataclasses
import random

import pytest
import torch

triton = pytest.importorskip("triton")

from paged_fixture import Bf16PagePool, Int2PagePool, PageTable, lengths_from_table  # noqa: E402
from rotkv.kernels.body import PagedBody, TokenPart  # noqa: E402
from rotkv.kernels.decode import DecodeConfig, decode_attention  # noqa: E402
from rotkv.kernels.dequant import dequant_dense  # noqa: E402
from rotkv.kernels.reference import decode_reference, dequant_rows, quant_write_reference  # noqa: E402
from rotkv.kernels.write import clip_rank, quant_write  # noqa: E402
from rotkv.quant.packing import unpack  # noqa: E402
from rotkv.rotations.identity import random_orthogonal  # noqa: E402

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def _pool_bufs(np_, h, p, d, g, device, bits=2, meta=torch.float16):
    """A body part filled with poison (codes 0xAB, scale and lo 7.0)."""
    return TokenPart(torch.full((np_, h, p, d * bits // 8), 0xAB, dtype=torch.uint8, device=device),
                     torch.full((np_, h, p, d // g), 7.0, dtype=torch.float16, device=device).to(meta),
                     torch.full((np_, h, p, d // g), 7.0, dtype=torch.float16, device=device).to(meta), bits, g, d)


def _to(part, device):
    return TokenPart(*(t.to(device) for t in part.tensors), part.bits, part.group_size, part.head_dim)


def _rows(t, h, d, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, h, d, generator=g) * 2 + 0.3).to(torch.bfloat16)
    if t > 2:
        x[0, 0] = 1.0  # a constant row: scale 0 after clipping, every |x| tied
        x[1, 0, :7] = 9.0  # ties at the clipping threshold
    return x.to(device)


WRITE_CASES = [  # (head_dim, group, clip, rotate, tokens)
    (64, 32, 0.96, True, 37),
    (128, 64, 0.92, True, 33),
    (128, 128, 1.0, False, 1),
    (256, 64, 0.96, True, 17),
]
WRITE_CASES_CUDA = [(128, 64, 0.96, True, 4097), (128, 32, 0.92, False, 1000), (256, 256, 0.96, True, 300)]


def _check_write(d, g, clip, rotate, t, device, seed=0, bits=2, backend=None, rot_precision=None, dtype=torch.bfloat16,
                 meta=torch.float16):
    h, p = 2, 16
    np_ = -(-t // p) + 2
    x = _rows(t, h, d, device, seed).to(dtype)
    rot = torch.stack([random_orthogonal(d, seed + i) for i in range(h)]).to(device) if rotate else None
    mean = (torch.randn(h, d, generator=torch.Generator().manual_seed(seed)) * 0.5).to(device) if rotate else None
    slots = torch.randperm(np_ * p, generator=torch.Generator().manual_seed(seed))[:t].to(device)
    got, want = _pool_bufs(np_, h, p, d, g, device, bits, meta), _pool_bufs(np_, h, p, d, g, device, bits, meta)
    quant_write(x, slots, got, rot=rot, mean=mean, clip=clip, backend=backend, rot_precision=rot_precision)
    # the reference runs on the CPU: PyTorch's CUDA division by a Python scalar multiplies by the
    # reciprocal, so the quantizer's fp32 scale can differ by an ulp on a GPU (then its fp16 one too)
    want_cpu = _to(want, "cpu")
    quant_write_reference(x.cpu(), slots.cpu(), want_cpu, rot=None if rot is None else rot.cpu(),
                          mean=None if mean is None else mean.cpu(), clip=clip)
    want = _to(want_cpu, device)
    # untouched slots keep their poison, written ones equal the reference
    untouched = torch.ones(np_ * p, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert (got.codes.permute(0, 2, 1, 3).reshape(np_ * p, -1)[untouched] == 0xAB).all()
    codes_mismatch = (unpack(got.codes, bits) != unpack(want.codes, bits)).float().mean().item()
    if rotate and device != "cpu" and rot_precision == "bf16":
        # one bf16 product: R rounded to 8 bits of mantissa moves some values across a code boundary
        assert codes_mismatch < 5e-2, codes_mismatch
        deq_got, deq_want = dequant_rows(*got.tensors, bits, g), dequant_rows(*want.tensors, bits, g)
        step = want.scale.float().repeat_interleave(g, dim=-1)
        assert ((deq_got - deq_want).abs() <= 1.01 * step + 1e-2).all()
    elif rotate and device != "cpu":
        # the kernel rotates in 3xTF32 (Triton) or with R as two bf16 parts (CUDA, about 2^-17 of
        # each value), the reference in fp32: codes, and fp16 scales more often (11 bits), may round
        # the other way at ties
        assert codes_mismatch < 2e-3, codes_mismatch
        assert (got.scale != want.scale).float().mean().item() < 1e-2
        assert (got.lo != want.lo).float().mean().item() < 1e-2
    else:
        assert codes_mismatch == 0.0
        assert torch.equal(got.scale.view(torch.uint8), want.scale.view(torch.uint8))
        assert torch.equal(got.lo.view(torch.uint8), want.lo.view(torch.uint8))
    return codes_mismatch


@pytest.mark.parametrize("bits_k,bits_v,meta,side_dtype", [(2, 2, torch.float16, torch.bfloat16),
                                                         (4, 2, torch.float16, torch.float32),
                                                         (2, 2, torch.float8_e4m3fn, torch.bfloat16)])
def test_flush_pages_equals_quant_write_of_the_gathered_pages(bits_k, bits_v, meta, side_dtype, device, fp8_kernels):
    """``flush_pages`` (the graphed decode step's flush: keys and values in one launch, each token read at its
    side-pool page and slot): the bytes of ``quant_write`` of the gathered pages, each side at its own width and
    clip; a page bound for block 0 is skipped (its body block keeps its poison); bad index shapes are refused."""
    from rotkv.kernels.write import flush_pages

    if meta == torch.float8_e4m3fn and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 metadata needs sm_89+")
    h, p, d, g, side_pages, nb = 2, 16, 64, 32, 7, 6
    gen = torch.Generator().manual_seed(3)
    sides = [(torch.randn(side_pages, h, p, d, generator=gen) * 2 + 0.3).to(side_dtype).to(device) for _ in range(2)]
    n = 3  # three rows' pages; row 1 flushes none (block 0)
    blocks = torch.tensor([4, 0, 2], device=device)
    page = torch.randint(0, side_pages, (n * p,), generator=gen).to(device)
    off = torch.randint(0, p, (n * p,), generator=gen).to(device)
    slots = (blocks[:, None] * p + torch.arange(p, device=device)[None]).reshape(-1)
    clips = (0.96, 0.92)
    got = [_pool_bufs(nb, h, p, d, g, device, b_, meta) for b_ in (bits_k, bits_v)]
    want = [_pool_bufs(nb, h, p, d, g, device, b_, meta) for b_ in (bits_k, bits_v)]
    flush_pages(sides[0], sides[1], page, off, slots, blocks, got[0], got[1], *clips)
    live = torch.tensor([True, False, True], device=device).repeat_interleave(p)
    for side, part, clip in zip(sides, want, clips):
        quant_write(side[page, :, off][live], slots[live], part, clip=clip, backend="triton")
    for mine, theirs in zip(got, want):
        for a, b_ in zip(mine.tensors, theirs.tensors):
            assert torch.equal(a.view(torch.uint8), b_.view(torch.uint8))
        assert (mine.codes[0] == 0xAB).all()  # block 0: skipped
    with pytest.raises(ValueError, match="page has to be int64"):
        flush_pages(sides[0], sides[1], page[:-1], off, slots, blocks, got[0], got[1])
    with pytest.raises(ValueError, match="side pools"):
        flush_pages(sides[0], sides[1][:, :1], page, off, slots, blocks, got[0], got[1])


@pytest.mark.parametrize("values", [False, True])
def test_flush_pages_writes_the_refine_rings(values, device):
    """``flush_pages`` with refine rings (oscar-refine's graphed flush): the body bytes of the plain flush, and each
    flushed page's refinements (``refine_codes`` of the exact page against its 2-bit reading) at slot ``index % K``
    of its ring row, as ``RefineRing.write`` puts them; a skipped page (block 0) writes no ring bytes; a ring beside
    a 4-bit part is refused."""
    from rotkv.cache.refine import RefineRing
    from rotkv.kernels.write import flush_pages
    from rotkv.quant.quantizer import QuantizedRows, dequantize

    h, p, d, g, side_pages, nb, rows_n, k_pages = 2, 16, 64, 32, 7, 6, 4, 3
    gen = torch.Generator().manual_seed(5)
    sides = [(torch.randn(side_pages, h, p, d, generator=gen) * 2 + 0.3).to(torch.bfloat16).to(device) for _ in range(2)]
    n = 3
    blocks = torch.tensor([4, 0, 2], device=device)
    page = torch.randint(0, side_pages, (n * p,), generator=gen).to(device)
    off = torch.randint(0, p, (n * p,), generator=gen).to(device)
    slots = (blocks[:, None] * p + torch.arange(p, device=device)[None]).reshape(-1)
    target = (torch.tensor([2, 0, 1], device=device), torch.tensor([5, 7, 1], device=device))
    got = [_pool_bufs(nb, h, p, d, g, device) for _ in range(2)]
    rings = [torch.full((rows_n, k_pages, h, p, d // 4), 0xCD, dtype=torch.uint8, device=device) for _ in range(2)]
    use = (rings[0], rings[1] if values else None)
    flush_pages(sides[0], sides[1], page, off, slots, blocks, got[0], got[1], 0.96, 0.92, rings=use,
                ring_target=target)
    plain = [_pool_bufs(nb, h, p, d, g, device) for _ in range(2)]
    flush_pages(sides[0], sides[1], page, off, slots, blocks, plain[0], plain[1], 0.96, 0.92)
    for mine, theirs in zip(got, plain):
        for a, b_ in zip(mine.tensors, theirs.tensors):
            assert torch.equal(a, b_)
    live = [0, 2]  # page 1 goes to block 0: skipped
    for side, part, ring in zip(sides, got, use):
        want = torch.full_like(rings[0], 0xCD)
        if ring is not None:
            ref = RefineRing(k_pages, h, p, d, g, "cpu")
            ref.data, ref.pages = want.cpu(), k_pages
            x = side[page, :, off].view(n, p, h, d).transpose(1, 2)[live].cpu()  # [n, H, P, D] exact pages
            blk = blocks[live].cpu()
            stored = QuantizedRows(part.codes[blk].cpu(), part.scale[blk].cpu(), part.lo[blk].cpu(), 2, g)
            ref.write(x, dequantize(stored), stored.scale, target[0][live].cpu(), target[1][live].cpu())
            assert torch.equal(ring.cpu(), ref.data)
            assert (ref.data != 0xCD).any()
    assert values or bool((rings[1] == 0xCD).all())
    four = _pool_bufs(nb, h, p, d, g, device, bits=4)
    with pytest.raises(ValueError, match="2-bit part"):
        flush_pages(sides[0], sides[1], page, off, slots, blocks, four, got[1], rings=use, ring_target=target)
    with pytest.raises(ValueError, match="ring_target"):
        flush_pages(sides[0], sides[1], page, off, slots, blocks, got[0], got[1], rings=use)


@pytest.mark.parametrize("d,g,clip,rotate,t", WRITE_CASES)
def test_quant_write_matches_reference(d, g, clip, rotate, t, device):
    _check_write(d, g, clip, rotate, t, device)


@pytest.mark.parametrize("d,g,clip,rotate,t", WRITE_CASES[:2] + WRITE_CASES[3:])
def test_quant_write_int4_matches_reference(d, g, clip, rotate, t, device):
    _check_write(d, g, clip, rotate, t, device, bits=4)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("d,g,clip,rotate,t", [WRITE_CASES[0], WRITE_CASES[2]])
def test_quant_write_fp8_metadata_matches_reference(d, g, clip, rotate, t, bits, device, fp8_kernels):
    """e4m3 scale and lo (oscar-mix's values): rounded lo down and scale up as the quantizer does, so
    the stored bytes are the reference's (the kernel steps the conversion's result through its bits)."""
    _check_write(d, g, clip, rotate, t, device, bits=bits, meta=torch.float8_e4m3fn)


@pytest.fixture
def fp8_kernels(monkeypatch):
    """e4m3 metadata in the GPU kernels on (the fp8_kernels switch; the interpreter runs them anyway)."""
    from rotkv import switches

    with switches.override(fp8_kernels=True):
        yield


def test_fp8_metadata_out_of_range_is_nan_where_the_reference_raises(device, fp8_kernels):
    """A group whose lo is below -448 or whose scale is above 448 gets NaN metadata (the pools raise on
    it, as rotkv.quant.quantizer does); groups in range beside it are stored as the reference's."""
    from rotkv.quant.quantizer import _round_meta

    d, g = 64, 16
    x = torch.zeros(4, 1, d)
    x[0, 0, :g] = -500.0  # lo out of range
    x[1, 0, g:2 * g] = torch.linspace(0, 1500, g)  # scale 500
    x[2, 0, :g] = torch.linspace(-448, 0, g)  # the edge: in range
    x[3, 0, :] = torch.linspace(-3, 3, d)
    part = _pool_bufs(2, 1, 16, d, g, device, 2, torch.float8_e4m3fn)
    quant_write(x.to(device), torch.arange(4, device=device), part)
    s = part.scale.cpu().reshape(-1, d // g)[:4].float()
    lo = part.lo.cpu().reshape(-1, d // g)[:4].float()
    assert torch.isnan(lo[0, 0]) and torch.isnan(s[1, 1])
    ok = ~(torch.isnan(s) | torch.isnan(lo))
    assert ok.sum() == 4 * (d // g) - 2 or (ok.sum() == 4 * (d // g) - 3 and torch.isnan(s[0, 0]))
    xg = x.reshape(4, d // g, g)
    for r, c in [(2, 0), (2, 1), (3, 0), (3, 3), (0, 1), (1, 0)]:
        rs, rl = _round_meta(xg[r, c].amin()[None], xg[r, c].amax()[None], 2, "float8")
        assert s[r, c] == rs.float() and lo[r, c] == rl.float()
    with pytest.raises(ValueError, match="range"):
        _round_meta(xg[0, 0].amin()[None], xg[0, 0].amax()[None], 2, "float8")
    # the pools' flag after the write (no sync; RotkvCache.check_metadata_range reads it): page 0 (rows
    # 0-3) holds the NaN groups
    from rotkv.cache.pools import fp8_meta_out_of_range

    assert bool(fp8_meta_out_of_range(part, torch.tensor([0], device=device)))
    fine = _pool_bufs(2, 1, 16, d, g, device, 2, torch.float8_e4m3fn)
    quant_write(x[2:].to(device), torch.arange(2, device=device), fine)
    assert not bool(fp8_meta_out_of_range(fine, torch.tensor([0], device=device)))  # in range


def test_fp8_rounding_steps_every_way(device, fp8_kernels):
    """Values on, between and around e4m3's codes (zeros, subnormals, both signs, the largest finite):
    lo rounds down and scale up exactly as rotkv.quant.quantizer._round_dir."""
    from rotkv.quant.quantizer import _round_meta

    grid = torch.tensor([0.0, 2.0 ** -9, 2.0 ** -8, 0.3, 1.0, 1.0625, 3.3, 100.0, 440.0], dtype=torch.float32)
    vals = torch.cat([grid, -grid, grid * 1.01, -grid * 1.01, grid * 0.99])
    d, g = 64, 16
    x = torch.zeros(len(vals), 1, d)
    x[:, 0, 0::2] = vals[:, None]  # each row's groups span [min(v, 0), max(v, 0)] plus a second value
    x[:, 0, 1::2] = (vals * 0.5)[:, None]
    part = _pool_bufs(len(vals) // 16 + 2, 1, 16, d, g, device, 2, torch.float8_e4m3fn)
    slots = torch.arange(len(vals), device=device)
    quant_write(x.to(device), slots, part)
    xg = x.reshape(len(vals), 1, d // g, g)
    scale, lo = _round_meta(xg.amin(-1), xg.amax(-1), 2, "float8")
    got_s = part.scale.cpu().reshape(-1, 1, d // g)[: len(vals)]
    got_l = part.lo.cpu().reshape(-1, 1, d // g)[: len(vals)]
    assert torch.equal(got_l.view(torch.uint8), lo.view(torch.uint8))
    assert torch.equal(got_s.view(torch.uint8), scale.view(torch.uint8))


def test_quant_write_tf32_rotation_close_to_reference(device, monkeypatch):
    # rot_precision="tf32" (one pass, faster): codes may move near rounding boundaries; on a CPU
    # machine the interpreter's dot is fp32, so the CUDA run is the real check (not run on a GPU yet)
    import rotkv.kernels.write as write_mod

    monkeypatch.setitem(globals(), "quant_write",
                        lambda *a, **k: write_mod.quant_write(*a, rot_precision="tf32", **k))
    x = torch.randn(64, 2, 128, generator=torch.Generator().manual_seed(0)).to(device)
    rot = torch.stack([random_orthogonal(128, i) for i in range(2)]).to(device)
    slots = torch.arange(64, device=device)
    got, want = _pool_bufs(6, 2, 16, 128, 64, device), _pool_bufs(6, 2, 16, 128, 64, device)
    quant_write(x, slots, got, rot=rot, clip=0.96)
    want = _to(want, "cpu")
    quant_write_reference(x.cpu(), slots.cpu(), want, rot=rot.cpu(), clip=0.96)
    mism = (unpack(got.codes, 2).cpu() != unpack(want.codes, 2)).float().mean().item()
    assert mism < 2e-2, mism
    with pytest.raises(ValueError, match="rot_precision"):
        write_mod.quant_write(x, slots, got, rot=rot, rot_precision="fp8")


@cuda_only
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("d,g,clip,rotate,t", WRITE_CASES_CUDA)
def test_quant_write_matches_reference_cuda(d, g, clip, rotate, t, bits, backend):
    # at head_dim 256 R as two bf16 parts does not fit in shared memory next to the product tiles
    prec = "bf16" if backend == "cuda" and d == 256 and rotate else None
    _check_write(d, g, clip, rotate, t, "cuda", seed=1, bits=bits, backend=backend, rot_precision=prec)


CUDA_WRITE_CASES = [  # the CUDA kernel's own grid: head_dim, group, clip, rotate, tokens, bits, precision, dtype
    (64, 64, 0.96, True, 37, 2, "bf16x2", torch.bfloat16),
    (64, 32, 0.92, False, 70, 2, None, torch.float32),
    (64, 64, 1.0, False, 5, 4, None, torch.float16),
    (128, 64, 0.92, True, 33, 2, "bf16", torch.bfloat16),
    (128, 128, 0.96, False, 2000, 4, None, torch.bfloat16),
    (128, 32, 0.5, True, 517, 2, "bf16x2", torch.bfloat16),
    (256, 64, 0.96, True, 100, 2, "bf16", torch.bfloat16),
    (256, 32, 0.96, False, 64, 4, None, torch.float32),
]


@cuda_only
@pytest.mark.parametrize("d,g,clip,rotate,t,bits,prec,dtype", CUDA_WRITE_CASES)
def test_quant_write_cuda_kernel_matches_reference(d, g, clip, rotate, t, bits, prec, dtype):
    _check_write(d, g, clip, rotate, t, "cuda", seed=2, bits=bits, backend="cuda", rot_precision=prec, dtype=dtype)


@cuda_only
@pytest.mark.parametrize("d,g,clip,rotate,t,bits,prec", [(64, 64, 0.92, True, 37, 2, "bf16x2"), (64, 32, 1.0, False, 70, 2, None),
                                                       (128, 64, 0.92, True, 300, 2, "bf16"), (64, 64, 0.96, True, 19, 4, "bf16x2"),
                                                       (256, 32, 0.92, False, 64, 2, None)])
def test_quant_write_cuda_fp8_metadata_matches_reference(d, g, clip, rotate, t, bits, prec, monkeypatch):
    """The CUDA write's e4m3 build (ROTKV_META8) against the reference quantizer, within
    _check_write's bounds (bytes equal unrotated); and the edge values of
    test_fp8_rounding_steps_every_way (zeros, subnormals, both signs, 448) byte for byte."""
    from rotkv import switches
    from rotkv.quant.quantizer import _round_meta

    switches.configure(cuda_write_fp8=True, fp8_kernels=True)
    _check_write(d, g, clip, rotate, t, "cuda", seed=3, bits=bits, backend="cuda", rot_precision=prec,
                 meta=torch.float8_e4m3fn)
    grid = torch.tensor([0.0, 2.0 ** -9, 2.0 ** -8, 0.3, 1.0, 1.0625, 3.3, 100.0, 440.0], dtype=torch.float32)
    vals = torch.cat([grid, -grid, grid * 1.01, -grid * 1.01, grid * 0.99])
    x = torch.zeros(len(vals), 1, 64)
    x[:, 0, 0::2] = vals[:, None]
    x[:, 0, 1::2] = (vals * 0.5)[:, None]
    # group 32: the CUDA write's smallest (it raised on the 16 this used before)
    part = _pool_bufs(len(vals) // 16 + 2, 1, 16, 64, 32, "cuda", 2, torch.float8_e4m3fn)
    quant_write(x.cuda(), torch.arange(len(vals), device="cuda"), part, backend="cuda")
    scale, lo = _round_meta(x.reshape(len(vals), 1, 2, 32).amin(-1), x.reshape(len(vals), 1, 2, 32).amax(-1), 2, "float8")
    assert torch.equal(part.lo.cpu().reshape(-1, 1, 2)[: len(vals)].view(torch.uint8), lo.view(torch.uint8))
    assert torch.equal(part.scale.cpu().reshape(-1, 1, 2)[: len(vals)].view(torch.uint8), scale.view(torch.uint8))


def test_quant_write_backend_choices(device):
    x = torch.randn(4, 2, 64, device=device, dtype=torch.bfloat16)
    bufs = _pool_bufs(2, 2, 16, 64, 64, device)
    with pytest.raises(ValueError, match="write backend"):
        quant_write(x, torch.arange(4), bufs, backend="tpu")
    with pytest.raises(ValueError, match="Triton option"):
        quant_write(x, torch.arange(4), bufs, rot=torch.eye(64).expand(2, 64, 64), backend="cuda", rot_precision="tf32")
    with pytest.raises(ValueError, match="CUDA option"):
        quant_write(x, torch.arange(4), bufs, backend="triton", rot_precision="bf16")
    if device == "cpu":
        with pytest.raises(ValueError, match="not on CUDA"):
            quant_write(x, torch.arange(4), bufs, backend="cuda")
    # parts the kernels do not store: a width outside rotkv.quant.widths.KERNEL_WIDTHS, fp32 metadata
    with pytest.raises(ValueError, match=r"widths \[2, 4\], got 8"):
        quant_write(x, torch.arange(4), TokenPart.zeros(2, 2, 16, 64, 8, 64, torch.float32, device))
    with pytest.raises(ValueError, match="fp16 or e4m3 metadata"):
        quant_write(x, torch.arange(4), TokenPart.zeros(2, 2, 16, 64, 2, 64, torch.float32, device))


def test_clip_rank():
    assert clip_rank(1.0, 64) == 0
    assert clip_rank(0.96, 64) == 3  # sorted index 61 is the 3rd largest
    assert clip_rank(0.92, 128) == 11
    with pytest.raises(ValueError, match="clip"):
        clip_rank(0.0, 64)


def _build(lens, tier_lens, h, d, g, p, pt, device, seed=0, bits=(2, 2), v_meta=torch.float16):
    """Random K/V quantized into a shuffled INT2/INT4 pool, and a bf16 tier; returns kernel inputs."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    pool = Int2PagePool(sum(-(-n // p) for n in lens) + 3, h, d, p, g, device=device, k_bits=bits[0], v_bits=bits[1],
                        v_meta=v_meta)
    pool._free = rng.sample(pool._free, len(pool._free))  # pages out of order
    tpool = Bf16PagePool(sum(-(-n // pt) for n in tier_lens) + 3, h, d, pt, device=device)
    tab, ttab = PageTable(pool), PageTable(tpool)
    for n, tn in zip(lens, tier_lens):
        sl = tab.append(tab.add_request(), n).to(device)
        k = (torch.randn(n, h, d, generator=gen) + 0.5).to(device)
        v = torch.randn(n, h, d, generator=gen).to(device)
        quant_write_reference(k, sl, pool.part("k"), clip=0.96)
        quant_write_reference(v, sl, pool.part("v"), clip=0.92)
        sl2 = ttab.append(ttab.add_request(), tn).to(device)
        tpool.write(sl2, torch.randn(tn, h, d, generator=gen).to(device), torch.randn(tn, h, d, generator=gen).to(device))
    return pool.body, tab.tensors(device), (tpool.k, tpool.v), ttab.tensors(device), max(lens), max(tier_lens)


DECODE_CASES = [  # (body lens, tier lens, kv heads, n_rep, head_dim, group, page, qk_int8)
    ([37, 70], [5, 20], 2, 3, 64, 32, 16, False),
    ([100], [0], 1, 4, 128, 64, 8, True),
    ([17, 0, 65], [3, 9, 1], 2, 1, 128, 128, 16, False),
    ([50], [33], 1, 8, 256, 64, 32, False),
]
DECODE_CASES_CUDA = [
    ([4097, 1, 300], [320, 1, 64], 8, 4, 128, 64, 16, False),
    ([4097, 1, 300], [320, 1, 64], 8, 4, 128, 64, 16, True),
    ([9000, 2500], [100, 7], 4, 8, 128, 32, 16, False),
    ([3000, 77], [64, 320], 2, 3, 64, 64, 8, True),
    ([2049], [17], 2, 2, 256, 128, 32, False),
    ([5000, 123], [200, 0], 2, 5, 128, 128, 64, False),
]


def _check_decode(lens, tier_lens, h, rep, d, g, p, int8, device, cfg=None, seed=0, v2=False, bits=(2, 2), tol=None,
                  v_meta=torch.float16):
    body, table, tier, ttable, ml, tml = _build(lens, tier_lens, h, d, g, p, 16, device, seed, bits, v_meta)
    q = torch.randn(len(lens), h * rep, d, generator=torch.Generator().manual_seed(seed + 1)).to(device, torch.bfloat16)
    cfg = cfg or DecodeConfig(qk_int8=int8, block_n=32, block_t=16, target_programs=8, min_split_tokens=32, v2=v2,
                              score="int8" if int8 else "bf16")
    out = decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg)
    ref = decode_reference(q.float(), body, table, tier[0], tier[1], ttable)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all()
    assert err < (tol or (2e-2 if int8 else 1e-2)), err
    return err


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("lens,tier_lens,h,rep,d,g,p,int8", DECODE_CASES)
def test_decode_matches_reference(lens, tier_lens, h, rep, d, g, p, int8, v2, device):
    _check_decode(lens, tier_lens, h, rep, d, g, p, int8, device, v2=v2)


MIXED_BITS = [(2, 2), (4, 2), (4, 4), (2, 4)]
DECODE_CASES_BITS = [  # one small case per head_dim; int8 only where the Triton v1 kernel uses it (D >= 128)
    ([37, 70], [5, 20], 2, 3, 64, 32, 16, False),
    ([45, 0], [3, 9], 1, 4, 128, 64, 16, True),
]


@pytest.mark.parametrize("bits", MIXED_BITS)
@pytest.mark.parametrize("lens,tier_lens,h,rep,d,g,p,int8", DECODE_CASES_BITS)
def test_decode_mixed_bits_matches_reference(lens, tier_lens, h, rep, d, g, p, int8, bits, device):
    # v2=True is asked for: INT4 K or V must run v1 instead (v2 reads INT2 only)
    _check_decode(lens, tier_lens, h, rep, d, g, p, int8, device, bits=bits, v2=True)


@pytest.mark.parametrize("bits", [(2, 2), (4, 2)])
@pytest.mark.parametrize("lens,tier_lens,h,rep,d,g,p,int8", DECODE_CASES_BITS)
def test_decode_fp8_value_metadata_matches_reference(lens, tier_lens, h, rep, d, g, p, int8, bits, device,
                                                    fp8_kernels):
    """oscar-mix's layout (e4m3 value scale and lo, INT2 or INT4 keys with fp16): the Triton kernel
    reads it; the CUDA kernel claims them (ROTKV_VMETA8; INT4 keys with its ROTKV_K4 build, the cuda_key4
    switch) where the group is a multiple of 32; e4m3 key metadata is not its."""
    import dataclasses

    from rotkv.kernels.plan import cuda_decode_reason

    cfg = DecodeConfig(qk_int8=int8, block_n=32, block_t=16, target_programs=8, min_split_tokens=32, v2=True,
                       score="int8" if int8 else "bf16", backend="triton")
    _check_decode(lens, tier_lens, h, rep, d, g, p, int8, device, cfg=cfg, bits=bits, v_meta=torch.float8_e4m3fn)
    body = _build(lens, tier_lens, h, d, g, p, 16, device, bits=bits, v_meta=torch.float8_e4m3fn)[0]
    why = cuda_decode_reason(body.layout, rep, "bf16")
    if g % 32 == 0:
        assert why is None
    else:
        assert why is not None and why.startswith("the CUDA decode kernel reads")
    fp8_keys = dataclasses.replace(body.layout, bits=(2, 2), metas=(torch.float8_e4m3fn, torch.float8_e4m3fn))
    assert cuda_decode_reason(fp8_keys, rep, "bf16").startswith("the CUDA decode kernel reads fp16 key metadata")


def test_dequant_dense_fp8_value_metadata(device, fp8_kernels):
    body, table, *_ = _build([37, 20], [0, 0], 2, 64, 32, 16, 16, device, v_meta=torch.float8_e4m3fn)
    lens = lengths_from_table(table[0], table[2], 16).tolist()
    out = torch.full((2, 2, 37, 64), float("nan"), device=device)
    dequant_dense(body.v, *table, 37, out, block=16)
    for b, n in enumerate(lens):
        idx = table[1][table[0][b]:table[0][b + 1]].long()
        rows = [t[idx].permute(1, 0, 2, 3).reshape(2, -1, t.shape[-1])[:, :n] for t in body.v.tensors]
        assert torch.equal(out[b, :, :n], dequant_rows(*rows, 2, 32))


def test_fp8_metadata_needs_sm89_and_the_switch():
    from rotkv import switches
    from rotkv.kernels.plan import part_reason

    fp8 = torch.float8_e4m3fn
    switches.configure(fp8_kernels=False)
    assert part_reason(2, fp8) is None  # the interpreter (no capability) always
    assert "fp8_kernels=0" in part_reason(2, fp8, capability=(9, 0))
    switches.configure(fp8_kernels=True)
    assert part_reason(2, fp8, capability=(9, 0)) is None
    assert "8.9" in part_reason(2, fp8, capability=(8, 0))
    assert part_reason(2, torch.float16, capability=(8, 0)) is None


@pytest.mark.parametrize("bits", [(4, 2), (2, 4)])
def test_dequant_dense_int4_matches_reference(bits, device):
    body, table, *_ = _build([37, 20], [0, 0], 2, 64, 32, 16, 16, device, bits=bits)
    lens = lengths_from_table(table[0], table[2], 16).tolist()
    for part in body.parts:
        out = torch.full((2, 2, 37, 64), float("nan"), device=device)
        dequant_dense(part, *table, 37, out, block=16)
        for b, n in enumerate(lens):
            idx = table[1][table[0][b]:table[0][b + 1]].long()
            rows = [t[idx].permute(1, 0, 2, 3).reshape(2, -1, t.shape[-1])[:, :n] for t in part.tensors]
            assert torch.equal(out[b, :, :n], dequant_rows(*rows, part.bits, part.group_size))


@cuda_only
@pytest.mark.parametrize("bits", MIXED_BITS[1:])
@pytest.mark.parametrize("lens,tier_lens,h,rep,d,g,p,int8", DECODE_CASES_CUDA)
@pytest.mark.parametrize("block_n,asm,warps", [(64, True, 1), (32, True, 4), (64, False, 1)])
def test_decode_mixed_bits_matches_reference_cuda(lens, tier_lens, h, rep, d, g, p, int8, bits, block_n, asm, warps):
    cfg = DecodeConfig(qk_int8=int8, block_n=block_n, use_asm=asm, target_programs=256, num_warps=warps,
                       score="int8" if int8 else "bf16")  # backend auto: INT4 runs Triton v1, no warning
    _check_decode(lens, tier_lens, h, rep, d, g, p, int8, "cuda", cfg=cfg, seed=4, bits=bits)


@cuda_only
@pytest.mark.parametrize("lens,tier_lens,h,rep,d,g,p,int8", DECODE_CASES_CUDA)
@pytest.mark.parametrize("block_n,asm,warps,v2", [
    pytest.param(32, True, 4, False, id="v1-n32-w4"), pytest.param(64, True, 4, False, id="v1-n64-w4"),
    pytest.param(128, False, 4, False, id="v1-n128-w4-noasm"), pytest.param(64, True, 1, False, id="v1-n64-w1"),
    pytest.param(64, True, 1, True, id="v2-n64-w1"), pytest.param(128, True, 2, True, id="v2-n128-w2"),
    pytest.param(64, True, 4, True, id="v2-n64-w4"), pytest.param(32, False, 2, True, id="v2-n32-w2-noasm")])
def test_decode_matches_reference_cuda(lens, tier_lens, h, rep, d, g, p, int8, block_n, asm, warps, v2):
    cfg = DecodeConfig(qk_int8=int8, block_n=block_n, use_asm=asm, target_programs=256, num_warps=warps, v2=v2,
                       backend="triton", score="int8" if int8 else "bf16")
    _check_decode(lens, tier_lens, h, rep, d, g, p, int8, "cuda", cfg=cfg, seed=3)


CUDA_KERNEL_CASES = [  # the CUDA body kernel needs P % 16 == 0 and G % 32 == 0
    ([4097, 1, 300], [320, 1, 64], 8, 4, 128, 64, 16),
    ([9000, 2500], [100, 7], 4, 8, 128, 32, 16),
    ([3000, 77], [64, 320], 2, 3, 64, 64, 16),
    ([700, 33], [64, 3], 3, 3, 64, 32, 32),
    ([2049], [17], 2, 2, 256, 128, 32),
    ([1500, 16], [9, 0], 2, 6, 256, 32, 16),
    ([5000, 123], [200, 0], 2, 5, 128, 128, 64),
    ([260, 0, 31], [0, 5, 2], 1, 1, 128, 128, 16),
]


# (tiles, min blocks, target warps, fuse, prefetch, fp16 values, value flush); the default is the 6th
CUDA_KERNEL_VARIANTS = [
    (2, 1, 256, "block", False, False, 0), (4, 4, 64, "all", False, True, 2), (2, None, 4096, "block", False, False, 0),
    (2, None, 2048, "none", False, True, 8), (1, None, 2048, "block", True, False, 0),
    (1, None, 2048, "block", True, True, 8), (1, None, 64, "block", True, False, 8), (2, 2, 256, "all", True, False, 0)]


@cuda_only
@pytest.mark.parametrize("score", ["int8", "bf16"])
@pytest.mark.parametrize("lens,tier_lens,h,rep,d,g,p", CUDA_KERNEL_CASES[:5])
def test_decode_cuda_fp8_value_metadata_matches_reference(lens, tier_lens, h, rep, d, g, p, score, fp8_kernels):
    """The CUDA body kernel's e4m3 value-metadata build (ROTKV_VMETA8, oscar-mix's INT2 layers) against
    the reference, within the error of the fp16-metadata build on the same tokens' codes."""
    cfg = DecodeConfig(backend="cuda", score=score, cuda_min_split_tokens=64)
    err8 = _check_decode(lens, tier_lens, h, rep, d, g, p, score == "int8", "cuda", cfg=cfg, seed=5,
                         v_meta=torch.float8_e4m3fn, tol=2e-2 if score == "int8" else 1e-2)
    assert err8 < 2e-2


def cuda_kernel_config(tiles, min_blocks, target, fuse, prefetch, vf16, flush) -> DecodeConfig:
    return DecodeConfig(backend="cuda", cuda_tiles=tiles, cuda_min_blocks=min_blocks, cuda_target_warps=target,
                        cuda_min_split_tokens=64, score="int8", cuda_fuse=fuse, cuda_prefetch=prefetch,
                        cuda_value_f16=vf16, cuda_value_flush=flush)


@cuda_only
@pytest.mark.parametrize("lens,tier_lens,h,rep,d,g,p", CUDA_KERNEL_CASES)
@pytest.mark.parametrize("tiles,min_blocks,target,fuse,prefetch,vf16,flush", CUDA_KERNEL_VARIANTS)
def test_decode_cuda_kernel_matches_reference(lens, tier_lens, h, rep, d, g, p, tiles, min_blocks, target, fuse,
                                              prefetch, vf16, flush):
    cfg = cuda_kernel_config(tiles, min_blocks, target, fuse, prefetch, vf16, flush)
    _check_decode(lens, tier_lens, h, rep, d, g, p, True, "cuda", cfg=cfg, seed=5)


@cuda_only
@pytest.mark.parametrize("lens,tier_lens,h,rep,d,g,p", CUDA_KERNEL_CASES)
@pytest.mark.parametrize("qf16", [1, 2])
@pytest.mark.parametrize("tiles,prefetch", [(1, True), (2, False)])
def test_decode_cuda_fp16_query_matches_reference(lens, tier_lens, h, rep, d, g, p, qf16, tiles, prefetch):
    # score "bf16" on the CUDA kernel: the fp16 query (both code-operand makers) is at least as close
    # to the float32 reference as the int8 query of the same build otherwise
    base = cuda_kernel_config(tiles, None, 2048, "block", prefetch, True, 8)
    f16 = _check_decode(lens, tier_lens, h, rep, d, g, p, False, "cuda", seed=5, tol=2e-2,
                        cfg=dataclasses.replace(base, score="bf16", cuda_score_f16=qf16))
    i8 = _check_decode(lens, tier_lens, h, rep, d, g, p, True, "cuda", cfg=base, seed=5)
    assert f16 <= i8 * 1.05, (f16, i8)


def _graph_replays(q, call, want):
    """``call(out)`` warmed up, captured in a CUDA graph and replayed 3 times, each replay's output equal to
    ``want``; then ``q`` takes new values and the graph replays once more: that output is returned."""
    out = torch.empty_like(q)
    call(out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(q))
    graph.replay()
    torch.cuda.synchronize()
    return out


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_cuda_fused_merge_matches_unfused_and_survives_graph_replays(dtype):
    """The in-kernel merge (block pre-merge + last block per (request, KV head)) against the Triton
    merge, for each output dtype; then captured in a CUDA graph and replayed: each replay must give
    the same output (the arrival counters reset themselves), also after the inputs change."""
    body, table, tier, ttable, ml, tml = _build([3000, 77, 0, 1200], [64, 320, 5, 0], 2, 64, 64, 16, 16, "cuda", seed=7)
    q = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(8)).to("cuda", dtype)
    fused = DecodeConfig(backend="cuda", score="int8", cuda_target_warps=512, cuda_fuse="all")
    unfused = DecodeConfig(backend="cuda", score="int8", cuda_target_warps=512, cuda_fuse="none")
    run = lambda cfg: decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg)  # noqa: E731
    a, b = run(fused), run(unfused)
    assert a.dtype == dtype
    tol = 1e-2 if dtype == torch.float32 else 2e-2
    assert ((a.float() - b.float()).norm() / b.float().norm()).item() < tol
    c = run(DecodeConfig(backend="cuda", score="int8", cuda_target_warps=512, cuda_fuse="block"))
    assert ((c.float() - b.float()).norm() / b.float().norm()).item() < tol
    ref = decode_reference(q.float(), body, table, tier[0], tier[1], ttable)
    assert ((a.float() - ref).norm() / ref.norm()).item() < 2e-2
    out = _graph_replays(q, lambda o: decode_attention(q, body, table, ml, tier, ttable, tml, cfg=fused, out=o), a)
    want = decode_attention(q, body, table, ml, tier, ttable, tml, cfg=unfused)
    assert ((out.float() - want.float()).norm() / want.float().norm()).item() < tol


@cuda_only
@pytest.mark.parametrize("fuse", ["none", "block"])
def test_decode_tier_beside_the_body_kernel_matches_before_it_eager_and_in_a_graph(fuse):
    """The tier's launch on a second stream beside the CUDA body kernel (``tier_stream``) gives the output of
    the default order (tier first, one stream), bit for bit: the same kernels write the same partial slots.
    Captured in a CUDA graph (two parallel branches, joined before the merge), every replay gives it too,
    also after the query changes."""
    body, table, tier, ttable, ml, tml = _build([3000, 77, 0, 1200], [64, 320, 5, 0], 2, 64, 64, 16, 16, "cuda", seed=7)
    q = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(8)).to("cuda", torch.bfloat16)
    base = DecodeConfig(backend="cuda", score="int8", cuda_target_warps=512, cuda_fuse=fuse)
    beside = dataclasses.replace(base, tier_stream=True)
    run = lambda cfg: decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg)  # noqa: E731
    want = run(base)
    assert torch.equal(run(beside), want)
    ref = decode_reference(q.float(), body, table, tier[0], tier[1], ttable)
    assert ((want.float() - ref).norm() / ref.norm()).item() < 2e-2
    out = _graph_replays(q, lambda o: decode_attention(q, body, table, ml, tier, ttable, tml, cfg=beside, out=o), want)
    assert torch.equal(out, run(base))


@cuda_only
def test_decode_cuda_fused_merge_falls_back_past_512_slots():
    """More partial slots than the fused merge holds: the kernel pre-merges blocks and the Triton
    merge runs (same result as the unfused path)."""
    body, table, tier, ttable, ml, tml = _build([70000], [16], 1, 64, 64, 16, 16, "cuda", seed=2)
    q = torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
    cfg = DecodeConfig(backend="cuda", score="int8", cuda_target_warps=8192, cuda_min_split_tokens=32,
                       cuda_fuse="all", cuda_tiles=2)
    from rotkv.kernels import decode as decode_mod

    per, n = decode_mod._splits(ml, 1, 32, 8192, 32)
    assert -(-n // 4) > 512  # the case this test is about
    out = decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg)
    ref = decode_reference(q.float(), body, table, tier[0], tier[1], ttable)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2


@cuda_only
def test_decode_cuda_kernel_refuses_what_it_cannot_run():
    body, table, tier, ttable, ml, tml = _build([40], [8], 1, 64, 64, 8, 16, "cuda")  # page size 8
    q = torch.randn(1, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="page size"):
        decode_attention(q, body, table, ml, tier, ttable, tml, cfg=DecodeConfig(backend="cuda"))
    from rotkv.kernels import plan as plan_mod

    plan_mod._CUDA_WARNED.clear()  # the warning is given once per reason and process
    plan_mod.clear_plans()
    with pytest.warns(UserWarning, match="page size"):  # auto: falls back to Triton
        # score="int8": at head_dim 64 "auto" scores in bf16, which only the Triton kernel does (no CUDA attempt)
        decode_attention(q, body, table, ml, tier, ttable, tml,
                         cfg=DecodeConfig(backend="auto", small_work=0, score="int8"))


def test_decode_caps_the_tokens_per_split_for_a_capacity_sized_grid(device, monkeypatch):
    """``max_split_tokens`` (a CUDA graph's call, sized for the capacity): at most that many tokens per split, so
    that a batch whose rows are shorter than the capacity keeps several splits per row busy; the output is
    the uncapped call's up to the merge's order."""
    from rotkv.kernels.decode import _splits

    assert _splits(17408, 64 * 8, 16, 2048, 64) == (4352, 4)  # 64 rows x 8 KV heads: a 4K row in one split
    assert _splits(17408, 64 * 8, 16, 2048, 64, cap=1024) == (1024, 17)
    assert _splits(33792, 8, 16, 2048, 64, cap=1024) == (144, 235)  # batch 1: the rule's own split is smaller
    assert _splits(1000, 8, 16, 2048, 64, cap=16) == (64, 16)  # never below the least split
    body, table, tier, ttable, ml, tml = _build([37, 150], [5, 20], 2, 64, 32, 16, 16, device)
    q = torch.randn(2, 6, 64).to(device, torch.bfloat16)
    cfg = DecodeConfig(block_n=32, target_programs=4, min_split_tokens=32)
    from rotkv.kernels import decode as decode_mod
    from rotkv.kernels.plan import plan_decode

    seen = []
    real = decode_mod._splits
    monkeypatch.setattr(decode_mod, "_splits", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    whole = decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg)
    uncapped, _ = seen[0]  # the body's splits are each call's first
    seen.clear()
    capped = decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg, max_split_tokens=32)
    # the launch the plan picks on this device: Triton v1 under the interpreter; on CUDA this small body takes
    # the plan's small launch (Triton v2, blocks of cfg.small_block_n tokens); the CUDA body kernel's branch
    # has its own test below
    launch = plan_decode(q, body, cfg).launch(q.shape[0] * body.kv_heads * ml)
    if launch.kernel == "cuda":
        block, least = 16 * launch.cfg.cuda_tiles, launch.cfg.cuda_min_split_tokens
    else:
        block, least = launch.cfg.block_n, launch.cfg.min_split_tokens
    per = -(-max(least, 32) // block) * block  # the cap, not below the least split, in whole blocks
    assert uncapped > per  # the cap shortens this call's splits (so a dropped cap fails below)
    assert seen[0] == (per, -(-ml // per))  # the body's splits: capped
    ref = decode_reference(q.float(), body, table, tier[0], tier[1], ttable)
    for got in (whole, capped):
        assert ((got.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert (capped.float() - whole.float()).abs().max() < 2e-2


def test_decode_caps_the_cuda_body_kernels_splits_too(device, monkeypatch):
    """The CUDA body kernel's splits are capped like Triton's (the launch of a graphed step at large batches):
    on any device, with a plan whose launch is the CUDA kernel and a stand-in for its launcher that records
    the splits it is given (and writes empty partials)."""
    from rotkv.kernels import cuda_decode
    from rotkv.kernels.plan import DecodePlan, Launch, _device_key, cuda_variant

    body, table, tier, ttable, ml, tml = _build([37, 150], [5, 20], 2, 64, 32, 16, 16, device)
    q = torch.randn(2, 6, 64).to(device, torch.bfloat16)
    cfg = DecodeConfig(cuda_target_warps=4, cuda_min_split_tokens=16, cuda_fuse="none")

    class CudaPlan(DecodePlan):
        def launch(self, work):
            return Launch("cuda", self.cfg, cuda_variant=cuda_variant(self.cfg, 64, 2))

    plan = CudaPlan(body.layout, 6, 64, _device_key(q), cfg)
    seen = []

    def body_partials(q, body, table, o_part, m_part, l_part, n_splits, per, *args, **kwargs):
        seen.append((per, n_splits))
        o_part[:, :, :n_splits], m_part[:, :, :n_splits], l_part[:, :, :n_splits] = 0.0, float("-inf"), 0.0

    monkeypatch.setattr(cuda_decode, "body_partials", body_partials)
    for cap in (None, 32):
        decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg, plan=plan, max_split_tokens=cap)
    assert seen == [(160, 1), (32, 5)]  # uncapped: one split of the 150 tokens (in 16-token tiles); capped: 32


def test_decode_tier_only_and_body_only(device):
    # the bf16 split-K path alone (the benchmark's "triton bf16" baseline) and the body alone
    body, table, tier, ttable, ml, tml = _build([40], [24], 1, 64, 64, 16, 16, device)
    q = torch.randn(1, 2, 64).to(device, torch.bfloat16)
    cfg = DecodeConfig(block_n=32, block_t=16, target_programs=4, min_split_tokens=16)
    out = decode_attention(q, None, None, 0, tier, ttable, tml, cfg=cfg)
    ref = decode_reference(q.float(), None, None, tier[0], tier[1], ttable)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    out = decode_attention(q, body, table, ml, cfg=cfg)
    ref = decode_reference(q.float(), body, table)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("d,rep", [(64, 3), (128, 2)])
def test_decode_turns_its_output_back_inside_the_merge(d, rep, device):
    """``out_rotation`` (the graphed decode step's output rotation, no launch of its own): the merge's rows times
    the split matrix of each query head's group equal ``rotate_bf16x2`` of the unrotated output (the sums' order
    aside: at most one bf16 ulp apart); bad matrices and outs are refused."""
    from rotkv.kernels.rotate import rotate_bf16x2
    from rotkv.rotations.base import bf16x2_matrix

    h = 2
    body, table, tier, ttable, ml, tml = _build([37, 70], [5, 20], h, d, 32, 16, 16, device)
    q = torch.randn(2, h * rep, d).to(device, torch.bfloat16)
    a = bf16x2_matrix(torch.stack([random_orthogonal(d, seed=30 + i) for i in range(h)])).to(device)
    plain = decode_attention(q, body, table, ml, tier, ttable, tml)
    want = rotate_bf16x2(plain.transpose(0, 1)[None], a)[0].transpose(0, 1)
    ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(2.0 ** -30))) - 7)
    # the merge turns merge_slice (< d) columns per program, each merging the whole row: the default slice and a
    # narrower one
    assert DecodeConfig().merge_slice < d
    for cfg in (None, DecodeConfig(merge_slice=16)):
        out = torch.full_like(plain, 5.0)
        assert decode_attention(q, body, table, ml, tier, ttable, tml, out=out, out_rotation=a, cfg=cfg) is out
        assert ((out.float() - want.float()).abs() <= ulp + 2.0 ** -14 * plain.float().norm(dim=-1, keepdim=True)).all()
        assert (out.float() - plain.float()).abs().max() > 0.1  # it did turn
    # from merge_rotate_rows query rows on: the plain merge, then the rotation kernel (the same bytes as rotating
    # the plain output)
    out = torch.full_like(plain, 5.0)
    assert decode_attention(q, body, table, ml, tier, ttable, tml, out=out, out_rotation=a,
                            cfg=DecodeConfig(merge_rotate_rows=2 * h * rep)) is out
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="contiguous bf16 out"):
        decode_attention(q, body, table, ml, tier, ttable, tml, out_rotation=a)
    with pytest.raises(ValueError, match="split matrix"):
        decode_attention(q, body, table, ml, tier, ttable, tml, out=out, out_rotation=a[:, :d])


def test_decode_rejects_small_groups(device):
    # the Triton kernels read head quarters inside one group (G >= D/4); smaller groups are the CUDA
    # kernel's (which the plan picks on a GPU), so a Triton-only call must refuse them
    pool = Int2PagePool(2, 1, 256, 16, 32, device=device)
    q = torch.zeros(1, 1, 256, device=device)
    table = PageTable(pool)
    table.append(table.add_request(), 4)
    with pytest.raises(ValueError, match="group_size"):
        decode_attention(q, pool.body, table.tensors(device), 4, cfg=DecodeConfig(backend="triton"))


def test_dequant_dense_matches_reference(device):
    body, table, *_ = _build([37, 20], [0, 0], 2, 64, 32, 16, 16, device)
    out = torch.full((2, 2, 37, 64), float("nan"), device=device)
    dequant_dense(body.k, *table, 37, out, block=16)
    lens = lengths_from_table(table[0], table[2], 16).tolist()
    assert torch.isnan(out[1, :, 20:]).all()  # past the shorter request: untouched
    for b, n in enumerate(lens):
        idx = table[1][table[0][b]:table[0][b + 1]].long()
        rows = [t[idx].permute(1, 0, 2, 3).reshape(2, -1, t.shape[-1])[:, :n] for t in body.k.tensors]
        assert torch.equal(out[b, :, :n], dequant_rows(*rows, 2, 32))


def test_dequant_dense_into_a_longer_buffer(device):
    """The prefill dequantizes the body into the front of a [B, H, body + tier, D] buffer: the row
    stride is the buffer's length, the tail (where the tier goes) is left as it was."""
    body, table, *_ = _build([37, 20], [0, 0], 2, 64, 32, 16, 16, device)
    want = torch.zeros(2, 2, 37, 64, device=device)
    dequant_dense(body.k, *table, 37, want, block=16)
    out = torch.full((2, 2, 37 + 11, 64), 7.0, device=device)
    dequant_dense(body.k, *table, 37, out, block=16)
    assert torch.equal(out[0, :, :37], want[0]) and torch.equal(out[1, :, :20], want[1, :, :20])
    assert (out[:, :, 37:] == 7).all() and (out[1, :, 20:] == 7).all()


@cuda_only
def test_decode_int64_offsets():
    # a pool whose codes span more than 2**31 bytes, with the request's pages at the end
    h, d, p, g = 8, 128, 16, 64
    np_ = (2**31 // (h * p * d // 4)) + 64
    pool = Int2PagePool(np_, h, d, p, g, device="cuda")
    pool._free = list(range(np_ - 64))[::-1] + list(range(np_ - 64, np_))[::-1]  # high pages first
    table = PageTable(pool)
    n = 500
    sl = table.append(table.add_request(), n).cuda()
    assert sl.min().item() // p * (h * p * d // 4) >= 2**31  # first code byte past int32
    k, v = torch.randn(n, h, d, device="cuda"), torch.randn(n, h, d, device="cuda")
    quant_write(k, sl, pool.part("k"))
    quant_write(v, sl, pool.part("v"))
    q = torch.randn(1, 4 * h, d, device="cuda", dtype=torch.bfloat16)
    tt = table.tensors("cuda")
    ref = decode_reference(q.float(), pool.body, tt)
    for cfg in (DecodeConfig(backend="triton"), DecodeConfig(backend="triton", v2=True), DecodeConfig(backend="cuda")):
        out = decode_attention(q, pool.body, tt, n, cfg=cfg)
        assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2, cfg


def test_page_table_vocabulary():
    pool = Bf16PagePool(8, 1, 4, page_size=4)
    tab = PageTable(pool)
    a, b = tab.add_request(), tab.add_request()
    assert tab.append(a, 5).tolist() == [0, 1, 2, 3, 4]
    tab.append(b, 4)
    assert tab.append(a, 1).tolist() == [5]
    indptr, indices, last = tab.tensors("cpu")
    assert indptr.tolist() == [0, 2, 3] and indices.tolist() == [0, 1, 2] and last.tolist() == [2, 4]
    assert lengths_from_table(indptr, last, 4).tolist() == [6, 4]
    tab.release(a)
    assert pool.free_pages == 7


def test_decode_config_rejects_bad_values():
    for bad in (dict(backend="cuda2"), dict(cuda_tiles=0), dict(cuda_tiles=9), dict(cuda_fuse=True),
                dict(cuda_min_blocks=0), dict(block_n=0)):
        with pytest.raises(ValueError):
            DecodeConfig(**bad)


def test_decode_config_wide_knobs_apply_to_bodies_with_a_4bit_side():
    from rotkv.kernels.plan import plan_decode

    cfg = DecodeConfig(wide_target_programs=4096, wide_num_warps=2, wide_block_n=32)
    unset = DecodeConfig(wide_target_programs=None)
    assert cfg.for_bits((2, 2)) is cfg and unset.for_bits((4, 2)) is unset
    assert DecodeConfig().for_bits((4, 2)).target_programs == 2048  # the measured default (plan.py)
    wide = cfg.for_bits((4, 2))
    assert (wide.target_programs, wide.num_warps, wide.block_n) == (4096, 2, 32)
    half = DecodeConfig(wide_num_warps=4).for_bits((2, 4))
    assert (half.target_programs, half.num_warps, half.block_n) == (2048, 4, 64)
    for bad in (dict(wide_num_warps=3), dict(wide_block_n=0), dict(num_warps=6)):
        with pytest.raises(ValueError):
            DecodeConfig(**bad)
    # the plan's main launch over an INT4-key body runs them; INT2 bodies keep the general knobs
    # (off CUDA the plan runs Triton for both)
    for bits, want in (((4, 2), (4096, 2, 32)), ((2, 2), (1024, 1, 64))):
        body, *_ = _build([40], [8], 1, 64, 64, 16, 16, "cpu", 0, bits)
        launch = plan_decode(torch.zeros(1, 2, 64), body, cfg).main
        assert (launch.cfg.target_programs, launch.cfg.num_warps, launch.cfg.block_n) == want, bits


@pytest.mark.parametrize("bits", [(4, 2), (4, 4)])
def test_decode_wide_config_matches_reference(bits, device):
    """The wide_* knobs (more programs, warps, another block) change only the launch: same output."""
    cfg = DecodeConfig(block_n=32, block_t=16, target_programs=8, min_split_tokens=32, score="bf16",
                       wide_target_programs=32, wide_num_warps=2, wide_block_n=16)
    _check_decode([37, 70], [5, 20], 2, 3, 64, 32, 16, False, device, cfg=cfg, bits=bits)


def test_decode_config_overrides_from_the_environment(setenv):
    from rotkv import switches
    from rotkv.kernels.plan import decode_config

    assert switches.parse_tuning("") == {}
    got = switches.parse_tuning(" wide_target_programs=4096, wide_num_warps=2,cuda_prefetch=0,"
                                "cuda_min_blocks=none,cuda_fuse=block")
    assert dict(got["decode"]) == dict(wide_target_programs=4096, wide_num_warps=2, cuda_prefetch=False,
                                       cuda_min_blocks=None, cuda_fuse="block")
    for bad, match in (("nope=1", "nope"), ("block_n", "block_n"), ("block_n=x", "bad value"),
                       ("backend=cuda", "tuning field"), ("cuda_prefetch=2", "bad value")):
        with pytest.raises(ValueError, match=match):
            switches.parse_tuning(bad)
    setenv("ROTKV_TUNING", "wide_num_warps=4")
    assert decode_config().wide_num_warps == 4
    with pytest.raises(ValueError, match="ROTKV_TUNING.*power of two"):
        setenv("ROTKV_TUNING", "wide_num_warps=3")  # checked when the environment is read, on any device
    setenv("ROTKV_TUNING", "")
    assert decode_config().wide_num_warps is None


def test_decode_cuda_backend_refused_off_cuda():
    if CUDA:
        pytest.skip("checks the CPU refusal")
    body, table, tier, ttable, ml, tml = _build([40], [8], 1, 64, 64, 16, 16, "cpu")
    q = torch.randn(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        decode_attention(q, body, table, ml, tier, ttable, tml, cfg=DecodeConfig(backend="cuda"))
