"""studies/plot_step_compile.py on the committed result files: bar labels, the figure, an empty file refused."""

import json
import os

import pytest
from rotkv_testing import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RES = os.path.join(ROOT, "benchmarks", "results")
pytest.importorskip("matplotlib")
plot = load_benchmark("plot_step_compile", "studies")

FILES = ["generate-compile-smollm2-1x4k-20261204-6e62d7f.json", "generate-compile-qwen8L-4x32k-20261204-6e62d7f.json",
         "generate-compile-real-smollm2-64x8k-20261204-d525038.json", "generate-compile-qwen36L-8x32k-20261204-d525038.json"]


def test_labels_name_the_preset_and_its_flags_but_the_graph():
    assert plot.label("rotkv:oscar-mix+graph+fold+compile") == "oscar-mix\n+ fold\n+ compile"
    assert plot.label("rotkv:bf16+graph") == "bf16"
    assert plot.label("hf-static-compile").startswith("HF Static")


def test_the_figure_from_committed_results(tmp_path):
    out = tmp_path / "c.png"
    assert plot.main([os.path.join(RES, f) for f in FILES] + ["--out", str(out)]) == 0
    assert out.stat().st_size > 10_000


def test_a_file_without_measured_rows_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"method": "rotkv:bf16+graph", "step_ms": float("nan")}]}))
    with pytest.raises(SystemExit, match="no measured rows"):
        plot.main([str(bad), "--out", str(tmp_path / "x.png")])
