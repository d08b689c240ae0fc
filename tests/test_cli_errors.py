"""The command line's errors: a user error is one line naming the flag, exit 2, raised before the model
loads; any other failure is one line with the --debug hint, exit 1. No test here loads a real model:
``load_model`` is replaced by one that fails loudly (or returns a tiny random model)."""

from types import SimpleNamespace

import pytest
import torch

from rotkv.cli import main
from rotkv.hf.models import Loaded
from rotkv_testing import make_tiny_llama, write_artifact


class ModelLoaded(Exception):
    pass


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model is a test failure: every check here has to come first."""
    def load_model(*a, **k):
        raise ModelLoaded("the model was loaded before the check")

    monkeypatch.setattr("rotkv.hf.models.load_model", load_model)
    monkeypatch.setattr("rotkv.hf.models.peek_geometry", lambda model=None: (30, 3, 64))  # SmolLM2's
    monkeypatch.delenv("ROTKV_DEBUG", raising=False)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama()


@pytest.fixture
def oscar(tiny, tmp_path):
    return write_artifact(tiny, tmp_path / "oscar.safetensors")


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err.strip()


def assert_user_error(rc, err, *needles):
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, (n, err)


# ---- generate ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,needles", [
    (["--prompt", "", "--no-chat"], ["--prompt is empty"]),
    (["--prompt", ""], ["--prompt is empty"]),
    (["--prompt", "hi", "--sink", "-1"], ["--sink has to be >= 0"]),
    (["--prompt", "hi", "--window", "-4"], ["--window has to be >= 0"]),
    (["--prompt", "hi", "--window-share", "1.5"], ["--window-share has to be in [0, 1)"]),
    (["--prompt", "hi", "--preset", "pmkvq", "--window-share", "0.1"], ["--window-share does not combine"]),
    (["--prompt", "hi", "--group-size", "12"], ["--group-size (12)", "allowed: [1, 2, 4, 8, 16, 32, 64]"]),
    (["--prompt", "hi", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--prompt", "hi", "--model", "/no/such/model"], ["model '/no/such/model' not found"]),
    (["--prompt", "hi", "--device", "tpu"], ["--device has to be cpu, cuda"]),
    (["--prompt", "hi", "--preset", "oscar-int2"], ["--artifact", "oscar-int2", "rotkv calibrate --method oscar"]),
    (["--prompt", "hi", "--compile-layers"], ["--compile-layers", "add --cuda-graph"]),
    (["--prompt", "hi", "--refine-tokens", "-3"], ["--refine-tokens has to be >= 0"]),
    (["--prompt", "hi", "--preset", "int4", "--refine-tokens", "64"], ["--refine-tokens refines 2-bit"]),
    (["--prompt", "hi", "--refine-values"], ["--refine-values refines the refine tier's values", "--refine-tokens"]),
    (["--prompt", "hi", "--refine-every", "4"], ["--refine-every sizes the refine tier", "--refine-tokens"]),
    (["--prompt", "hi", "--refine-tokens", "64", "--refine-every", "-2"], ["--refine-every has to be >= 0"]),
    (["--prompt", "hi", "--preset", "oscar-refine"], ["--artifact", "rotkv calibrate --method oscar-mix-long"]),
])
def test_generate_user_errors_before_the_model(no_model, capsys, argv, needles):
    rc, _, err = run_cli(capsys, "generate", *argv)
    assert_user_error(rc, err, *needles)


def test_prompt_file_directory_and_missing(no_model, capsys, tmp_path):
    rc, _, err = run_cli(capsys, "generate", "--prompt-file", str(tmp_path))
    assert_user_error(rc, err, "--prompt-file", "is a directory")
    rc, _, err = run_cli(capsys, "generate", "--prompt-file", str(tmp_path / "missing.txt"))
    assert_user_error(rc, err, "--prompt-file", "no such file")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\xfa")
    rc, _, err = run_cli(capsys, "generate", "--prompt-file", str(tmp_path / "bin.txt"))
    assert_user_error(rc, err, "--prompt-file", "not UTF-8")


def test_cuda_without_cuda(no_model, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--device", "cuda")
    assert_user_error(rc, err, "--device cuda", "CUDA is not available")
    rc, _, err = run_cli(capsys, "calibrate", "--method", "oscar", "--out", "x.safetensors", "--device", "cuda")
    assert_user_error(rc, err, "--device cuda")


def test_truncated_artifact_in_generate_and_inspect(no_model, capsys, oscar, tmp_path):
    data = open(oscar, "rb").read()
    bad = tmp_path / "trunc.safetensors"
    bad.write_bytes(data[: len(data) // 2])
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--preset", "oscar-int2", "--artifact", str(bad))
    assert_user_error(rc, err, "cannot read artifact", "truncated")
    rc, _, err = run_cli(capsys, "inspect", str(bad))
    assert_user_error(rc, err, "cannot read artifact", "truncated")
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--preset", "oscar-int2", "--artifact", str(tmp_path / "no"))
    assert_user_error(rc, err, "artifact file not found")


@pytest.mark.parametrize("argv,needles", [
    (["--preset", "optr-int2"], ["method: artifact 'oscar' vs preset 'optr'"]),
    (["--preset", "oscar-int2", "--group-size", "8"], ["group_size: artifact 16 vs preset 8", "--refit-clip"]),
    (["--preset", "oscar-int2", "--group-size", "5"], ["group_size: artifact 16 vs preset 5"]),
])
def test_artifact_contract_is_checked_before_the_model(no_model, capsys, oscar, argv, needles):
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--artifact", oscar, *argv)
    assert_user_error(rc, err, *needles)


def test_matching_artifact_gets_to_the_model(no_model, capsys, oscar):
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--preset", "oscar-int2", "--artifact", oscar)
    assert rc == 1 and "ModelLoaded" in err  # every early check passed


# ---- other failures: one line, the hint, exit 1; the traceback on request ---------------------------------
@pytest.fixture
def failing_model(monkeypatch):
    def load_model(*a, **k):
        raise RuntimeError("Expected all tensors to be on the same device,\n but found two devices")

    monkeypatch.setattr("rotkv.hf.models.load_model", load_model)


def test_unexpected_failure_is_one_line_with_the_debug_hint(failing_model, capsys, monkeypatch):
    monkeypatch.delenv("ROTKV_DEBUG", raising=False)
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi")
    assert rc == 1 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert "failed: RuntimeError: Expected all tensors to be on the same device, but found" in err
    assert "--debug" in err and "ROTKV_DEBUG=1" in err


@pytest.mark.parametrize("how", ["--debug first", "--debug last", "env"])
def test_debug_shows_the_traceback(failing_model, capsys, monkeypatch, how):
    monkeypatch.delenv("ROTKV_DEBUG", raising=False)
    argv = ["generate", "--prompt", "hi"]
    if how == "--debug first":
        argv = ["--debug"] + argv
    elif how == "--debug last":
        argv = argv + ["--debug"]
    else:
        monkeypatch.setenv("ROTKV_DEBUG", "1")
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 1 and "Traceback" in err and "load_model" in err


@pytest.mark.parametrize("argv,flag", [(["generate", "--prompt", "hi", "--sink", "many"], "--sink"),
                                       (["generate", "--prompt", "hi", "--preset", "nope"], "--preset"),
                                       (["eval", "--window", "own"], "'preset'")])
def test_argparse_errors_are_one_line(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and flag in err and "--help" in err


# ---- calibrate -------------------------------------------------------------------------------------------
def test_calibrate_out_under_a_file_fails_before_calibration(no_model, capsys, tmp_path):
    (tmp_path / "afile").write_text("x")
    rc, _, err = run_cli(capsys, "calibrate", "--method", "oscar", "--out", str(tmp_path / "afile" / "o.safetensors"))
    assert_user_error(rc, err, "--out", "is a file, not a folder")
    rc, _, err = run_cli(capsys, "calibrate", "--method", "oscar", "--out", str(tmp_path))
    assert_user_error(rc, err, "--out", "is a directory")


@pytest.mark.parametrize("argv,needles", [
    (["--method", "oscar", "--tokens", "256"], ["--tokens has to be >= 1536", "--no-clip-search"]),
    (["--method", "optr", "--tokens", "1000", "--no-clip-search"], ["--tokens", "OptR early stopping"]),
    (["--method", "oscar", "--sink", "-2"], ["--sink has to be >= 0"]),
    (["--method", "oscar", "--group-size", "0"], ["--group-size"]),
    ([], ["--method", "--refit-clip"]),
    (["--method", "oscar", "--data", "/nonexistent/file.txt"], ["--data", "no such file"]),
])
def test_calibrate_user_errors_before_the_model(no_model, capsys, tmp_path, argv, needles):
    rc, _, err = run_cli(capsys, "calibrate", "--out", str(tmp_path / "o.safetensors"), *argv)
    assert_user_error(rc, err, *needles)


def test_calibrate_says_when_tokens_are_rounded_up(no_model, capsys, tmp_path):
    rc, _, err = run_cli(capsys, "calibrate", "--method", "hadamard", "--no-clip-search", "--tokens", "256",
                         "--out", str(tmp_path / "o.safetensors"))
    assert "--tokens 256 is rounded up to 512" in err
    assert rc == 1 and "ModelLoaded" in err  # then it goes on


class ByteTokenizer:
    def __call__(self, text, return_tensors=None):
        return SimpleNamespace(input_ids=torch.tensor([[b % 128 for b in text.encode()]]))


def test_refit_clip_from_the_command_line(tiny, oscar, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr("rotkv.hf.models.load_model", lambda *a, **k: Loaded(tiny, ByteTokenizer(), "tiny"))
    out = str(tmp_path / "refit.safetensors")
    rc, stdout, err = run_cli(capsys, "calibrate", "--refit-clip", oscar, "--bits", "4", "--group-size", "8",
                              "--tokens", "1024", "--out", out)
    assert rc == 0, err
    assert "re-fitted for bits 4, group_size 8" in stdout
    rc, stdout, err = run_cli(capsys, "inspect", out, "--check", "--preset", "oscar-int2")
    assert_user_error(rc, err, "bits: artifact 4 vs preset 2", "group_size: artifact 8 vs preset 16")
    rc, _, err = run_cli(capsys, "calibrate", "--refit-clip", oscar, "--group-size", "12", "--out", out)
    assert_user_error(rc, err, "--group-size (12)")


# ---- inspect --check ----------------------------------------------------------------------------------------
def test_inspect_check_passes_a_sound_artifact(capsys, oscar):
    rc, out, err = run_cli(capsys, "inspect", oscar, "--check", "--preset", "oscar-int2")
    assert rc == 0, err
    assert "contract fields: method oscar, bits 2, group_size 16" in out and "check: ok" in out
    assert "all finite, rotations orthogonal" in out and "preset oscar-int2: matches" in out


@pytest.mark.parametrize("bad,needles", [
    ({"R_K.0": torch.full((2, 16, 16), float("nan"))}, ["failed 2 check(s)", "R_K.0 has 512 non-finite",
                                                        "not orthogonal, worst R_K.0"]),
    ({"R_V.1": 2 * torch.eye(16).expand(2, 16, 16).contiguous()}, ["failed 1 check(s)", "not orthogonal, worst R_V.1"]),
])
def test_inspect_check_reports_unsound_values(tiny, tmp_path, capsys, bad, needles):
    path = write_artifact(tiny, tmp_path / "bad.safetensors", tensors=bad)
    rc, out, err = run_cli(capsys, "inspect", path, "--check")
    assert_user_error(rc, err, *needles)
    assert "values:" in out  # the per-check report came first
    rc, out, err = run_cli(capsys, "inspect", path)  # without --check the loader refuses it
    assert_user_error(rc, err, "unsound", *needles[1:])


def test_inspect_check_reports_missing_contract_fields_and_method(tiny, tmp_path, capsys):
    path = write_artifact(tiny, tmp_path / "old.safetensors", drop=("bits", "group_size"))
    rc, out, err = run_cli(capsys, "inspect", path, "--check")
    assert_user_error(rc, err, "contract fields ['bits', 'group_size'] are not recorded")
    optr = write_artifact(tiny, tmp_path / "optr.safetensors", method="optr")
    rc, out, err = run_cli(capsys, "inspect", optr, "--preset", "oscar-int2")
    assert_user_error(rc, err, "method: artifact 'optr' vs preset 'oscar'")


# ---- demo ------------------------------------------------------------------------------------------------------
def test_demo_says_which_presets_it_skips(no_model, capsys, tmp_path, tiny):
    write_artifact(tiny, tmp_path / "oscar.safetensors")
    rc, _, err = run_cli(capsys, "demo", "--artifact-dir", str(tmp_path), "--presets", "bf16")
    assert "skipping optr-int2: no optr.safetensors in" in err and "skipping oscar-int2" not in err
    assert rc == 1 and "ModelLoaded" in err


def test_demo_without_artifacts_names_the_calibrated_presets(no_model, capsys):
    rc, _, err = run_cli(capsys, "demo", "--presets", "bf16")
    assert "not running the calibrated presets" in err and "oscar-mix" in err and "oscar-int2" in err
    assert rc == 1 and "ModelLoaded" in err


@pytest.mark.parametrize("argv,needles", [
    (["--presets", "bf16,nope"], ["--presets", "'nope'"]),
    (["--presets", "optr-int2"], ["--presets optr-int2 needs optr.safetensors"]),
    (["--depth", "2"], ["--depth"]),
    (["--artifact-dir", "/nonexistent/dir"], ["--artifact-dir", "is not a folder"]),
    (["--sink", "-1"], ["--sink"]),
])
def test_demo_user_errors_before_the_model(no_model, capsys, argv, needles):
    rc, _, err = run_cli(capsys, "demo", *argv)
    assert_user_error(rc, err, *needles)


# ---- build-kernels --------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv,needles", [
    ([], ["--model / --head-dim"]),
    (["--head-dim", "128", "--model", "smollm2"], ["--model / --head-dim"]),
    (["--head-dim", "0", "--arch", "90"], ["--head-dim must be positive"]),
    (["--head-dim", "128", "--arch", "9.0"], ["--arch", "without the dot"]),
    (["--head-dim", "128", "--arch", "75"], ["--arch 75", "8.0"]),
    (["--head-dim", "100", "--arch", "90"], ["has to divide head_dim (100)"]),
    (["--head-dim", "128", "--arch", "90", "--preset", "kivi-2"], ["--preset kivi-2", "kivi"]),
    (["--head-dim", "128", "--arch", "90", "--preset", "bf16"], ["--preset bf16", "no quantized body"]),
])
def test_build_kernels_user_errors(no_model, capsys, argv, needles):
    rc, _, err = run_cli(capsys, "build-kernels", *argv)
    assert_user_error(rc, err, *needles)


def test_build_kernels_needs_arch_without_a_gpu(no_model, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, _, err = run_cli(capsys, "build-kernels", "--model", "smollm2")
    assert_user_error(rc, err, "--arch", "no CUDA GPU")


# ---- first contact, round 3: every case is a clean error or a stated result ---------------------------------
def test_version_names_the_commit_in_a_checkout(capsys):
    import os

    import rotkv

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    out = capsys.readouterr().out.strip()
    assert e.value.code == 0 and out.startswith(f"rotkv {rotkv.__version__}")
    if os.path.exists(os.path.join(os.path.dirname(os.path.dirname(rotkv.__file__)), ".git")):
        assert "(git " in out


@pytest.mark.parametrize("argv,needles", [
    (["--prompt", "hi", "--temperature", "0.5"], ["--temperature 0.5 has no effect without --sample"]),
    (["--prompt", "hi", "--top-p", "0.5"], ["--top-p 0.5 has no effect without --sample"]),
    (["--prompt", "hi", "--preset", "oscar-mix"], ["rotkv calibrate --method oscar-mix"]),
])
def test_generate_ignored_flags_and_oscar_mix_hint(no_model, capsys, argv, needles):
    rc, _, err = run_cli(capsys, "generate", *argv)
    assert_user_error(rc, err, *needles)


def test_generate_plain_oscar_artifact_for_oscar_mix_fails_before_the_model(no_model, capsys, oscar):
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--preset", "oscar-mix", "--artifact", oscar,
                         "--group-size", "16")
    assert_user_error(rc, err, "k_bits", "rotkv calibrate --method oscar-mix")


def test_inspect_check_preset_runs_generates_contract(tiny, capsys, oscar, tmp_path):
    """inspect --check --preset oscar-mix refuses what generate refuses: an artifact without key widths."""
    rc, out, err = run_cli(capsys, "inspect", oscar, "--check", "--preset", "oscar-mix")
    assert_user_error(rc, err, "k_bits", "per-layer key widths")
    mixed = write_artifact(tiny, tmp_path / "mix.safetensors", tensors={"k_bits": torch.tensor([4, 2], dtype=torch.int32),
                                                                        "k_gain": torch.tensor([0.1, 0.0])})
    rc, out, err = run_cli(capsys, "inspect", mixed, "--check", "--preset", "oscar-mix")
    assert rc == 0 and "preset oscar-mix: matches" in out, err


def test_over_long_prompt_is_refused_unless_allowed(tiny, capsys):
    from rotkv.cli.errors import UsageError
    from rotkv.cli.generate import check_length

    check_length(tiny, 4000, 96, False)  # 4096: the tiny model's context, exactly
    with pytest.raises(UsageError, match="longer than the model's context of 4096 tokens.*--allow-long"):
        check_length(tiny, 4000, 97, False)
    check_length(tiny, 10000, 64, True)
    err = capsys.readouterr().err.strip()
    assert err.startswith("rotkv generate: warning:") and len(err.splitlines()) == 1 and "--allow-long" in err


@pytest.mark.parametrize("argv,needles", [
    (["--threads", "0"], ["--threads has to be >= 1"]),
    (["--samples", "0"], ["--samples has to be >= 1"]),
    (["--lengths", "0"], ["--lengths", ">= 256", "'0'"]),
    (["--lengths", "1024,-5"], ["--lengths", "'-5'"]),
    (["--lengths", "abc"], ["--lengths", "'abc' is not a number"]),
    (["--lengths", "nll=1K", "foo=2K"], ["--lengths", "unknown task 'foo'"]),
    (["--depths", "x"], ["--depths"]),
    (["--window-share", "1"], ["--window-share has to be in [0, 1)"]),
    (["--sink", "-1"], ["--sink has to be >= 0 or 'preset'"]),
])
def test_eval_user_errors_before_the_model(no_model, capsys, tmp_path, argv, needles):
    rc, _, err = run_cli(capsys, "eval", "--out", str(tmp_path / "e"), *argv)
    assert_user_error(rc, err, *needles)


@pytest.mark.parametrize("sink,warned", [(None, True), ("16", True), ("4", False), ("preset", False)])
def test_eval_says_when_it_overrides_a_refine_presets_sink(no_model, capsys, tmp_path, sink, warned):
    """oscar-refine's 4-token sink pays for its tier: a run that gives it another (the profile's 16) says so."""
    argv = ["eval", "--out", str(tmp_path / "e"), "--methods", "oscar-refine,quarot-int2", "--tasks", "nll"]
    rc, _, err = run_cli(capsys, *argv, *(["--sink", sink] if sink else []))  # stops at the model load (no_model)
    assert rc != 0 and "the model was loaded" in err
    msg = f"oscar-refine runs with sink {sink or 16}, not its own 4"
    assert (msg in err) == warned, err
    assert "quarot-int2 runs with sink" not in err  # presets without a tier take the run's sink silently


def test_demo_code_has_to_be_digits(no_model, capsys):
    rc, _, err = run_cli(capsys, "demo", "--code", "abc")
    assert_user_error(rc, err, "--code has to be digits", "'abc'")


def test_demo_makes_a_requested_missing_artifact(no_model, capsys, tmp_path):
    rc, _, err = run_cli(capsys, "demo", "--artifact-dir", str(tmp_path), "--presets", "bf16,oscar-mix")
    assert f"oscar-mix: no oscar-mix.safetensors in {tmp_path}: it is calibrated" in err
    assert "skipping optr-int2" in err and "rotkv calibrate --method optr" in err
    assert rc == 1 and "ModelLoaded" in err  # then the model loads, and the artifact is made


def test_model_folder_without_weights_or_tokenizer_names_the_path(no_model, capsys, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--model", str(tmp_path))
    assert_user_error(rc, err, f"--model {tmp_path}", "no weights")
    (tmp_path / "model.safetensors").write_bytes(b"")
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--model", str(tmp_path))
    assert_user_error(rc, err, f"--model {tmp_path}", "no tokenizer")


@pytest.mark.parametrize("argv,needles", [
    (["--methods", "rotkv:foo"], ["--methods rotkv:foo", "unknown preset 'foo'"]),
    (["--methods", "vllm"], ["--methods", "unknown method 'vllm'"]),
    (["--methods", "rotkv:quarot-int2+graph", "--device", "cpu"], ["+graph needs CUDA"]),
    (["--methods", "rotkv:quarot-int2+graph+fold", "--device", "cpu"], ["+graph+fold needs CUDA"]),
    (["--methods", "rotkv:quarot-int2+fold+foo"], ["--methods", "unknown method 'rotkv:quarot-int2+fold+foo'"]),
    (["--methods", "hf-static-compile", "--device", "cpu"], ["hf-static-compile needs CUDA"]),
    (["--methods", "rotkv:oscar-int2"], ["--artifact", "oscar-int2"]),
    (["--random", "qwen3-8b", "--layers", "0"], ["--layers has to be >= 1"]),
    (["--layers", "2"], ["--layers applies to --random"]),
    (["--new-tokens", "1"], ["--new-tokens"]),
    (["--memory-gb", "8", "--device", "cpu"], ["--memory-gb", "needs CUDA"]),
])
def test_bench_user_errors_before_the_model(no_model, capsys, argv, needles):
    rc, _, err = run_cli(capsys, "bench", *argv)
    assert_user_error(rc, err, *needles)


def test_bench_predicts_memory_before_building_a_random_model(no_model, capsys, monkeypatch):
    monkeypatch.setattr("rotkv.cli.bench.available_gb", lambda device: 16.0)
    monkeypatch.setattr("rotkv.cli.bench._random_model", lambda *a: (_ for _ in ()).throw(ModelLoaded("built")))
    rc, _, err = run_cli(capsys, "bench", "--random", "qwen3-8b", "--device", "cpu")
    assert_user_error(rc, err, "--random qwen3-8b", "32.8 GB", "16.0 GB free", "--layers N")
    rc, _, err = run_cli(capsys, "bench", "--random", "qwen3-8b", "--layers", "2", "--device", "cpu")
    assert rc == 1 and "built" in err  # 2 layers fit: it goes on to build


def test_bench_fails_when_a_method_fails_and_reports_cpu_memory(tiny, capsys, monkeypatch, tmp_path):
    import json

    other = make_tiny_llama(seed=1)  # an artifact made for another model: refused when the cache is built
    art = write_artifact(other, tmp_path / "oscar.safetensors")
    monkeypatch.setattr("rotkv.hf.models.load_model", lambda *a, **k: Loaded(tiny, ByteTokenizer(), "tiny"))
    out = tmp_path / "b.json"
    rc, stdout, err = run_cli(capsys, "bench", "--methods", "hf-dynamic", "rotkv:oscar-int2", "--artifact", art,
                              "--group-size", "16", "--batch", "1", "--context", "16", "--new-tokens", "2",
                              "--device", "cpu", "--out", str(out))
    assert rc == 1
    assert "rotkv bench: error: rotkv:oscar-int2 at batch 1 x 16:" in err and "made for another model" in err
    rows = {r["method"]: r for r in json.load(open(out))["rows"]}
    assert rows["hf-dynamic"]["peak_gb"] > 0.01  # the process's resident memory, not 0.0


def test_export_refuses_an_artifact_without_rotations(tiny, capsys, tmp_path):
    from rotkv.rotations.artifact import load_artifact, save_artifact

    art = load_artifact(write_artifact(tiny, tmp_path / "a.safetensors"))
    tensors = {k: v for k, v in art.tensors.items() if not k.startswith(("R_K.", "R_V."))}
    tensors["bits"] = torch.tensor([2, 4], dtype=torch.int32)
    save_artifact(str(tmp_path / "pmkvq.safetensors"), tensors, dict(art.meta) | {"method": "pmkvq"})
    rc, _, err = run_cli(capsys, "export", "--format", "oscar", "--artifact", str(tmp_path / "pmkvq.safetensors"),
                         "--out", str(tmp_path / "x"))
    assert_user_error(rc, err, "holds no rotations", "'pmkvq'")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv,needles", [
    (["--key-layers", "0"], ["--key-layers has to be in [1, 30]", "got 0"]),
    (["--key-layers", "100"], ["--key-layers has to be in [1, 30]", "got 100"]),
    (["--key-windows", "0"], ["--key-windows has to be >= 1"]),
    (["--base-artifact", "/no/such.safetensors"], ["artifact file not found"]),
])
def test_calibrate_oscar_mix_user_errors_before_the_model(no_model, capsys, tmp_path, argv, needles):
    rc, _, err = run_cli(capsys, "calibrate", "--method", "oscar-mix", "--out", str(tmp_path / "m.safetensors"), *argv)
    assert_user_error(rc, err, *needles)


def test_calibrate_oscar_mix_checks_the_base_artifact(no_model, capsys, tiny, tmp_path):
    optr = write_artifact(tiny, tmp_path / "optr.safetensors", method="optr")
    rc, _, err = run_cli(capsys, "calibrate", "--method", "oscar-mix", "--base-artifact", optr,
                         "--out", str(tmp_path / "m.safetensors"))
    assert_user_error(rc, err, "--base-artifact", "method: artifact 'optr' vs preset 'oscar'")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(bytes(range(256)) * 8)
    rc, _, err = run_cli(capsys, "calibrate", "--method", "oscar-mix", "--base-artifact", str(junk),
                         "--out", str(tmp_path / "m.safetensors"))
    assert_user_error(rc, err, "cannot read artifact")


@pytest.mark.parametrize("argv,needles", [
    (["--base-artifact", "/no/such.safetensors", "--layers", "10"], ["artifact file not found"]),
    (["--layers", "0"], ["--layers has to be in [1, 30]"]),
    (["--layers", "100"], ["--layers has to be in [1, 30]"]),
])
def test_keybits_alias_follows_the_cli_rules(no_model, capsys, tmp_path, argv, needles):
    from rotkv.cli.keybits import main as keybits

    rc = keybits(["--out", str(tmp_path / "m.safetensors"), *argv])
    assert_user_error(rc, capsys.readouterr().err.strip(), *needles)


def test_keybits_alias_unknown_flag_and_read_only_out(no_model, capsys, tmp_path):
    import os

    from rotkv.cli.keybits import main as keybits

    with pytest.raises(SystemExit) as e:
        keybits(["--out", str(tmp_path / "m.safetensors"), "--preset", "foo"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--preset" in err
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        rc = keybits(["--out", str(ro / "m.safetensors")])
        assert_user_error(rc, capsys.readouterr().err.strip(), "--out", "not writable")
    finally:
        os.chmod(ro, 0o700)


def test_rotkv_warnings_print_as_one_cli_line(capsys, monkeypatch):
    import warnings

    from rotkv.config import RotkvWarning

    def load_model(*a, **k):
        warnings.warn("group_size 128 is larger than head_dim 64: using 64", RotkvWarning)
        raise ModelLoaded("stop here")

    monkeypatch.setattr("rotkv.hf.models.load_model", load_model)
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi")
    assert rc == 1 and "rotkv generate: warning: group_size 128 is larger than head_dim 64: using 64" in err


@pytest.mark.parametrize("presets", ["bf16,quarot-int2", "bf16,oscar-int2", "bf16,oscar-mix", "bf16,oscar-mix-long"])
def test_demo_runs_end_to_end_on_a_tiny_model(tiny, capsys, monkeypatch, tmp_path, presets):
    """The README's first command past the model load (the unit tests above stop there): the demo prints a
    row per preset; a calibrated preset named in --presets gets its artifact made first."""
    class Bytes:  # a byte-level tokenizer with what the demo and generate call
        pad_token_id = eos_token_id = 0
        chat_template = None

        def __call__(self, text, return_tensors=None, add_special_tokens=True):
            ids = [1 + b % 127 for b in text.encode()]
            return SimpleNamespace(input_ids=torch.tensor([ids]) if return_tensors == "pt" else ids)

        def decode(self, ids, skip_special_tokens=False):
            return bytes(int(i) for i in ids if int(i)).decode(errors="replace")

    monkeypatch.setattr("rotkv.hf.models.load_model", lambda *a, **k: Loaded(tiny, Bytes(), "tiny"))
    rc, out, err = run_cli(capsys, "demo", "--presets", presets, "--tokens", "300", "--sink", "4", "--window", "16",
                           "--artifact-dir", str(tmp_path))
    assert rc == 0, err
    for name in presets.split(","):
        assert f"  {name}" in out and any(line.startswith(name + " ") for line in out.splitlines()), out
    assert "held MB" in out  # the resident bytes beside the stored bytes
    if "oscar" in presets:  # oscar-mix: the OSCAR base beside its own artifact, not in its place
        assert (tmp_path / "oscar.safetensors").exists()
    if "oscar-mix" in presets:
        from rotkv.rotations.artifact import load_artifact

        assert "k_bits" in load_artifact(str(tmp_path / "oscar-mix.safetensors")).tensors
        assert "k_bits" not in load_artifact(str(tmp_path / "oscar.safetensors")).tensors
    if "oscar-mix-long" in presets:  # made from the oscar-mix artifact beside it: same widths, refitted keys
        mix, long = (load_artifact(str(tmp_path / f"{n}.safetensors")) for n in ("oscar-mix", "oscar-mix-long"))
        assert torch.equal(mix.tensors["k_bits"], long.tensors["k_bits"]) and long.meta["longfit_seq_len"] == "4096"
        assert not torch.equal(mix.tensors["R_K.0"], long.tensors["R_K.0"])


def test_meta_k_overrides_the_preset():
    """--meta-k reaches the CacheSpec (the e4m3 key metadata lever of docs/results/levers_length.md)."""
    import argparse

    from rotkv.cli.common import add_cache_args, cache_overrides, cache_spec

    p = argparse.ArgumentParser()
    add_cache_args(p)
    args = p.parse_args(["--preset", "oscar-refine", "--meta-k", "float8", "--refine-every", "9"])
    spec = cache_spec(args.preset, cache_overrides(args))
    assert spec.meta_k == "float8" and spec.refine_every == 9
    assert cache_spec("oscar-refine", cache_overrides(p.parse_args([]))).meta_k is None
