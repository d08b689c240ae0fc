"""The evaluation harness: pure helpers on tiny inputs, then a tiny smoke eval on the real SmolLM2."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from rotkv.cli.eval import parse_lengths
from rotkv.eval import niah, peers
from rotkv.eval.config import EvalConfig, make_config
from rotkv.config import calibration_method, get_preset
from rotkv.eval.methods import resolve
from rotkv.eval.nll import window_starts
from rotkv.eval.stats import mean_ci, wilson


# ---- pure helpers ---------------------------------------------------------------------------------------
def test_parse_lengths_all_tasks_and_per_task():
    assert parse_lengths(["2K,8192"], ["nll", "niah"]) == {"nll": [2048, 8192], "niah": [2048, 8192]}
    assert parse_lengths(["nll=2k", "niah=1K,3072"], ["nll", "niah"]) == {"nll": [2048], "niah": [1024, 3072]}
    assert parse_lengths(None, ["nll"]) is None
    # space-separated values are all kept (the last alone used to win, silently)
    assert parse_lengths(["4096", "6144", "8K"], ["niah"]) == {"niah": [4096, 6144, 8192]}
    assert parse_lengths(["2048", "niah=1K"], ["nll", "niah"]) == {"niah": [1024], "nll": [2048]}
    assert parse_lengths(["nll=2K", "nll=8K"], ["nll"]) == {"nll": [2048, 8192]}


def test_config_rejects_bad_values_naming_the_field():
    with pytest.raises(ValueError, match="`methods`"):
        EvalConfig(methods=["int3"])
    with pytest.raises(ValueError, match="`tasks`"):
        EvalConfig(tasks=["mmlu"])
    with pytest.raises(ValueError, match="depths"):
        EvalConfig(niah_depths=[1.5])
    with pytest.raises(ValueError, match="`profile`"):
        make_config("huge")
    with pytest.raises(FileNotFoundError):
        EvalConfig(texts=["/nonexistent.txt"])


def test_windows_scale_down_with_length():
    cfg = make_config("full")
    assert cfg.windows_at(2048) == 2 and cfg.windows_at(8192) == 1
    assert window_starts(10_000, 2048, 32, 3) == [0, 3960, 7920]
    with pytest.raises(ValueError, match="fewer than"):
        window_starts(100, 2048, 32, 1)


def test_intervals():
    m, ci = mean_ci([1.0, 2.0, 3.0])
    assert m == 2.0 and abs(ci - 1.96 / 3**0.5) < 1e-12
    assert mean_ci([4.0]) == (4.0, 0.0)
    acc, half = wilson(5, 10)
    assert acc == 0.5 and 0.25 < half < 0.3
    acc, half = wilson(10, 10)
    assert acc == 1.0 and half > 0.1  # a perfect score on 10 questions is still uncertain


def test_exact_match_scoring():
    assert niah.score_answer(" 1234567.", ["1234567"]) == 1.0
    assert niah.score_answer(" 12345678", ["1234567"]) == 0.0  # a longer number is not the value
    assert niah.score_answer(" 7654321 or 1234567", ["1234567"]) == 0.0  # the first number is the answer
    assert niah.score_answer("1. 111\n2. 222", ["111", "222", "333"]) == pytest.approx(2 / 3)


def test_tier_marks():
    assert niah.tier_of((3, 20), 1000, sink=16, window=64) == "sink"
    assert niah.tier_of((950, 970), 1000, sink=16, window=64) == "window"
    assert niah.tier_of((400, 420), 1000, sink=16, window=64) == ""
    assert niah.tier_of((-1, -1), 1000, sink=16, window=64) == ""


def test_artifact_names_and_missing_artifact(tmp_path):
    assert calibration_method("oscar-int2") == "oscar" and calibration_method("optr-int2") == "optr"
    m, why = resolve("oscar-int2", 16, 64, None)
    assert m is None and "--artifact-dir" in why
    m, why = resolve("oscar-int2", 16, 64, str(tmp_path), calibrate=lambda method, path: f"no {method}")
    assert m is None and why == "no oscar"
    m, why = resolve("quarot-int2", 16, 64, None)
    assert why is None and m.overrides == {"sink": 16, "window": 64} and m.bpe_nominal == 2.0
    # `--sink preset`: the preset keeps its own sink (oscar-refine's 4 pays for its refine tier), and the
    # needle's tier label follows it
    from rotkv.eval.run import _tiers

    m, why = resolve("quarot-int2", "preset", 64, None)
    assert why is None and m.overrides == {"window": 64}
    assert _tiers(m, make_config("smoke", sink="preset", window=64)) == (get_preset("quarot-int2").sink, 64)
    m, _ = resolve("quarot-int2", 16, 64, None)
    assert _tiers(m, make_config("smoke", sink=16, window=64)) == (16, 64)
    m, _ = resolve("bf16", "preset", 64, None)
    assert _tiers(m, make_config("smoke", sink="preset", window=64)) == (0, 0)  # no quantized tokens to miss
    # a preset with per-layer key widths reads its own artifact: made when missing, or says how to make it
    m, why = resolve("oscar-mix", 16, 32, str(tmp_path), calibrate=lambda method, path: f"made {method} at {path}")
    assert m is None and why == f"made oscar-mix at {tmp_path / 'oscar-mix.safetensors'}"
    m, why = resolve("oscar-mix", 16, 32, str(tmp_path))
    assert m is None and "rotkv calibrate --method oscar-mix" in why and "oscar-mix.safetensors" in why
    (tmp_path / "oscar-mix.safetensors").write_bytes(b"")
    m, why = resolve("oscar-mix", 16, 32, str(tmp_path))
    assert why is None and m.artifact == str(tmp_path / "oscar-mix.safetensors")


_ON_A_CUDA_MACHINE = """
import torch
from unittest import mock
mock.patch("torch.cuda.is_available", return_value=True).start()
mock.patch("torch.version.cuda", "12.8").start()
"""


@pytest.mark.skipif(peers.unavailable("hf-quanto-int4") is not None, reason="optimum-quanto is not installed")
def test_quanto_on_a_cuda_machine_leaves_its_cuda_extension_out():
    """On a machine that looks like a CUDA one, a plain import of optimum.quanto registers the CUDA kernel of
    its bit unpacking (a JIT build with nvcc and ninja on first use); rotkv's import registers none, so CUDA
    tensors take quanto's portable implementation. Each in a fresh interpreter (an import is once a process)."""
    import subprocess
    import sys

    has = "\nprint(torch._C._dispatch_has_kernel_for_dispatch_key('quanto::unpack', 'CUDA'), " \
          "torch._C._dispatch_has_kernel_for_dispatch_key('quanto::unpack', 'CompositeExplicitAutograd'))"
    got = {}
    for name, body in (("plain", "import optimum.quanto"),
                       ("rotkv", "from rotkv.eval.peers import quanto_without_cuda_extension as f\nf()"),
                       ("late", "import optimum.quanto\nfrom rotkv.eval.peers import quanto_without_cuda_extension as f\n"
                                "try:\n    f()\nexcept RuntimeError as e:\n    print('refused', 'imported before' in str(e))")):
        r = subprocess.run([sys.executable, "-c", _ON_A_CUDA_MACHINE + body + has], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        got[name] = r.stdout.split()
    assert got["plain"] == ["True", "True"]  # the simulation reaches quanto's CUDA registration
    assert got["rotkv"] == ["False", "True"]  # only the portable kernel: what CUDA tensors dispatch to
    assert got["late"] == ["refused", "True", "True", "True"]  # too late to keep it out: said, not ignored


def test_missing_peer_is_reported_with_install_hint(monkeypatch):
    real = peers.importlib.util.find_spec
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda n, *a: None if n.startswith("turboquant") else real(n, *a))
    m, why = resolve("turboquant-int3", None, None, None)
    assert m is None and "pip install turboquant" in why
    with pytest.raises(ImportError, match="pip install turboquant"):
        peers.make_peer("turboquant-int3", None)


