"""studies/plot_vllm.py on the committed vLLM result files: the figures it reads (capacity from the engine at
gpu_memory_utilization, not from the fixed-budget long generation), the ratios, and the figure."""

import os

import pytest
from rotkv_testing import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("matplotlib")
plot = load_benchmark("plot_vllm", "studies")
R = "benchmarks/results/vllm-20261206-"
FILES = [R + "h100-run8-qwen3-8b-throughput-32k.json", R + "h100-run9-qwen3-8b-longgen-10gib.json",
         R + "h100-run8-qwen3-8b-tpot.json"]
RUN7 = [R + "h100-run7-qwen3-8b-throughput-32k.json", R + "h100-run7-qwen3-8b-longgen-10gib.json",
        R + "h100-run6-qwen3-8b-tpot-bf16.json", R + "h100-run6-qwen3-8b-tpot-rotkv.json"]


def test_the_figure_from_committed_results(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    data = plot.collect(FILES)
    cap, lg, lat = data["capacity"]["rows"], data["longgen"]["rows"], data["latency"]["rows"]
    assert cap["bf16"] == 394576 and cap["rotkv:quarot-int2"] == 2414144  # not the 10 GiB engine's 72,816
    assert lg["rotkv:quarot-int2"] / lg["bf16"] == pytest.approx(3.45, abs=0.01)  # what the README says
    assert set(lat) == {"bf16", "rotkv:quarot-int2"} and lat["rotkv:quarot-int2"] < lat["bf16"]
    assert "48 x (1024 + 8192), 10 GiB of KV" in data["longgen"]["sub"]
    tp = data["throughput"]["rows"]
    assert tp["rotkv:quarot-int2"] / tp["bf16"] == pytest.approx(1.83, abs=0.01)  # what the README says
    assert plot.collect(RUN7)["latency"]["rows"] == pytest.approx({"bf16": 8.4966, "rotkv:quarot-int2": 7.4794})
    out = tmp_path / "s.png"
    plot.plot(FILES, str(out))
    assert out.stat().st_size > 10_000


def test_files_without_a_workload_it_draws_are_refused(tmp_path):
    f = tmp_path / "x.json"
    f.write_text('{"settings": {}, "rows": [{"method": "bf16", "workload": "profile", "wall_s": 1}]}')
    with pytest.raises(SystemExit, match="no capacity"):
        plot.plot([str(f)], str(tmp_path / "x.png"))
