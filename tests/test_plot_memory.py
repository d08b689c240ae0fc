"""benchmarks/plot_memory.py on the committed result files: the capacity panel's labels, and the figure."""

import json
import os

import pytest
from rotkv_testing import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(ROOT, "benchmarks", "results")
pytest.importorskip("matplotlib")
plot_memory = load_benchmark("plot_memory")


def test_capacity_labels():
    lab = plot_memory.capacity_label
    assert lab({"tries": [[8, True], [12, False]], "max_batch": 8, "failed_at": 12}) == "8\n(< 12)"
    assert lab({"tries": [[128, True]], "max_batch": 128, "failed_at": None}) == ">= 128"
    assert lab({"tries": [], "max_batch": 0, "failed_at": None, "note": "failed: AssertionError"}).startswith("search failed")


def test_the_figure_from_committed_results(tmp_path):
    cap = [os.path.join(RES, f) for f in ("capacity-20261203-836f16b-16gb.json", "capacity-20261203-64f94e5-36l-int2.json",
                                          "capacity-20261203-64f94e5-36l-bf16.json")]
    for f in cap:
        assert json.load(open(f))["rows"]
    out = tmp_path / "m.png"
    assert plot_memory.main(["--generate", os.path.join(RES, "generate-20261203-5f66706-smollm2-64x8k.json"),
                             "--capacity", *cap, "--job", os.path.join(RES, "job-20261203-16d96fc.json"),
                             "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000