def test_resident_bytes_counts_whole_storages_once():
    class Layer:
        pass

    base = torch.zeros(4, 10, dtype=torch.float32)
    a, b = Layer(), Layer()
    a.view = base[:, 5:]  # a view pins its whole storage
    a.same = base  # counted once
    a.meta = {"scale": torch.zeros(3, dtype=torch.float16)}
    b.codes = [torch.zeros(8, dtype=torch.uint8)]
    got = peers.resident_bytes([a, b])
    assert got["kv_bytes"] == 160 + 6 + 8
    assert got["kv_bytes_at_bf16"] == 80 + 6 + 8


# ---- the real model --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded():
    from rotkv.hf.models import load_model

    return load_model(device="cpu")


@pytest.mark.slow
def test_needles_are_where_the_spans_say(loaded):
    tok = loaded.tokenizer
    essay = tok(open(EvalConfig().haystacks[0]).read()[:20000], add_special_tokens=False).input_ids
    for variant, depths in (("essay", [0.5]), ("multikey", [0.1, 0.5, 0.9]), ("noise", [0.3])):
        s = niah.make_sample(tok, variant, 600, depths, essay, seed=1)
        assert abs(s.context.shape[1] - 600) < 40
        for q, expected, depth, (a, b) in s.questions:
            needle = tok.decode(s.context[0, a:b + 1])
            assert expected[0] in needle, (variant, depth, needle)
            assert 0.5 * depth * 600 < a + 1 or depth < 0.2
    mv = niah.make_sample(tok, "multivalue", 600, [0.2, 0.8], essay, seed=2)
    assert len(mv.questions) == 1 and len(mv.questions[0][1]) == 2


