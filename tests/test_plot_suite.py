"""studies/plot_suite.py on the committed suite files: what it reads, the figure, bad input refused."""

import json
import os

import pytest
from rotkv_testing import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("matplotlib")
plot = load_benchmark("plot_suite", "studies")
T2K = "docs/results/test2k-2048"


def test_the_figure_from_committed_suites(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "k.png"
    read = plot.plot([("2048", [f"{T2K}/t2k/suite.json", f"{T2K}/refine/suite.json", f"{T2K}/int4-w32/suite.json"])],
                     str(out))
    assert out.stat().st_size > 10_000
    m = read["2048"]
    assert set(m) == {"oscar-aqua", "hf-quanto-int4", "oscar-refine", "int4"}  # the reference left out
    # what the README's table says of these files
    assert round(m["oscar-aqua"]["all"][0], 4) == 0.0110 and round(m["hf-quanto-int4"]["all"][0], 4) == 0.0152
    assert round(m["oscar-refine"]["all"][0], 4) == 0.0230 and 3.0 < m["oscar-aqua"]["bits"] < 3.1
    assert m["oscar-aqua"]["windows"] == 16 and m["oscar-aqua"]["tokens"] == 2048


def _suite(path, domains, methods, length="2048"):
    entry = lambda kl: {"per_domain": {d: {"kl": kl, "kl_ci95": 0.001, "n": 64, "windows": 1} for d in domains}}  # noqa: E731
    path.write_text(json.dumps({"domains": domains, "lengths": {length: {"methods": {m: entry(v) for m, v in methods.items()}}}}))
    return str(path)


def test_the_mean_and_the_first_file_win_and_bad_panels_are_refused(tmp_path):
    a = _suite(tmp_path / "a.json", ["prose", "code"], {"int4": 0.01})
    b = _suite(tmp_path / "b.json", ["prose", "code"], {"int4": 0.5, "oscar-refine": 0.02})
    domains, m = plot.read_panel([a, b], "2048")
    assert m["int4"]["all"][0] == pytest.approx(0.01) and m["oscar-refine"]["all"][0] == pytest.approx(0.02)
    assert m["int4"]["all"][1] == pytest.approx(0.001 * 2**0.5 / 2)  # no suite interval: the domains' combined
    with pytest.raises(ValueError, match="no length 8192"):
        plot.read_panel([a], "8192")
    with pytest.raises(ValueError, match="differ from the panel"):
        plot.read_panel([a, _suite(tmp_path / "c.json", ["prose"], {"int4": 0.01})], "2048")
    with pytest.raises(SystemExit):
        plot.main(["--panel", "a.json", "--out", str(tmp_path / "x.png")])
