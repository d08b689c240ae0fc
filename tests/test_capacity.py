"""The capacity search (rotkv.bench.max_batch) against fake runners that run out of memory above a threshold."""

import json

import pytest
import torch

from rotkv.bench import is_oom, max_batch


def runner(threshold, calls):
    def run(b):
        calls.append(b)
        if b > threshold:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {b} GiB")
        return {"batch": b}
    return run


@pytest.mark.parametrize("threshold", [1, 2, 3, 5, 8, 13, 64, 100])
@pytest.mark.parametrize("start", [1, 4, 32])
def test_finds_the_largest_batch_that_fits(threshold, start):
    calls = []
    cap = max_batch(runner(threshold, calls), start=start)
    assert cap.max_batch == threshold and cap.failed_at == threshold + 1 and cap.exact
    assert cap.result == {"batch": threshold}
    assert [b for b, _ in cap.tries] == calls and len(calls) == len(set(calls))
    assert all(ok == (b <= threshold) for b, ok in cap.tries)


def test_doubles_then_bisects():
    cap = max_batch(runner(13, []), start=1)
    assert [b for b, _ in cap.tries] == [1, 2, 4, 8, 16, 12, 14, 13]


def test_nothing_fits_and_the_limit():
    cap = max_batch(runner(0, []), start=4)
    assert cap.max_batch == 0 and cap.failed_at == 1 and cap.result is None
    cap = max_batch(runner(1000, []), start=3, limit=20)
    assert cap.max_batch == 20 and cap.failed_at is None and not cap.exact
    assert [b for b, _ in cap.tries] == [3, 6, 12, 20]


def test_max_tries_bounds_the_search():
    cap = max_batch(runner(100, []), start=8, max_tries=3)
    assert len(cap.tries) == 3 and cap.max_batch == 32 and cap.failed_at is None and not cap.exact
    cap = max_batch(runner(40, []), start=8, max_tries=4)  # 8 16 32 64x: answer in [32, 64)
    assert (cap.max_batch, cap.failed_at, cap.exact) == (32, 64, False)


def test_other_errors_propagate_and_oom_is_recognised():
    def bad(b):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        max_batch(bad)
    with pytest.raises(ValueError, match="start"):
        max_batch(runner(3, []), start=0)
    wrapped = RuntimeError("backend compiler failed")
    wrapped.__cause__ = torch.cuda.OutOfMemoryError("x")
    assert is_oom(wrapped) and is_oom(RuntimeError("CUDA error: out of memory")) and not is_oom(ValueError("x"))


def test_cli_max_batch_on_the_cpu(tmp_path, capsys):
    """`rotkv bench --max-batch` end to end on a tiny random model (nothing runs out of memory on
    the CPU, so the limit ends the search) writes capacity rows."""
    from rotkv.cli import main

    out = tmp_path / "cap.json"
    assert main(["bench", "--random", "smollm2", "--layers", "1", "--device", "cpu", "--max-batch", "--context", "40",
                 "--new-tokens", "3", "--limit", "2", "--prefill-chunk", "16", "--methods", "rotkv:quarot-int2",
                 "hf-dynamic", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["rotkv:quarot-int2", "hf-dynamic"]
    for r in rows:
        assert r["max_batch"] == 2 and r["tries"] == [[1, True], [2, True]] and r["context"] == 40
        assert r["layers"] == 1 and r["prefill_chunk"] == 16 and r["step_ms"] > 0 and r["prefill_s"] > 0
        assert set(r) >= {"method", "model", "layers", "context", "max_batch", "peak_gb", "prefill_s", "step_ms", "commit"}


def test_a_later_error_keeps_the_tries_before_it(monkeypatch):
    """A try that fails with an error other than out-of-memory (the H200's StaticCache + compile raised
    an AssertionError at batch 10 after 16x 8 12x) ends that method's search, but its row keeps what the
    finished tries found: max batch 8, failed at 12, the tries, and the error in the note."""
    import types

    import rotkv.bench as bench

    def fake_run(model, m, prompts, *a, **k):
        b = prompts
        if b == 10:
            raise AssertionError("recompile")
        if b > 8:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return types.SimpleNamespace(prefill_s=1.5, step_ms=2.5), {"peak_gb": 3.0}

    monkeypatch.setattr(bench, "run_method", fake_run)
    monkeypatch.setattr(bench, "prompts", lambda vocab, b, context: b)
    model = types.SimpleNamespace(device=torch.device("cpu"),
                                  config=types.SimpleNamespace(vocab_size=10, num_hidden_layers=2))
    (row,) = bench.capacity(model, "fake", ["m"], 64, new_tokens=1, start=16, max_tries=4)
    assert (row.max_batch, row.failed_at, row.exact) == (8, 12, False)
    assert row.tries == [(16, False), (8, True), (12, False)] and row.peak_gb == 3.0 and row.step_ms == 2.5
    assert row.note.startswith("failed: AssertionError: recompile")