@pytest.mark.slow
def test_another_seed_asks_other_questions_and_caches_apart(loaded):
    """`rotkv eval --seed N` (the flag reaches the config: tests/test_cli_errors.py): the NIAH haystacks and needles of seed 1 are not seed 0's, the same seed gives
    the same ones, and the seed is in a unit's cache fingerprint (more questions, not the cached answers)."""
    from rotkv.eval.config import make_config
    from rotkv.eval.run import niah_samples, unit_settings

    tok = loaded.tokenizer
    essay = tok(open(EvalConfig().haystacks[0]).read()[:20000], add_special_tokens=False).input_ids
    cfgs = [make_config("smoke", tasks=["niah"], lengths={"niah": [600]}, niah_samples=2, seed=s) for s in (0, 1, 1)]
    answers = [[q[1] for x in niah_samples(tok, c, "multikey", 600, essay) for q in x.questions] for c in cfgs]
    assert answers[1] == answers[2] and answers[0] != answers[1]
    unit = ("niah", "multikey", 600)
    assert unit_settings(cfgs[0], unit, "t", "h") != unit_settings(cfgs[1], unit, "t", "h")


@pytest.mark.slow
def test_rotkv_bytes_agree_with_the_walker(loaded):
    """The generic walker used for peers, applied to a rotkv cache's stored rows, gives its own accounting."""
    from rotkv.cache import RotkvCache
    from rotkv.eval.protocol import prefill

    cache = RotkvCache(loaded.model, "quarot-int2", sink=16, window=32)
    ids = loaded.tokenizer("hello world " * 60, return_tensors="pt").input_ids[:, :150]
    prefill(loaded.model, cache, ids, 64)
    pools = [layer.pools for layer in cache.layers]
    st = cache.stats()  # the pools' capacity (free pages too); the reader keeps no copy (scratch 0)
    assert peers.resident_bytes(pools)["kv_bytes"] == st["pool_bytes"] == st["resident_bytes"]
    assert st["scratch_bytes"] == 0
    assert st["kv_bytes"] <= st["pool_bytes"]


