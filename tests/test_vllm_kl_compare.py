"""The CPU-checkable parts of benchmarks/vllm_kl_compare.py: the forcing of a decode step, the dense log-probs
and their checks, the KL reduction, the bootstrap, the windows of the held-out text, and the JSON the driver
writes (both GPU sides replaced by fakes). The vLLM logits processor class is checked where vLLM imports."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import vllm_kl_compare as kc  # noqa: E402


def test_forced_row_keeps_only_the_texts_next_token():
    logits = torch.randn(10)
    out = kc.forced_row(logits, [4, 4], [3, 5, 7])  # two tokens out: step 2 is forced to 7
    assert out.argmax().item() == 7 and out[7] == 0 and torch.isinf(out[torch.arange(10) != 7]).all()
    assert kc.forced_row(logits, [], [3, 5, 7]).argmax().item() == 3
    assert kc.forced_row(logits, [1, 2, 3], [3, 5, 7]) is logits  # past the forced ids: untouched


def test_force_processor_in_vllms_batch_machinery():
    """The processor as vLLM drives it: loaded by its qualified name, a request added through a BatchUpdate,
    each step forced to the next id as the request's output list grows; the sampling params and engine
    arguments the script passes are vLLM's; its flat log-probs become a dense row."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs
    from vllm.v1.sample.logits_processor import BatchUpdate, _load_logitsprocs_by_fqcns

    (cls,) = _load_logitsprocs_by_fqcns(["vllm_kl_compare:ForceTextTokens"])
    proc = cls(None, torch.device("cpu"), False)
    assert proc.is_argmax_invariant() is False
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=-1, flat_logprobs=True,
                        detokenize=False, extra_args={kc.FORCED_KEY: [2, 6, 1]})
    other = SamplingParams(temperature=0.0, max_tokens=3)
    out0: list[int] = []
    proc.update_state(BatchUpdate(batch_size=2, removed=[], added=[(0, sp, [9, 9], out0), (1, other, [9], [])], moved=[]))
    logits = torch.randn(2, 8)
    for want in (2, 6, 1):
        got = proc.apply(logits.clone())
        assert got[0].argmax().item() == want and torch.isinf(got[0]).sum() == 7
        assert torch.equal(got[1], logits[1])  # a request without forced ids is untouched
        out0.append(want)
        proc.update_state(None)
    import dataclasses

    spec = dict(model_dir="m", prompt_len=64, new_tokens=8, chunk=32, gpu_memory_utilization=0.5, enforce_eager=False,
                configs={"quarot-int2": {"preset": "quarot-int2"}})
    kw = kc.engine_kwargs(spec, "quarot-int2")
    assert set(kw) <= {f.name for f in dataclasses.fields(EngineArgs)}
    assert kw["max_num_batched_tokens"] == 32 and kw["max_model_len"] == 64 + 8 + 16 and kw["attention_backend"] == "CUSTOM"
    assert "attention_backend" not in kc.engine_kwargs(spec, "bf16")
    flat = create_sample_logprobs(True)
    lp = torch.log_softmax(torch.randn(8, dtype=torch.float64), -1)
    order = lp.argsort(descending=True).tolist()
    append_logprobs_for_next_position(flat, [6] + order, [lp[6].item()] + lp[order].tolist(), [None] * 9, 3, -1)
    s, e = flat.start_indices[0], flat.end_indices[0]
    row = kc.dense_logprobs(flat.token_ids[s:e], flat.logprobs[s:e], 8)
    assert torch.allclose(torch.from_numpy(row).double(), lp, atol=1e-6)


def test_dense_logprobs_needs_the_full_normalized_vocabulary():
    lp = torch.log_softmax(torch.randn(12, dtype=torch.float64), -1)
    ids = list(range(12))
    sampled = [5]  # vLLM puts the sampled token first, then the whole vocabulary again
    row = kc.dense_logprobs(sampled + ids[::-1], [lp[5].item()] + lp.flip(0).tolist(), 12)
    assert row.shape == (12,) and torch.allclose(torch.from_numpy(row).double(), lp, atol=1e-6)
    with pytest.raises(AssertionError, match="11 of 12 tokens"):
        kc.dense_logprobs(ids[:-1], lp[:-1].tolist(), 12)
    with pytest.raises(AssertionError, match="raw_logprobs"):
        kc.dense_logprobs(ids, (lp + 0.5).tolist(), 12)
    with pytest.raises(AssertionError, match="flat logits"):  # what an engine without the embeddings returns
        kc.dense_logprobs(ids, [-math.log(12)] * 12, 12)


def test_kl_rows_is_the_forward_kl():
    ref = torch.log_softmax(torch.randn(3, 20), -1)
    q = torch.log_softmax(torch.randn(3, 20), -1)
    want = torch.nn.functional.kl_div(q, ref, log_target=True, reduction="none").sum(-1)
    assert torch.allclose(kc.kl_rows(ref, q), want, atol=1e-6)
    assert torch.allclose(kc.kl_rows(ref, ref), torch.zeros(3))
    assert torch.all(kc.kl_rows(ref, q) > 0)
    with pytest.raises(AssertionError, match="differ"):
        kc.kl_rows(ref, q[:2])


