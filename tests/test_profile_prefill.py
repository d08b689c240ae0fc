"""studies/profile_prefill.py at a tiny shape on the CPU: the profile and the sweep write rows
with positive times (the GPU runs use the same code at full shapes)."""

import json

import pytest
from rotkv_testing import load_benchmark

pytestmark = pytest.mark.filterwarnings("ignore")


def _script():
    return load_benchmark("profile_prefill", "studies")


SHAPE = ["--random", "smollm2", "--layers", "2", "--batch", "2", "--context", "96", "--device", "cpu"]


def test_profile_rows(tmp_path):
    out = tmp_path / "prof.json"
    res = _script().main(SHAPE + ["--methods", "bf16", "rotkv:quarot-int2+graph", "hf-static", "--prefill-tokens", "64",
                                  "--top", "5", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["bf16", "rotkv:quarot-int2+graph", "hf-static"] == [r["method"] for r in res["rows"]]
    for r in rows:
        assert r["prefill_s"] > 0 and r["profiled_s"] > 0 and r["device_ms"] > 0
        assert 0 < len(r["top"]) <= 5 and all(t["ms"] > 0 for t in r["top"])
        assert sum(r["categories"].values()) == pytest.approx(r["device_ms"], rel=1e-3, abs=0.01)
        assert r["categories"].get("matmul/gemm", 0) > 0 and r["categories"].get("attention", 0) > 0
    assert [r["model_calls"] for r in rows] == [3, 3, 1]  # 64 tokens a call over 2 rows: 32 a row
    md = (tmp_path / "prof.md").read_text()
    assert "| rotkv:quarot-int2+graph | 2 x 96 | 32 / 3 |" in md and "top ops" in md


def test_sweep_rows(tmp_path):
    out = tmp_path / "sweep.json"
    _script().main(SHAPE + ["--methods", "bf16", "hf-static", "--sweep-prefill-tokens", "64", "256",
                            "--prefill-chunk", "48", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["method"], r["prefill_tokens"], r["chunk"]) for r in rows] == [
        ("bf16", 64, 32), ("bf16", 256, 48), ("hf-static", 192, 96)]
    assert all(r["prefill_s"] > 0 and not r["note"] for r in rows)
    # the peak is read before the run cleans up (a read after it is the weights alone: the same for every row)
    assert all(r["peak_gb"] > 0 for r in rows)


def test_categories():
    cat = _script().category
    assert cat("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>") == "attention"
    assert cat("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert cat("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "matmul/gemm"
    assert cat("_quant_write_kernel") == "rotkv kernels" and cat("_dequant_kernel") == "rotkv kernels"
    assert cat("void at::native::bfloat16_copy_kernel_cuda(at::TensorIterator&)") == "copies/cat/index"
    assert cat("void at::native::index_elementwise_kernel<128, 4>") == "copies/cat/index"
    assert cat("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>") == "elementwise/norm"
    assert cat("Memcpy HtoD (Pageable -> Device)") == "copies/cat/index"