@pytest.mark.slow
def test_smoke_eval_end_to_end_and_resume(loaded, tmp_path, monkeypatch):
    from rotkv.eval.methods import Method
    from rotkv.eval.report import write_report
    from rotkv.eval.run import evaluate

    cfg = make_config("smoke", methods=["bf16", "quarot-int2", "turboquant-int3" if not peers.unavailable("turboquant-int3") else "naive-int2"],
                      lengths={"nll": [160], "attn-error": [160], "niah": [256]},
                      niah_variants=["essay", "multikey"], new_tokens=4, attn_queries=8, chunk=64, window=32, threads=None)
    records = evaluate(cfg, str(tmp_path), loaded=loaded, log=lambda s: None)
    by = {(r["method"], r["task"], r["variant"], r["depth"]): r for r in records}
    for r in records:
        for k in ("method", "task", "length", "variant", "depth", "n", "ci95"):
            assert k in r
        if r["method"] != "plain-fp32":
            assert r["kv_bytes"] > 0 and r["bpe_measured"] > 0 and "bpe_nominal" in r
    bf, q = by[("bf16", "nll", None, None)], by[("quarot-int2", "nll", None, None)]
    assert bf["bpe_measured"] == pytest.approx(16.0) and q["bpe_measured"] < 8
    assert bf["kl"] < q["kl"] and bf["top1"] >= q["top1"]
    assert by[("bf16", "attn-error", None, None)]["rel_error"] < 0.02
    assert by[("quarot-int2", "attn-error", None, None)]["rel_error"] > by[("bf16", "attn-error", None, None)]["rel_error"]
    assert {r["variant"] for r in records if r["task"] == "niah"} == {"essay", "multikey"}
    assert ("plain-fp32", "nll", None, None) in by
    paths = write_report(str(tmp_path))
    text = open(os.path.join(tmp_path, "report.md")).read()
    assert "## Main table" in text and "quarot-int2" in text
    assert all(os.path.exists(p) for p in paths) and any(p.endswith("niah_heatmaps.png") for p in paths)
    prov = json.load(open(os.path.join(tmp_path, "config.json")))
    assert prov["versions"]["torch"] and "commit" in prov["git"]
    # a second run resumes from the cache: nothing is rebuilt
    monkeypatch.setattr(Method, "build", lambda self, model: (_ for _ in ()).throw(AssertionError("recomputed")))
    again = evaluate(cfg, str(tmp_path), loaded=loaded, log=lambda s: None)
    assert len(again) == len(records)


def test_the_cache_fingerprint_follows_the_window_share():
    """oscar-mix gained a window_share: its cached results from the fixed window are not served again, and the
    fingerprints of presets without one are what they were (older caches stay valid)."""
    import hashlib
    import json

    from rotkv.eval.methods import Method
    from rotkv.eval.run import _fingerprint

    settings = {"task": "nll", "length": 2048}
    old_style = lambda name: hashlib.sha256(json.dumps({**settings, "method": name, "artifact": None},  # noqa: E731
                                                       sort_keys=True).encode()).hexdigest()[:16]
    assert _fingerprint(settings, Method("quarot-int2", "rotkv", 2.5)) == old_style("quarot-int2")
    mix = _fingerprint(settings, Method("oscar-mix", "rotkv", 3.1))
    assert mix != old_style("oscar-mix")
    assert _fingerprint(settings, Method("oscar-mix", "rotkv", 3.1, {"window_share": 0.0})) == old_style("oscar-mix")
    assert _fingerprint(settings, Method("oscar-mix", "rotkv", 3.1, {"window_share": 0.03})) not in (mix, old_style("oscar-mix"))
    # the refine tier's fields likewise: a preset that gains values or a size rule is not served its old results
    refine = _fingerprint(settings, Method("oscar-refine", "rotkv", 3.1))
    keys_only = _fingerprint(settings, Method("oscar-refine", "rotkv", 3.1, {"refine_values": False, "refine_every": 0}))
    assert refine != keys_only
    assert keys_only != _fingerprint(settings, Method("oscar-refine", "rotkv", 3.1, {"refine_values": False,
                                                                                       "refine_every": 0,
                                                                                       "refine_tokens": 112}))
    # and the keys' metadata dtype (set: a new fingerprint; unset, as in most presets: the old one)
    assert _fingerprint(settings, Method("oscar-mix", "rotkv", 3.1, {"meta_k": "float8"})) != mix


