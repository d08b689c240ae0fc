"""The CUDA decode kernel compiles, for every head_dim / group count it covers, without register
spills in the default variants (``nvcc -Xptxas -v``, sm_90). Runs wherever ``nvcc`` is found,
GPU or not; the kernel's numerics are tested against the reference on CUDA (test_kernels.py)."""

import re
import subprocess

import pytest
import torch

from rotkv.kernels.cuda_decode import SOURCE, _nvcc

NVCC = _nvcc()
# (head_dim, groups per head, min blocks per SM as DecodeConfig picks it)
DEFAULT_VARIANTS = [(64, 1, 4), (64, 2, 4), (128, 1, 4), (128, 2, 4), (128, 4, 3), (256, 1, 2), (256, 2, 2),
                    (256, 4, 2)]


def _spills(source, macros: list[str], cubin, fast_math: bool) -> list[int]:
    """ptxas's spill-store bytes per kernel of one build (``nvcc -Xptxas -v -cubin``, sm_90)."""
    res = subprocess.run([NVCC, "-O3", "-std=c++17", *(["-use_fast_math"] if fast_math else []),
                          "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v", "-cubin", *macros, "-o", str(cubin),
                          str(source)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    return [int(x) for x in re.findall(r"(\d+) bytes spill stores", res.stderr)]


def test_parse_ptxas_takes_the_largest_of_each_field():
    from rotkv.kernels.prebuild import parse_ptxas

    log = ("ptxas info    : Compiling entry function 'a' for 'sm_90'\n"
           "ptxas info    : Function properties for a\n    104 bytes stack frame, 140 bytes spill stores, 196 bytes spill loads\n"
           "ptxas info    : Used 128 registers, used 1 barriers, 104 bytes cumulative stack size, 16676 bytes smem\n"
           "ptxas info    : Function properties for b\n    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
           "ptxas info    : Used 167 registers, used 1 barriers, 33060 bytes smem\n")
    r = parse_ptxas(log)
    assert (r.registers, r.stack, r.spill_stores, r.spill_loads, r.smem, r.spills) == (167, 104, 140, 196, 33060, True)
    with pytest.raises(ValueError, match="no 'Used N registers'"):
        parse_ptxas("nvcc warning only")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_build_kernels_reports_registers_without_touching_the_cache(tmp_path, setenv, capsys):
    """`rotkv build-kernels --registers`: one line per build of the preset's plan, from ptxas, and nothing in the
    kernel cache."""
    from rotkv.cli import main

    setenv("ROTKV_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["build-kernels", "--head-dim", "128", "--arch", "90", "--registers", "--preset", "oscar-refine"]) == 0
    out = capsys.readouterr().out
    assert "decode body, variant (128, 2, 1, 4," in out and "write, rotating" in out
    assert "4 builds, 0 with spills" in out and not (tmp_path / "cache").exists()


def test_min_blocks_table_matches_the_config():
    from rotkv.kernels.plan import DecodeConfig, min_blocks

    for d, ng, minb in DEFAULT_VARIANTS:
        assert min_blocks(DecodeConfig(), d, ng) == minb


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_build_and_load_the_library(tmp_path, setenv):
    """The loader's own path (nvcc -> cache -> ctypes) for the local toolchain's architecture 9.0."""
    from rotkv.kernels import cuda_decode

    setenv("ROTKV_CACHE_DIR", str(tmp_path))
    lib = cuda_decode._compile_and_load(NVCC, "90", "64-1-2-4", "test", (64, 1, 2, 4))
    assert lib.rotkv_int2_decode.restype is not None
    assert len(list(tmp_path.glob("int2_decode-64-1-2-4-0-0-0-0-0-0-0-test-sm90.so"))) == 1
    # a second call loads the cached library without compiling (no temp file left either)
    cuda_decode._compile_and_load(NVCC, "90", "64-1-2-4", "test", (64, 1, 2, 4))
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_the_int4_key_build_checks_its_launch_on_the_host(tmp_path, setenv):
    """The K4 build's launcher (no GPU: it returns before any CUDA call): the key width must be the build's
    (-3), 4-bit keys take no key refine ring (-4), and an empty batch launches nothing (0)."""
    from rotkv.kernels import cuda_decode

    setenv("ROTKV_CACHE_DIR", str(tmp_path))
    variant = (64, 1, 1, 4, 1, 1, 8, 1, 1, 1, 1)
    lib = cuda_decode._compile_and_load(NVCC, "90", "-".join(map(str, variant)), "k4", variant)

    def call(kbits, n_batch=0, rk=None, rv=None):
        return lib.rotkv_int2_decode(64, 1, 1, 4, kbits, *[None] * 13, n_batch, 3, 9, 16, 4, 4, 64, 1.0, 0, None,
                                     None, 0, rk, rv, 2, 1, None)

    assert call(4) == 0 and call(4, rv=8) == 0
    assert call(2) == -3 and call(4, rk=8) == -4


# (head_dim, group, bits, rotation split, warps): the write kernel's variants the dispatcher builds
# (the last: scale and lo as e4m3 bytes, ROTKV_META8, for oscar-mix's values)
WRITE_VARIANTS = [(64, 64, 2, 2, 4, 0), (64, 32, 4, 1, 8, 0), (128, 64, 2, 2, 4, 0), (128, 128, 4, 1, 8, 0),
                  (256, 64, 2, 1, 8, 0), (64, 64, 2, 2, 4, 1), (128, 64, 2, 2, 4, 1), (256, 64, 2, 1, 8, 1)]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("d,g,bits,split,warps,meta8", WRITE_VARIANTS)
def test_cuda_write_kernel_compiles_without_spills(d, g, bits, split, warps, meta8, tmp_path):
    from rotkv.kernels.cuda_write import SOURCE as WRITE_SOURCE

    macros = [f"-DROTKV_D={d}", f"-DROTKV_G={g}", f"-DROTKV_BITS={bits}", f"-DROTKV_SPLIT={split}", f"-DROTKV_NW={warps}",
              f"-DROTKV_META8={meta8}"]
    spills = _spills(WRITE_SOURCE, macros, tmp_path / "w.cubin", fast_math=False)
    assert len(spills) == 4 and max(spills) == 0, spills  # three plain dtypes + the rotating kernel


# (head_dim, groups, tiles, min blocks, prefetch[, fp16 values, value flush]): the decode kernel's
# default builds (16-token steps with prefetch, none at D 256 with 8 groups; fp16 values, flush 8),
# the bf16-value builds and the other variants bench_decode.py measures, and the 32-token builds of
# every default (head_dim, groups) pair
DECODE_VARIANTS = [(*v, 1, 8) for v in [(64, 1, 1, 4, 1), (64, 2, 1, 4, 1), (128, 2, 1, 4, 1), (128, 4, 1, 3, 1),
                                        (256, 4, 1, 2, 1), (256, 8, 1, 2, 0), (256, 2, 1, 2, 1)]] + [
                   (64, 1, 1, 4, 1), (128, 2, 1, 4, 1), (128, 4, 1, 3, 1), (256, 4, 1, 2, 1), (256, 8, 1, 2, 0),
                   (128, 2, 2, 3, 1), (128, 2, 1, 4, 1, 1), (128, 2, 1, 4, 1, 0, 8)] + [
                   (d, ng, 2, minb, 0) for d, ng, minb in DEFAULT_VARIANTS] + [
                   # the fp16-query builds (score "bf16": the default at head_dim 64), both operand makers
                   (64, 1, 1, 4, 1, 1, 8, 1), (64, 2, 1, 4, 1, 1, 8, 1), (64, 1, 1, 4, 1, 1, 8, 2), (64, 2, 1, 4, 1, 1, 8, 2),
                   (64, 1, 2, 4, 0, 1, 0, 1), (128, 2, 1, 3, 1, 1, 8, 1)] + [
                   # e4m3 value metadata (oscar-mix's INT2 layers): the defaults of each head_dim and group count
                   (64, 1, 1, 4, 1, 1, 8, 1, 1), (64, 2, 1, 4, 1, 1, 8, 1, 1), (128, 2, 1, 4, 1, 1, 8, 0, 1),
                   (128, 4, 1, 3, 1, 1, 8, 0, 1), (256, 4, 1, 2, 1, 1, 8, 0, 1), (256, 8, 1, 2, 0, 1, 8, 0, 1),
                   (128, 2, 1, 4, 1, 0, 0, 0, 1)] + [
                   # the refine builds (ROTKV_REFINE, refine_split=kernel) that fit: head_dim 64's defaults; at
                   # head_dim 128 with 2 groups without prefetch or at 3 blocks per SM (the default spills)
                   (64, 1, 1, 4, 1, 1, 8, 1, 1, 1), (64, 2, 1, 4, 1, 1, 8, 1, 1, 1), (64, 1, 1, 4, 1, 1, 8, 1, 0, 1),
                   (128, 2, 1, 4, 0, 1, 8, 0, 1, 1), (128, 2, 1, 3, 1, 1, 8, 0, 1, 1)] + [
                   # the INT4-key builds (ROTKV_K4, the cuda_key4 switch) the plan runs at head_dim 64 with one group
                   # and 128 with two (3 blocks per SM: at 4 they spill): int8 and fp16 query, fp16 and e4m3 value
                   # metadata, with and without the values' refine ring
                   (d, ng, 1, minb, 1, 1, 8, qf16, vm8, ref, 1) for d, ng, minb in ((64, 1, 4), (128, 2, 3))
                   for qf16 in (0, 1) for vm8 in (0, 1) for ref in (0, 1)] + [
                   (64, 1, 1, 4, 1, 1, 8, 2, 1, 1, 1), (64, 2, 1, 4, 1, 1, 8, 1, 1, 0, 1),
                   (64, 2, 1, 4, 1, 1, 8, 0, 1, 1, 1), (64, 1, 2, 4, 0, 1, 0, 1, 0, 0, 1),
                   (128, 1, 1, 4, 1, 1, 8, 0, 1, 0, 1), (128, 4, 1, 2, 1, 1, 8, 0, 0, 0, 1),
                   (256, 4, 1, 2, 1, 1, 8, 0, 1, 0, 1)]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("variant", DECODE_VARIANTS)
def test_cuda_decode_kernel_compiles_without_spills(variant, tmp_path):
    from rotkv.kernels.cuda_decode import VARIANT_MACROS

    spills = _spills(SOURCE, [f"-DROTKV_{n}={v}" for n, v in zip(VARIANT_MACROS, variant)], tmp_path / "d.cubin",
                     fast_math=True)
    assert spills and max(spills) == 0, spills


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
@pytest.mark.parametrize("d,ng,key_bits", [(64, 1, 2), (64, 2, 2), (128, 1, 2), (128, 2, 2), (128, 4, 2), (64, 1, 4),
                                           (128, 1, 4), (128, 2, 4)])
def test_the_refine_builds_the_plan_picks_compile_without_spills(d, ng, key_bits, tmp_path):
    """The build that reads the refine tier, as the plan makes it from the plain build (``with_refine``: at
    head_dim 128 one block per SM fewer) for oscar-refine's e4m3 value metadata and the default score."""
    from rotkv.kernels.cuda_decode import _macros
    from rotkv.kernels.plan import DecodeConfig, cuda_variant, with_refine

    cfg = DecodeConfig()
    variant = with_refine(cuda_variant(cfg, d, ng, None, torch.float8_e4m3fn, key_bits), cfg)
    spills = _spills(SOURCE, [f"-D{n}={v}" for n, v in _macros(variant).items()], tmp_path / "r.cubin", fast_math=True)
    assert spills and max(spills) == 0, (variant, spills)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_cuda_write_e4m3_rounding_matches_the_reference_on_the_host(tmp_path):
    """The CUDA write's e4m3 rounding (``e4m3_dir`` in quant_write.cu, host and device), run on the CPU
    through nvcc's host compiler: every byte and value equals rotkv.quant.quantizer's directed rounding
    (lo down, scale up) over zeros, subnormals, both signs, the largest finite values and random floats;
    past 448 it gives the NaN code, where the reference raises."""
    import ctypes
    import subprocess

    from rotkv.kernels.cuda_write import SOURCE as WRITE_SOURCE
    from rotkv.quant.quantizer import _round_dir

    wrapper = tmp_path / "e4m3_host.cu"
    wrapper.write_text(f'#define ROTKV_META8 1\n#include "{WRITE_SOURCE}"\n'
                       'extern "C" int e4m3_host(float x, int up, float* val) { return e4m3_dir(x, up != 0, *val); }\n')
    lib_path = tmp_path / "e4m3_host.so"
    res = subprocess.run([NVCC, "-std=c++17", "-arch=sm_90", "-shared", "-Xcompiler", "-fPIC", "-o", str(lib_path), str(wrapper)],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    lib = ctypes.CDLL(str(lib_path))
    lib.e4m3_host.restype = ctypes.c_int
    lib.e4m3_host.argtypes = [ctypes.c_float, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = codes[torch.isfinite(codes)]
    g = torch.Generator().manual_seed(0)
    xs = torch.cat([finite, finite * (1 + 2.0 ** -12), finite * (1 - 2.0 ** -12), torch.tensor([0.0, -0.0, 2.0 ** -10,
                    -(2.0 ** -10), 2.0 ** -9 * 0.999, 447.9, -447.9]),
                    torch.randn(4000, generator=g) * torch.exp2(torch.randint(-12, 9, (4000,), generator=g).float())])
    xs = xs[xs.abs() <= 448.0]
    for up in (False, True):
        want = _round_dir(xs, torch.float8_e4m3fn, up)
        val = ctypes.c_float()
        got = torch.tensor([lib.e4m3_host(float(x), int(up), ctypes.byref(val)) for x in xs.tolist()], dtype=torch.uint8)
        bad = (got != want.view(torch.uint8)).nonzero().flatten()[:5].tolist()
        assert not bad, [(xs[i].item(), got[i].item(), want.view(torch.uint8)[i].item()) for i in bad]
        vals = torch.tensor([(lib.e4m3_host(float(x), int(up), ctypes.byref(val)), val.value)[1] for x in xs.tolist()])
        assert torch.equal(vals, want.float()), (vals - want.float()).abs().max()
    val = ctypes.c_float()
    assert lib.e4m3_host(449.0, 1, ctypes.byref(val)) == 127 and lib.e4m3_host(-500.0, 0, ctypes.byref(val)) == 255
