"""studies/plot_refine.py on the committed result files: the points it reads, the figure, a bad file refused."""

import json
import os

import pytest
from rotkv_testing import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("matplotlib")
plot = load_benchmark("plot_refine", "studies")


def test_the_figure_from_committed_results(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "k.png"
    table = plot.plot(plot.RUNS, str(out))
    assert out.stat().st_size > 10_000
    assert len(table) == len(plot.RUNS)
    refine, quanto = table["oscar-refine@2048"], table["HF quanto INT4@2048"]
    assert 3.0 < refine["bits"] < 3.1 and refine["kl"] < quanto["kl"]  # what the docs say of these files
    assert table["oscar-refine@8192"]["bits"] < 3.0


def test_a_file_with_several_runs_is_refused(tmp_path):
    f = tmp_path / "two.json"
    f.write_text(json.dumps({"runs": {"a": {"bpe": 3, "kl": 0.1, "kl_ci95": 0.01}, "b": {"bpe": 3, "kl": 0.1, "kl_ci95": 0.01}}}))
    with pytest.raises(ValueError, match="expected one run"):
        plot.point(str(f), "lever")
    g = tmp_path / "eval.json"
    g.write_text(json.dumps({"records": [{"method": "int4", "task": "niah", "bpe_measured": 4, "kl": 0, "kl_ci95": 0}]}))
    with pytest.raises(ValueError, match="expected one nll record"):
        plot.point(f"{g}:int4", "eval")