def test_bootstrap_and_method_row():
    b = [[0.1, 0.2], [0.3, 0.1], [0.2, 0.4]]
    a = [[2 * x for x in w] for w in b]
    assert kc.bootstrap_ratio(a, b) == pytest.approx([2.0, 2.0])
    lo, hi = kc.bootstrap_ratio([[0.1, 0.2], [0.5, 0.1], [0.2, 0.1]], b)
    assert lo < hi
    with pytest.raises(ValueError):
        kc.bootstrap_ratio(a, b[:2])
    v = dict(kl=a, nll=b, top1=[[1.0, 0.0]] * 3)
    r = {"float32": dict(kl=b, nll=b), "bfloat16": dict(kl=[[1.05 * x for x in w] for w in a], nll=b)}
    row = kc.method_row(v, r)
    assert row["n_tokens"] == 6 and row["windows"] == 3 and row["vllm_top1"] == 0.5
    assert row["ratio"] == pytest.approx(1 / 1.05) and row["within_10pct"]
    assert row["ratio_fp32_model"] == pytest.approx(2.0) and row["rotkv_kl_fp32_model"] == pytest.approx(1.3 / 6)
    with pytest.raises(AssertionError, match="scored 4 tokens"):
        kc.method_row(v, {"bfloat16": dict(kl=b[:2], nll=b[:2])})


class Tok:
    """Four characters a token."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(text[i]) for i in range(0, len(text) - 3, 4)]}


def test_windows_spread_over_the_suite_domains():
    ws = kc.windows(Tok(), "test", 6, 100, 20)
    assert len(ws) == 6 and all(len(w["ids"]) == 120 for w in ws)
    doms = [w["domain"] for w in ws]
    assert sorted(set(doms)) == ["code", "dialogue", "docs", "prose"]  # 6 over 4 domains: 2, 2, 1, 1
    assert all(w["text"].startswith("rotkv/data/suite/") and w["text"].endswith("_test.txt") for w in ws)
    two = [w for w in ws if w["domain"] == doms[0]]
    assert len(two) == 2 and two[0]["start"] == 0 and two[1]["start"] > 0


def test_driver_writes_the_json(tmp_path, monkeypatch):
    """main() with both GPU sides faked: the spec each side gets, the JSON and the table."""
    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: Tok())
    seen = []

    def fake_run(side, spec_path, result_path, env):
        spec = json.loads(Path(spec_path).read_text())
        seen.append((side, spec["methods"], env["VLLM_USE_V2_MODEL_RUNNER"]))
        n, R = spec["new_tokens"], len(spec["windows"])
        res = {}
        for m in spec["methods"]:
            kl = [[0.01 * (i + 1)] * n for i in range(R)]
            if side == "_vllm":
                res[m] = dict(kl=[[1.02 * x for x in w] for w in kl], nll=kl, top1=kl, engine_kwargs={"seed": 0})
            else:
                res[m] = {dt: dict(kl=kl, nll=kl) for dt in spec["rotkv_dtypes"]}
        Path(result_path).write_text(json.dumps(res))
        return 0

    monkeypatch.setattr(kc, "run_side", fake_run)
    out = tmp_path / "kl.json"
    assert kc.main(["--model-dir", str(tmp_path), "--methods", "bf16,rotkv:quarot-int2", "--sink", "16",
                    "--window", "32", "--prompt-len", "64", "--new-tokens", "8", "--requests", "4",
                    "--rotkv-dtypes", "bfloat16,float32", "--out", str(out)]) == 0
    assert seen == [("_rotkv", ["bf16", "quarot-int2"], "0"), ("_vllm", ["bf16"], "0"), ("_vllm", ["quarot-int2"], "0")]
    data = json.loads(out.read_text())
    assert data["schema"] == "rotkv-vllm-kl/1" and data["complete"] and data["split"] == "test" and data["chunk"] == 64
    assert len(data["windows"]) == 4 and data["settings"]["quarot-int2"] == {"preset": "quarot-int2", "sink": 16, "window": 32}
    row = data["methods"]["quarot-int2"]
    assert row["ratio"] == pytest.approx(1.02) and row["within_10pct"] and row["n_tokens"] == 32
    assert row["ratio_ci95"] == pytest.approx([1.02, 1.02]) and row["ratio_fp32_model"] == pytest.approx(1.02)
    with pytest.raises(SystemExit, match="--rotkv-dtypes"):
        kc.main(["--model-dir", str(tmp_path), "--rotkv-dtypes", "float32"])

    # a vLLM engine that fails: the other methods still run, the JSON says which failed, the exit is loud
    def failing(side, spec_path, result_path, env):
        spec = json.loads(Path(spec_path).read_text())
        return 1 if side == "_vllm" and spec["methods"] == ["bf16"] else fake_run(side, spec_path, result_path, env)

    monkeypatch.setattr(kc, "run_side", failing)
    with pytest.raises(SystemExit, match="failed for .'bf16'."):
        kc.main(["--model-dir", str(tmp_path), "--methods", "bf16,quarot-int2", "--prompt-len", "64", "--new-tokens", "8",
                 "--requests", "4", "--out", str(out)])
    data = json.loads(out.read_text())
    assert not data["complete"] and data["methods"]["bf16"]["vllm_failed"] == "exit 1"
    assert "rotkv_kl" in data["methods"]["bf16"] and "ratio" in data["methods"]["quarot-int2"]
