"""The CPU-checkable parts of benchmarks/bench_vllm.py (no vLLM needed): argument parsing, the plan and each
method's engine kwargs, the random prompts, the log parser, the result rows and summary, the model dirs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_vllm as bv  # noqa: E402


def _args(*argv):
    return bv.build_parser().parse_args(["run", *argv])


def test_methods_and_workloads_parse():
    assert bv.parse_methods("bf16, fp8,rotkv:oscar-mix") == ["bf16", "fp8", "rotkv:oscar-mix"]
    assert bv.parse_methods("turboquant") == list(bv.TURBOQUANT)
    assert bv.parse_methods("bf16,turboquant_3bit_nc", turboquant_available=False) == ["bf16"]
    for bad in ("bf17", "rotkv:", "bf16,bf16"):
        with pytest.raises(ValueError, match="--methods"):
            bv.parse_methods(bad)
    assert bv.parse_workloads("capacity,latency") == ["capacity", "latency"]
    with pytest.raises(ValueError, match="--workloads"):
        bv.parse_workloads("capacity,speed")


def test_plan_sizes_and_engine_kwargs():
    p = bv.plan(_args("--methods", "bf16,fp8,turboquant_k3v4_nc,rotkv:quarot-int2,rotkv:quarot-int2@piecewise",
                      "--model-root", "/m",
                      "--rotkv-config", '{"sink": 16, "window": 32}', "--tp-requests", "8"))
    assert p["dummy"] and p["model_path"] == "/m/qwen3-8b-dummy"
    assert p["sizes"]["tp_requests"] == 8 and p["sizes"]["tp_prompt"] == 32768 and p["sizes"]["lg_new"] == 16384
    assert p["max_model_len"] == 32768 + 1024  # the throughput request is the longest
    e = p["engines"]
    assert all(k["enable_prefix_caching"] is False and k["gpu_memory_utilization"] == 0.9
               and k["load_format"] == "dummy" and k["max_model_len"] == 33792 for k in e.values())
    assert "kv_cache_dtype" not in e["bf16"] and "attention_backend" not in e["bf16"]
    assert e["fp8"]["kv_cache_dtype"] == "fp8" and e["turboquant_k3v4_nc"]["kv_cache_dtype"] == "turboquant_k3v4_nc"
    r = e["rotkv:quarot-int2"]
    assert r["attention_backend"] == "CUSTOM" and r["block_size"] == 16
    assert r["additional_config"] == {"rotkv": {"preset": "quarot-int2", "sink": 16, "window": 32}}
    assert "compilation_config" not in r  # vLLM's own graph mode: decode batches in full graphs
    r = e["rotkv:quarot-int2@piecewise"]
    assert r["additional_config"] == {"rotkv": {"preset": "quarot-int2", "sink": 16, "window": 32,
                                                "cuda_graphs": False}}
    assert r["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    with pytest.raises(ValueError, match="unknown method"):
        bv.parse_methods("rotkv:quarot-int2@full")
    json.dumps(p)  # the plan goes into the JSON as it is

    s = bv.plan(_args("--model", "smollm2", "--workloads", "longgen", "--methods", "bf16", "--enforce-eager",
                      "--engine-kwargs", '{"max_num_seqs": 8}'))
    assert not s["dummy"] and s["max_model_len"] == 1024 + 7168 <= 8192
    assert s["engines"]["bf16"]["enforce_eager"] and s["engines"]["bf16"]["max_num_seqs"] == 8
    assert "load_format" not in s["engines"]["bf16"]


def test_random_prompts_are_reproducible_and_in_range():
    a = bv.random_prompts(3, 50, 1000, seed=7)
    assert a == bv.random_prompts(3, 50, 1000, seed=7) != bv.random_prompts(3, 50, 1000, seed=8)
    assert [len(x) for x in a] == [50, 50, 50] and all(10 <= t < 990 for x in a for t in x)
    with pytest.raises(ValueError):
        bv.random_prompts(0, 5, 100, 0)


LOG = """INFO 12-05 07:00:01 [kv_cache_utils.py:2177] GPU KV cache size: 401,312 tokens
INFO 12-05 07:00:01 [kv_cache_utils.py:2180] Maximum concurrency for 33,792 tokens per request: 11.88x
"""


def test_log_parse_merge_and_summary():
    assert bv.parse_log(LOG) == {"vllm_log_kv_tokens": 401312, "vllm_log_max_concurrency": 11.88,
                                 "vllm_log_concurrency_tokens": 33792}
    assert bv.parse_log("nothing here") == {}
    eng = {"num_gpu_blocks": None, "block_size": 16}
    ok = bv.merge("bf16", {"model": "m"}, {"engine": eng, "rows": [
        {"method": "bf16", "workload": "capacity", "kv_tokens": 0},
        {"method": "bf16", "workload": "throughput", "output_tok_s": 100.0}]}, LOG, ["capacity", "throughput"])
    assert ok[0]["kv_tokens"] == 401312 and ok[0]["engine_kwargs"] == {"model": "m"} and ok[1]["engine"] == eng
    err = bv.merge("fp8", {}, {"error": "RuntimeError: boom"}, "a\nb\n" + LOG, ["capacity", "latency"])
    assert [r["workload"] for r in err] == ["capacity", "latency"] and all(r["error"].endswith("boom") for r in err)
    assert "GPU KV cache size" in err[0]["log_tail"]
    rows = ok + [dict(method="fp8", workload="capacity", kv_tokens=802624),
                 dict(method="rotkv:quarot-int2", workload="capacity", kv_tokens=1605248),
                 dict(method="rotkv:quarot-int2", workload="latency", ttft_s=1.0, tpot_ms=5.0),
                 dict(method="bf16", workload="latency", ttft_s=2.0, tpot_ms=10.0)] + err[1:]
    s = {(e["method"], e["workload"], e["metric"]): e for e in bv.summarize(rows)}
    assert s[("rotkv:quarot-int2", "capacity", "kv_tokens")]["vs_bf16"] == 4.0
    assert s[("rotkv:quarot-int2", "capacity", "kv_tokens")]["vs_fp8"] == 2.0
    assert s[("rotkv:quarot-int2", "latency", "tpot_ms")]["vs_bf16"] == 0.5
    assert ("fp8", "latency", "ttft_s") not in s  # the error row has no figure


def test_dry_run_prints_the_plan():
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "run", "--dry-run",
                        "--methods", "bf16,rotkv:oscar-mix", "--workloads", "capacity"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["workloads"] == ["capacity"] and p["max_model_len"] == 16 and set(p["engines"]) == {"bf16", "rotkv:oscar-mix"}
    bad = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "run", "--methods", "int3"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "--methods" in bad.stderr


def test_dummy_model_dir_loads_in_transformers(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    small = {**bv.QWEN3_8B, "vocab_size": 1000, "bos_token_id": 998, "eos_token_id": 999}
    d = bv.write_dummy_model_dir(tmp_path / "small", small)
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    assert len(tok) == 1000 and tok.eos_token_id == 999
    ids = [5, 17, 998, 3]
    assert tok(tok.decode(ids), add_special_tokens=False)["input_ids"] == ids

    d8 = tmp_path / "q"
    d8.mkdir()
    (d8 / "config.json").write_text(json.dumps(bv.QWEN3_8B))
    cfg = AutoConfig.from_pretrained(d8, local_files_only=True)
    assert cfg.model_type == "qwen3" and cfg.architectures == ["Qwen3ForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (36, 32, 8, 128)
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    assert rope["rope_theta"] == 1e6


def test_model_dir_lookup(tmp_path):
    with pytest.raises(FileNotFoundError, match="prepare"):
        bv.model_dir("smollm2", tmp_path)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text("{}")
    assert bv.model_dir(str(tmp_path / "x"), "/nowhere") == tmp_path / "x"


@pytest.mark.slow
def test_smollm2_dir_is_rotkvs_converted_copy(tmp_path):
    import os

    gguf = os.environ.get("ROTKV_GGUF") or None
    try:
        d = bv.write_smollm2_dir(tmp_path / "smollm2", gguf)
    except FileNotFoundError as e:
        pytest.skip(str(e))
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    src = Path((d / "SOURCE").read_text().strip())
    from safetensors import safe_open

    with safe_open(str(src / "model.safetensors"), "pt") as f:
        src_names = set(f.keys())
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        # vLLM's Llama skips lm_head.* when the embeddings are tied: it must find the matrix as embed_tokens
        assert bv.EMBED in names and src_names <= names
        if bv.EMBED not in src_names:
            assert not (d / "model.safetensors").is_symlink()
            assert torch.equal(f.get_tensor(bv.EMBED), f.get_tensor("lm_head.weight"))
    assert (d / "tokenizer.json").exists()
    assert {k: v for k, v in cfg.items() if k != "architectures"} == json.loads((src / "config.json").read_text())
    assert bv.write_smollm2_dir(tmp_path / "smollm2", gguf) == d  # again: the same directory


def test_greedy_compare_parts(tmp_path):
    import vllm_greedy_compare as g

    assert g.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert g.first_divergence([1, 2, 3], [1, 5, 3]) == 1 and g.first_divergence([1, 2], [1, 2, 3]) == 2

    class A:
        artifact_dir, sink, window = None, 16, 32

    assert g.rotkv_config("quarot-int2", A) == {"preset": "quarot-int2", "sink": 16, "window": 32}
    with pytest.raises(ValueError, match="--artifact-dir"):
        g.rotkv_config("oscar-mix", A)
    A.artifact_dir = str(tmp_path)
    with pytest.raises(FileNotFoundError, match="oscar-mix.safetensors"):
        g.rotkv_config("oscar-mix", A)
    (tmp_path / "oscar-mix.safetensors").write_bytes(b"")
    assert g.rotkv_config("oscar-mix", A)["artifact"] == str((tmp_path / "oscar-mix.safetensors").resolve())

    v = {"m": dict(tokens=[1, 2, 3, 4], top2_logprob_gap=[1.0, 0.5, 0.01, 2.0])}
    r = {"m": dict(tokens=[1, 2, 9, 4], top2_logprob_gap=[1.1, 0.4, 0.02, 1.9], scores_run_tokens=[1, 2, 9, 4])}
    row = g.compare(v, r)["m"]
    assert not row["equal"] and row["first_divergence"] == 2 and row["agree_prefix"] == 2
    assert row["vllm_top2_gap_at_divergence"] == 0.01 and row["rotkv_top2_gap_at_divergence"] == 0.02
    assert row["rotkv_scores_run_equal"] and not row["vllm_degenerate"] and row["vllm_zero_gap_steps"] == 0
    flat = g.compare({"m": dict(tokens=[0, 0, 0], top2_logprob_gap=[0.0, 0.0, 0.3])},
                     {"m": dict(tokens=[5, 6, 7], top2_logprob_gap=[1.0, 1.0, 1.0])})["m"]
    assert flat["vllm_degenerate"] and flat["vllm_zero_gap_steps"] == 2
    assert g.compare(v, {"m": dict(tokens=[1, 2, 3, 4], top2_logprob_gap=[])})["m"]["equal"]

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    (tmp_path / "t.txt").write_text("abc")
    assert g.prompt_ids(Tok(), 7, tmp_path / "t.txt") == [97, 98, 99, 97, 98, 99, 97]


FAKE_VLLM = '''
import sys, time
from types import SimpleNamespace
__version__ = "0.0.fake"
CALLS = []

class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw

class Engine:  # LLMEngine's stepping surface: every step gives each running request one token; at most
    # max_num_seqs run at once, in the order they came (the rest wait, as for KV blocks)
    def __init__(self, vllm_config, max_len, slots=None):
        self.vllm_config, self.max_len, self.reqs, self.steps, self.slots = vllm_config, max_len, {}, 0, slots

    def add_request(self, request_id, prompt, params):
        assert len(prompt["prompt_token_ids"]) + params.kw["max_tokens"] <= self.max_len
        self.reqs[request_id] = [0, params.kw["max_tokens"]]
        return request_id

    def abort_request(self, request_ids, internal=False):
        for rid in request_ids:
            self.reqs.pop(rid, None)

    def has_unfinished_requests(self):
        return any(n < m for n, m in self.reqs.values())

    def step(self):
        self.steps += 1
        out = []
        running = [rid for rid, r in self.reqs.items() if r[0] < r[1]][: self.slots]
        time.sleep(0.002)
        for rid, r in self.reqs.items():
            if rid in running:
                r[0] += 1
                out.append(SimpleNamespace(request_id=rid, outputs=[SimpleNamespace(token_ids=list(range(r[0])))]))
        return out

class LLM:
    def __init__(self, **kw):
        if kw.get("kv_cache_dtype") == "fp8":
            raise RuntimeError("fake engine refuses fp8")
        blocks = 1000 if kw.get("kv_cache_dtype") is None else 4000
        print(f"INFO GPU KV cache size: {blocks * 16:,} tokens", flush=True)
        cc = SimpleNamespace(num_gpu_blocks=blocks, block_size=16, cache_dtype=kw.get("kv_cache_dtype", "auto"))
        self.llm_engine = Engine(SimpleNamespace(cache_config=cc), kw["max_model_len"], kw.get("max_num_seqs"))
        self.max_len = kw["max_model_len"]
        self.prof = kw.get("profiler_config")

    def start_profile(self):
        assert self.prof["profiler"] == "torch"

    def stop_profile(self):  # vLLM's worker writes its op table at stop
        import os
        os.makedirs(self.prof["torch_profiler_dir"], exist_ok=True)
        with open(os.path.join(self.prof["torch_profiler_dir"], "profiler_out_0.txt"), "w") as f:
            f.write("Name  Self CUDA\\n_split_kernel  1.0ms\\n")

    def generate(self, prompts, sp, use_tqdm=True):
        assert sp.kw["ignore_eos"] and sp.kw["temperature"] == 0.0 and not sp.kw["detokenize"]
        n = sp.kw["max_tokens"]
        for p in prompts:
            assert len(p["prompt_token_ids"]) + n <= self.max_len
        time.sleep(0.001 * n)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n)))]) for _ in prompts]
'''


def _run_with_fake_vllm(tmp_path, *argv):
    """``bench_vllm.py run`` on a stand-in `vllm` package (FAKE_VLLM) and a model dir of a 500-token vocabulary;
    ``argv`` after ``--model``. Returns (the finished process, the result JSON's path)."""
    fake = tmp_path / "fake"
    (fake / "vllm").mkdir(parents=True)
    (fake / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 500}))
    out = tmp_path / "res.json"
    env = {**__import__("os").environ, "PYTHONPATH": f"{fake}:{ROOT}"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_vllm.py"), "run", "--model", str(model),
                        *argv, "--out", str(out), "--out-dir", str(tmp_path / "logs")],
                       env=env, capture_output=True, text=True, timeout=300)
    return r, out


