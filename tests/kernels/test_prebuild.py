"""Ahead-of-time kernel builds (rotkv.kernels.prebuild, `rotkv build-kernels`): the plan names the
builds the default paths run, and after building them the loaders find every one in the cache
without running nvcc again. Needs ``nvcc`` (no GPU: the architecture is given)."""

import pytest
import torch

from rotkv.kernels import cuda_decode, cuda_write
from rotkv.kernels import nvcc as nvcc_build
from rotkv.kernels import prebuild
from rotkv.kernels.plan import DecodeConfig
from rotkv.kernels.plan import cuda_variant as _cuda_variant

NVCC = nvcc_build.nvcc_path()


def test_plan_follows_the_default_paths():
    builds, notes = prebuild.builds(128, 64)
    assert [b.stem for b in builds] == ["int2_decode", "quant_write", "quant_write"]
    assert dict(builds[0].macros) == cuda_decode._macros(_cuda_variant(DecodeConfig(), 128, 2))
    assert {dict(b.macros)["ROTKV_SPLIT"] for b in builds[1:]} == {1, cuda_write.PRECISIONS["bf16x2"]}
    assert notes == []
    # head_dim 64 scores with the fp16 query: the CUDA kernel's QF16 build
    builds, notes = prebuild.builds(64, 64)
    assert [b.stem for b in builds] == ["int2_decode", "quant_write", "quant_write"] and notes == []
    assert dict(builds[0].macros)["ROTKV_QF16"] == DecodeConfig().cuda_score_f16
    assert dict(prebuild.builds(128, 64)[0][0].macros)["ROTKV_QF16"] == 0  # int8 query above head_dim 64
    # INT4 pages and shapes outside the CUDA kernels
    assert [b.stem for b in prebuild.builds(128, 64, bits=4)[0]] == ["quant_write", "quant_write"]
    assert prebuild.builds(96, 32)[0] == [] and len(prebuild.builds(96, 32)[1]) == 2
    assert [b.stem for b in prebuild.builds(128, 64, rotate=False)[0]] == ["int2_decode", "quant_write"]
    with pytest.raises(ValueError, match="divide"):
        prebuild.builds(100, 64)


def test_builds_follow_the_value_metadata_and_the_refine_tier():
    """oscar-refine's decode build: e4m3 value metadata (ROTKV_VMETA8) and, where the ``refine_split`` switch has
    the CUDA kernel read the refine tier (``auto``: head_dim 64), the build that reads it (ROTKV_REFINE)."""
    from rotkv import switches

    def decode(d, **kw):
        return dict(prebuild.builds(d, 64, **kw)[0][0].macros)

    assert decode(64)["ROTKV_VMETA8"] == 0 and decode(64)["ROTKV_REFINE"] == 0
    assert decode(64, value_meta=torch.float8_e4m3fn)["ROTKV_VMETA8"] == 1
    assert decode(64, value_meta=torch.float8_e4m3fn, refine=True)["ROTKV_REFINE"] == 1  # auto: head_dim 64
    assert decode(128, refine=True)["ROTKV_REFINE"] == 0  # auto: the split at head_dim 128, the plain build
    with switches.override(refine_split="kernel"):
        assert decode(128, refine=True)["ROTKV_REFINE"] == 1
    with switches.override(refine_split="1"):
        assert decode(64, refine=True)["ROTKV_REFINE"] == 0
    # the loader's key: a variant without the refine entry is the same build as one with REFINE 0
    v = _cuda_variant(DecodeConfig(), 64, 1)
    assert cuda_decode._macros(v) == cuda_decode._macros((*v, 0))


def test_build_kernels_builds_what_the_preset_runs(monkeypatch, capsys):
    """`rotkv build-kernels --preset oscar-refine`: the decode build with e4m3 value metadata and the refine tier."""
    from rotkv.cli import main

    seen = []
    monkeypatch.setattr(prebuild, "build", lambda builds, arch, jobs=4, progress=True: seen.extend(builds) or [])
    monkeypatch.setattr(nvcc_build, "nvcc_path", lambda: "/bin/true")
    assert main(["build-kernels", "--head-dim", "64", "--arch", "90", "--preset", "oscar-refine"]) == 0
    macros = dict(seen[0].macros)
    assert seen[0].stem == "int2_decode" and macros["ROTKV_VMETA8"] == 1 and macros["ROTKV_REFINE"] == 1