def test_report_only_keeps_records_of_methods_that_cannot_run_here(tmp_path, monkeypatch):
    """A rebuild (``--report-only``) reads the cache: a peer whose library is missing keeps its records (its
    fingerprint needs no library); a preset whose artifact is gone keeps them too, matched by their recorded
    settings and named under ``unverified``; a record of other settings is still refused, and a method with no
    records at all stays ``unavailable``. Before, both methods' records were dropped from results.json."""
    from rotkv.eval import methods as methods_mod
    from rotkv.eval.methods import Method
    from rotkv.eval.run import _sha, _store, plan, rebuild, unit_settings

    art = tmp_path / "arts"
    art.mkdir()
    cfg = make_config("smoke", methods=["oscar-mix", "hf-quanto-int4", "oscar-refine"], tasks=["nll"],
                      lengths={"nll": [256]}, artifact_dir=str(art))
    text_sha = hashlib.sha256(b"".join(_sha(f).encode() for f in cfg.texts)).hexdigest()[:16]
    (unit,) = plan(cfg)
    settings = unit_settings(cfg, unit, text_sha, text_sha)
    (art / "oscar-mix.safetensors").write_bytes(b"the run's artifact")
    rec = lambda m: {"method": m, "task": "nll", "variant": None, "length": 256, "kl": 0.01}  # noqa: E731
    _store(str(tmp_path), Method("oscar-mix", "rotkv", 3.1, {}, str(art / "oscar-mix.safetensors")), unit, settings,
           [rec("oscar-mix")])
    _store(str(tmp_path), Method("hf-quanto-int4", "peer", 4.0), unit, settings, [rec("hf-quanto-int4")])
    _store(str(tmp_path), Method("oscar-refine", "rotkv", 3.1, {}, str(art / "oscar-mix.safetensors")), unit,
           {**settings, "windows": 99}, [rec("oscar-refine")])  # other settings: never read back
    (art / "oscar-mix.safetensors").unlink()
    monkeypatch.setattr(methods_mod.peers, "unavailable", lambda name: "its library is not installed")
    got = rebuild(cfg, str(tmp_path))
    assert sorted(r["method"] for r in got) == ["hf-quanto-int4", "oscar-mix"]
    blob = json.load(open(tmp_path / "results.json"))
    assert set(blob["unverified"]) == {"oscar-mix"} and set(blob["unavailable"]) == {"oscar-refine"}
    assert blob["missing"] == []


def test_niah_lengths_given_hold_for_every_variant():
    """`--lengths niah=...` replaces the profile's per-variant NIAH lengths (the full profile runs noise
    and multivalue at 2048 only); without it the profile's stay."""
    from rotkv.eval.config import make_config

    assert make_config("full").niah_lengths("noise") == [2048]
    cfg = make_config("full", tasks=["niah"], lengths={"niah": [4096, 8192]})
    assert cfg.niah_lengths("noise") == [4096, 8192] and cfg.niah_lengths("essay") == [4096, 8192]
    assert make_config("full", tasks=["nll"], lengths={"nll": [2048]}).niah_lengths("noise") == [2048]


def test_report_only_rebuilds_a_gpu_runs_folder_from_its_config(tmp_path, monkeypatch):
    """`rotkv eval --report-only --out DIR` needs no other flag and no GPU: it takes the settings the run
    recorded (here on a GPU host, with its own paths to rotkv's texts) and finds the cached records."""
    from rotkv.cli import main
    from rotkv.eval.methods import Method
    from rotkv.eval.run import _sha, _store, plan, unit_settings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = make_config("smoke", model="/elsewhere/smol.gguf", methods=["bf16"], tasks=["niah"],
                      lengths={"niah": [1024]}, niah_variants=["noise"], niah_samples=2, device="cpu")
    text_sha = hashlib.sha256(b"".join(_sha(f).encode() for f in cfg.texts)).hexdigest()[:16]
    cfg.device = "cuda"  # as recorded there (made on the CPU: the config refuses no device, the CLI does)
    blob = cfg.to_dict()
    blob["texts"] = blob["haystacks"] = ["/root/repo/rotkv/data/" + os.path.basename(f) for f in cfg.texts]
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"config": blob}, f)
    (unit,) = plan(cfg)
    rec = {"method": "bf16", "task": "niah", "length": 1024, "variant": "noise", "depth": 0.5, "n": 2, "ci95": 0.5,
           "accuracy": 0.5, "context_tokens": 1020, "bf16_tier": "", "kv_bytes": 2.0, "kv_bytes_at_bf16": 2.0,
           "elements": 1.0, "bpe_measured": 16.0, "bpe_at_bf16": 16.0, "bpe_nominal": 16.0, "seconds": 1.0}
    _store(str(tmp_path), Method("bf16", "rotkv", 16.0, {}), unit, unit_settings(cfg, unit, text_sha, text_sha), [rec])
    assert main(["eval", "--report-only", "--out", str(tmp_path)]) == 0
    got = json.load(open(tmp_path / "results.json"))
    assert [r["accuracy"] for r in got["records"]] == [0.5] and got["missing"] == []
    assert "| bf16 |" in open(tmp_path / "report.md").read()
    # a folder without a run in it is a one-line usage error (exit status 2)
    assert main(["eval", "--report-only", "--out", str(tmp_path / "nothing")]) == 2