def test_run_end_to_end_with_a_fake_vllm(tmp_path):
    """The parent and its per-method children on a stand-in `vllm` package: rows, the error row of a method
    whose engine fails, TurboQuant skipped where vLLM lists none, the written JSON and its summary."""
    r, out = _run_with_fake_vllm(tmp_path, "--methods", "bf16,fp8,turboquant_3bit_nc", "--workloads",
                                 "capacity,throughput,latency", "--tp-requests", "3", "--tp-prompt", "20", "--tp-new",
                                 "5", "--lat-prompt", "30", "--lat-new", "4", "--lat-repeats", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(out.read_text())
    assert d["schema"] == bv.SCHEMA and d["complete"] and d["settings"]["max_model_len"] == 48
    rows = {(x["method"], x["workload"]): x for x in d["rows"]}
    assert rows[("bf16", "capacity")]["kv_tokens"] == 16000 == rows[("bf16", "capacity")]["vllm_log_kv_tokens"]
    tp = rows[("bf16", "throughput")]
    assert tp["requests"] == 3 and tp["new_tokens"] == 5 and tp["output_tok_s"] > 0 and tp["engine"]["vllm"] == "0.0.fake"
    lat = rows[("bf16", "latency")]
    assert len(lat["ttft_all_s"]) == 2 and lat["tpot_ms"] > 0
    assert all("fake engine refuses fp8" in rows[("fp8", w)]["error"] for w in ("capacity", "throughput", "latency"))
    assert "refuses fp8" in rows[("fp8", "capacity")]["log_tail"]
    assert rows[("turboquant_3bit_nc", "all")]["skipped"]
    assert [s["method"] for s in d["summary"]] == ["bf16"] * 4
    # the file kept after each method (all a stopped run leaves) says where it ran, as the final one does
    partial = json.loads(next((tmp_path / "logs").glob("vllm-partial-*.json")).read_text())
    assert not partial["complete"] and partial["rows"] == d["rows"][:6]  # after fp8 (TurboQuant: skipped, no engine)
    assert {k: partial[k] for k in ("commit", "gpu")} == {k: d[k] for k in ("commit", "gpu")} and partial["utc"]


def test_throughput_times_the_phase_that_holds_the_prefills(tmp_path):
    """Throughput through the engine's steps: with two requests at a time, the third starts when the first two end,
    so the phase until every request has its first token spans the first wave; the decode phase is the rest."""
    r, out = _run_with_fake_vllm(tmp_path, "--methods", "bf16", "--workloads", "throughput", "--tp-requests", "3",
                                 "--tp-prompt", "20", "--tp-new", "6", "--engine-kwargs", '{"max_num_seqs": 2}')
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.loads(out.read_text())["rows"][0]
    assert row["requests"] == 3 and row["new_tokens"] == 6
    # 12 steps in all; the third request's first token comes at step 7, the first two's at step 1
    assert 0.4 * row["wall_s"] < row["prefill_phase_s"] < 0.75 * row["wall_s"]
    assert row["decode_phase_s"] == pytest.approx(row["wall_s"] - row["prefill_phase_s"], abs=2e-3)
    assert row["first_token_s_median"] < 0.3 * row["wall_s"]


# --- benchmarks/vllm_serve_check.py: the serve command and the answer checks (the server itself needs a GPU) ---
import vllm_serve_check as vs  # noqa: E402


def test_serve_command_selects_rotkv_backend_with_its_config():
    cmd = vs.serve_command("/m", "rotkv", 8011, {"preset": "oscar-mix", "artifact": "a.safetensors"}, 4096, 0.5,
                           python="py")
    assert cmd[:5] == ["py", "-m", "vllm.entrypoints.cli.main", "serve", "/m"]
    i = cmd.index("--attention-backend")
    assert cmd[i + 1] == "CUSTOM" and cmd[cmd.index("--block-size") + 1] == "16"
    assert json.loads(cmd[cmd.index("--additional-config") + 1]) == {"rotkv": {"preset": "oscar-mix",
                                                                               "artifact": "a.safetensors"}}
    assert "--no-enable-prefix-caching" in cmd
    bf16 = vs.serve_command("/m", "bf16", 8011, {}, 4096, 0.5, python="py")
    assert "--attention-backend" not in bf16 and "--additional-config" not in bf16
    with pytest.raises(ValueError, match="rotkv or bf16"):
        vs.serve_command("/m", "fp8", 8011, {}, 4096, 0.5)


def test_serve_answer_checks_catch_each_fault():
    good = {"choices": [{"text": " Paris."}], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
    assert vs.check_answer("completion", 200, good) == []
    chat = {"choices": [{"message": {"content": "red"}}], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
    assert vs.check_answer("chat", 200, chat) == []
    assert vs.check_answer("completion", 500, good) == ["HTTP 500"]
    assert vs.check_answer("completion", 200, {"choices": []}) == ["no choices"]
    assert vs.check_answer("completion", 200, None) == ["no choices"]
    assert "empty text" in vs.check_answer("completion", 200, dict(good, choices=[{"text": "  "}]))
    assert "empty text" in vs.check_answer("chat", 200, good)  # a completion body is not a chat answer
    assert vs.check_answer("completion", 200, dict(good, usage={"prompt_tokens": 5})) == ["no completion_tokens in usage"]


def test_serve_backend_lines_pick_the_backend_choice():
    log = "INFO loading\nINFO Using AttentionBackendEnum.CUSTOM backend.\nrotkv: preset oscar-mix, 30 layers\nINFO ready\n"
    assert vs.backend_lines(log) == ["INFO Using AttentionBackendEnum.CUSTOM backend.", "rotkv: preset oscar-mix, 30 layers"]


def test_greedy_compare_reads_a_recorded_vllm_side(tmp_path):
    """--vllm-from: an earlier run's vLLM tokens, one spec/result pair per engine; a missing method or other prompt
    ids are refused."""
    import vllm_greedy_compare as g

    spec = {"ids": [1, 2, 3], "context": 3, "new": 2, "configs": {"quarot-int2": {"preset": "quarot-int2"}}}
    (tmp_path / "greedy-spec_vllm-0.json").write_text(json.dumps({**spec, "methods": ["bf16"]}))
    (tmp_path / "greedy-result_vllm-0.json").write_text(json.dumps({"bf16": {"tokens": [5, 6]}}))
    (tmp_path / "greedy-spec_vllm-1.json").write_text(json.dumps({**spec, "methods": ["quarot-int2"]}))
    (tmp_path / "greedy-result_vllm-1.json").write_text(json.dumps({"quarot-int2": {"tokens": [5, 7]}}))
    (tmp_path / "greedy-spec_vllm-2.json").write_text(json.dumps({**spec, "methods": ["oscar-mix"]}))  # no result
    got_spec, got = g.recorded_vllm_side(tmp_path, ["bf16", "quarot-int2"])
    assert got_spec["ids"] == [1, 2, 3] and got == {"bf16": {"tokens": [5, 6]}, "quarot-int2": {"tokens": [5, 7]}}
    with pytest.raises(FileNotFoundError, match="oscar-mix"):
        g.recorded_vllm_side(tmp_path, ["bf16", "oscar-mix"])
    (tmp_path / "greedy-spec_vllm-1.json").write_text(json.dumps({**spec, "ids": [9, 9, 9], "methods": ["quarot-int2"]}))
    with pytest.raises(ValueError, match="other prompt ids"):
        g.recorded_vllm_side(tmp_path, ["bf16", "quarot-int2"])


def test_profile_workload_keeps_vllms_op_table(tmp_path):
    """``--workloads profile`` (never in the default list) gives the engine vLLM's torch profiler under the
    out-dir and keeps the head of the op table its worker writes in the row."""
    assert "profile" not in bv.build_parser().parse_args(["run"]).workloads
    p = bv.plan(_args("--workloads", "profile", "--methods", "rotkv:quarot-int2", "--out-dir", str(tmp_path),
                      "--prof-new", "8"))
    kw = p["engines"]["rotkv:quarot-int2"]
    assert kw["profiler_config"]["torch_profiler_dir"] == str(tmp_path / "profile-rotkv_quarot-int2")
    assert p["sizes"]["prof_new"] == 8 and p["max_model_len"] == 32768 + 16  # 32776 rounded up to 16
    r, out = _run_with_fake_vllm(tmp_path, "--methods", "bf16", "--workloads", "profile", "--lat-prompt", "30",
                                 "--prof-new", "4")
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.loads(out.read_text())["rows"][0]
    assert row["workload"] == "profile" and row["new_tokens"] == 4
    assert row["profile_table"] == ["Name  Self CUDA", "_split_kernel  1.0ms"]


def test_profile_workload_over_a_batch_profiles_decode_steps_after_the_prefills(tmp_path):
    """``--prof-batch N``: N requests go through the engine's own steps; the profile starts once each has its first
    tokens and stops when each has made ``--prof-new`` more; the requests outlive the window (max_model_len has
    room for it) and are run to their end."""
    p = bv.plan(_args("--workloads", "profile", "--prof-batch", "8", "--prof-new", "16", "--lat-prompt", "100"))
    assert p["sizes"]["prof_batch"] == 8 and p["max_model_len"] == 192  # 100 + 16 + 2 + 64, rounded up to 16
    r, out = _run_with_fake_vllm(tmp_path, "--methods", "bf16", "--workloads", "profile", "--lat-prompt", "30",
                                 "--prof-new", "5", "--prof-batch", "3")
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.loads(out.read_text())["rows"][0]
    assert row["batch"] == 3 and row["new_tokens"] == 5 and row["tokens_at_start"] == 2
    assert row["window_tokens_seen"] == 3 * 5 and row["profile_table"][1] == "_split_kernel  1.0ms"


def test_profile_workload_of_mixed_steps_starts_at_half_the_first_tokens_and_aborts_after(tmp_path):
    """``--prof-mixed``: the profile holds ``--prof-new`` engine steps once half the batch has its first token
    (the stand-in engine runs 2 requests at a time, so the other 2 wait through the window), then the requests are
    aborted rather than run to their end."""
    r, out = _run_with_fake_vllm(tmp_path, "--methods", "bf16", "--workloads", "profile", "--lat-prompt", "30",
                                 "--prof-new", "3", "--prof-batch", "4", "--prof-mixed", "--max-num-seqs", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.loads(out.read_text())["rows"][0]
    assert row["batch"] == 4 and row["window_steps"] == 3 and row["running_at_start"] == 2
    assert row["window_tokens_seen"] == 2 * 3 and row["first_tokens_in_window"] == 0  # the 2 slots stay taken
    assert row["profile_table"][1] == "_split_kernel  1.0ms"
    assert json.loads(out.read_text())["settings"]["sizes"]["prof_mixed"] == 1
    with pytest.raises(ValueError, match="--prof-batch 2 or more"):
        bv.plan(_args("--workloads", "profile", "--prof-mixed"))


def test_unfused_variant_sets_graph_fusion_off_in_its_subprocess_only():
    assert bv.parse_methods("rotkv:quarot-int2@unfused,bf16") == ["rotkv:quarot-int2@unfused", "bf16"]
    with pytest.raises(ValueError, match="unknown method"):
        bv.parse_methods("rotkv:quarot-int2@fused")
    env = bv.method_env("rotkv:quarot-int2@unfused", {"ROTKV_TUNING": "refine_split=1", "X": "1"})
    assert env["ROTKV_TUNING"] == "refine_split=1,graph_fusion=0" and env["X"] == "1"
    assert bv.method_env("rotkv:quarot-int2@unfused", {})["ROTKV_TUNING"] == "graph_fusion=0"
    assert "ROTKV_TUNING" not in bv.method_env("rotkv:quarot-int2", {})
    assert bv.method_env("bf16", {"ROTKV_TUNING": "a=1"})["ROTKV_TUNING"] == "a=1"