@pytest.mark.skipif(NVCC is None, reason="nvcc not found")
def test_loaders_find_the_prebuilt_libraries(tmp_path, monkeypatch, setenv):
    setenv("ROTKV_CACHE_DIR", str(tmp_path))
    builds, _ = prebuild.builds(128, 64)
    done = prebuild.build(builds, "90", jobs=2, progress=False)
    assert [fresh for *_, fresh in done] == [True] * 3 and all(p.exists() for _, p, _ in done)
    files = sorted(tmp_path.iterdir())
    # the loaders, as a call on an sm_90 GPU would run them: no nvcc now
    monkeypatch.setattr(nvcc_build, "arch", lambda device: "90")
    monkeypatch.setattr(nvcc_build.subprocess, "run", lambda *a, **k: pytest.fail("nvcc ran again"))
    monkeypatch.setattr(nvcc_build, "_LIBS", {})
    monkeypatch.setattr(nvcc_build, "_LOADED", {})
    dev = torch.device("cpu")
    cuda_decode.build(dev, _cuda_variant(DecodeConfig(), 128, 2))
    for split in (1, 2):
        cuda_write.build(dev, 128, 64, 2, split, cuda_write.default_warps(128, "bf16x2", split == 2))
    assert sorted(tmp_path.iterdir()) == files
    assert [fresh for *_, fresh in prebuild.build(builds, "90", progress=False)] == [False] * 3


def test_build_kernels_lists_the_int4_key_build_with_the_cuda_key4_switch(monkeypatch, capsys, setenv):
    """oscar-refine's 4-bit-key layers (``k_bits="artifact"``): their decode build (ROTKV_K4, the values' refine
    ring at head_dim 64) is listed with the ``cuda_key4`` switch on (the default), a note says Triton runs them
    without it."""
    from rotkv import switches
    from rotkv.cli import main

    with switches.override(cuda_key4=False):
        builds, notes = prebuild.builds(64, 64, value_meta=torch.float8_e4m3fn, refine=True, key_bits=(4,))
    assert [dict(b.macros)["ROTKV_K4"] for b in builds if b.stem == "int2_decode"] == [0]
    assert any("cuda_key4=1" in n and "INT4-key layers" in n for n in notes)
    with switches.override(cuda_key4=True):
        builds, notes = prebuild.builds(64, 64, value_meta=torch.float8_e4m3fn, refine=True, key_bits=(4, 2))
    decode = [dict(b.macros) for b in builds if b.stem == "int2_decode"]
    assert [(m["ROTKV_K4"], m["ROTKV_REFINE"], m["ROTKV_VMETA8"]) for m in decode] == [(0, 1, 1), (1, 1, 1)]
    assert notes == []
    seen = []
    monkeypatch.setattr(prebuild, "build", lambda builds, arch, jobs=4, progress=True: seen.extend(builds) or [])
    monkeypatch.setattr(nvcc_build, "nvcc_path", lambda: "/bin/true")
    setenv("ROTKV_TUNING", "cuda_key4=1")  # the command reads the switches from the environment
    assert main(["build-kernels", "--head-dim", "64", "--arch", "90", "--preset", "oscar-refine"]) == 0
    assert [dict(b.macros)["ROTKV_K4"] for b in seen if b.stem == "int2_decode"] == [0, 1]
    seen.clear()
    setenv("ROTKV_TUNING", "cuda_key4=0")
    assert main(["build-kernels", "--head-dim", "64", "--arch", "90", "--preset", "oscar-refine"]) == 0
    assert [dict(b.macros)["ROTKV_K4"] for b in seen if b.stem == "int2_decode"] == [0]
    assert "cuda_key4=1" in capsys.readouterr().out
