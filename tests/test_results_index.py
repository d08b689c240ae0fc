"""benchmarks/results/INDEX.md names every result file and is what benchmarks/results_index.py writes;
benchmarks/results_io.py stamps and names what the tools write. Cheap: no model, no GPU."""

import datetime
import json
import os
import re
import shutil
import subprocess

import pytest
from rotkv_testing import load_benchmark

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ri = load_benchmark("results_index")
rio = load_benchmark("results_io")
INDEX = os.path.join(ROOT, "benchmarks", "results", "INDEX.md")


def test_index_lists_exactly_the_files_present():
    """Every result file is in INDEX.md's list and every file it names exists (git not needed)."""
    text = open(INDEX).read()
    listed = set(re.findall(r"`([^`]+\.(?:json|log|txt))`", text.split("## All files", 1)[1]))
    present = {p.name for p in ri.result_files()}
    assert listed == present, (f"INDEX.md is stale (run python benchmarks/results_index.py): "
                               f"missing {sorted(present - listed)}, gone {sorted(listed - present)}")


def test_index_is_current():
    """INDEX.md is byte for byte what the script writes now (needs git to know the commits named)."""
    if shutil.which("git") is None or subprocess.run(["git", "-C", ROOT, "rev-parse"], capture_output=True).returncode:
        pytest.skip("no git checkout: the order of the runs comes from git")
    text, complete = ri.build()
    if not complete:
        pytest.skip("git does not know every commit the results name (a stale .git, as on the device copy)")
    assert open(INDEX).read() == text, "INDEX.md is stale: run python benchmarks/results_index.py"


@pytest.mark.parametrize("name, kind", [
    ("decode-20261202-6997c50.json", "decode"), ("decode-d64-20261202-0655.json", "decode-d64"),
    ("decode-error-20261202-fe69f15.json", "decode-error"), ("jobprof-20261201-2235.json", "jobprof"),
    ("job-20261201-0703.json", "job"), ("sass-decode-vf16-f8-20261202.json", "sass-decode"),
    ("seam_figures_after.json", "seam_figures"), ("stepprof-qwen8L-4x32k.json", "stepprof"),
    ("prefill-chunk-kl-20261202-cpu.json", "prefill-chunk-kl"), ("capacity-20261202-1900-b64.json", "capacity")])
def test_kind_of(name, kind):
    assert ri.kind_of(name) == kind


def test_writer_stamps_names_and_index_reads_it_back(tmp_path, setenv):
    setenv("ROTKV_COMMIT", "abc1234")
    now = datetime.datetime(2026, 12, 2, 19, 5, 7, tzinfo=datetime.timezone.utc)
    rows = [dict(impl="x", ms=1.0, gpu="already set"), dict(impl="y", ms=2.0)]
    path = rio.write_results("write", rows, tag="cuda-warps", now=now, root=tmp_path)
    assert path.name == "write-20261202-1905-cuda-warps.json"
    got = json.loads(path.read_text())
    assert [r["impl"] for r in got] == ["x", "y"] and got[0]["gpu"] == "already set"
    assert all(r["commit"] == "abc1234" and r["utc"] == "2026-12-02T19:05:07Z" and r["cpu"] for r in got)
    d = rio.write_results("jobprof", dict(step_ms=3.0), now=now, root=tmp_path)
    assert json.loads(d.read_text())["commit"] == "abc1234"
    assert ri.read_stamp(path)[:2] == ("abc1234", "2026-12-02T19:05:07Z")
    text, _ = ri.build(tmp_path)
    assert "write-20261202-1905-cuda-warps.json" in text and "jobprof-20261202-1905.json" in text
    out = rio.write_results("write", rows, out=tmp_path / "sub" / "mine.json", now=now)
    assert out == tmp_path / "sub" / "mine.json" and out.exists()


@pytest.mark.parametrize("bad", [dict(kind="write/../x"), dict(kind="write", tag="a b")])
def test_writer_refuses_bad_names(tmp_path, bad):
    with pytest.raises(ValueError, match="letters, digits"):
        rio.write_results(bad["kind"], [], tag=bad.get("tag"), root=tmp_path)


def test_writer_refuses_rows_that_are_not_dicts(tmp_path):
    with pytest.raises(TypeError, match="list of results must hold dicts"):
        rio.write_results("write", [1, 2], root=tmp_path)
