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
    monkeypatch.setattr("rotkv.hf.models.peek_context", lambda model=None: 8192)
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
    (["--preset", "optr-int2"], ["is an oscar artifact", "preset 'optr-int2' reads an optr artifact",
                                 "rotkv calibrate --method optr --out optr.safetensors"]),
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
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--preset", "int4")
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
    assert "contract fields: kind oscar (inferred), method oscar, bits 2, group_size 16" in out and "check: ok" in out
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
    assert_user_error(rc, err, f"artifact {optr} is an optr artifact", "preset 'oscar-int2' reads an oscar artifact")


# ---- demo ------------------------------------------------------------------------------------------------------
def test_demo_says_which_presets_it_skips(no_model, capsys, tmp_path, tiny):
    """Without --presets the demo adds the calibrated presets whose artifact is in --artifact-dir and names the
    others; named presets run as named."""
    write_artifact(tiny, tmp_path / "oscar.safetensors")
    rc, _, err = run_cli(capsys, "demo", "--artifact-dir", str(tmp_path))
    assert "skipping optr-int2: no optr.safetensors in" in err and "skipping oscar-int2" not in err
    assert rc == 1 and "ModelLoaded" in err
    rc, _, err = run_cli(capsys, "demo", "--artifact-dir", str(tmp_path), "--presets", "bf16")
    assert "skipping" not in err and rc == 1 and "ModelLoaded" in err


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
    assert_user_error(rc, err, "is an oscar artifact", "reads an oscar-mix artifact",
                      f"rotkv calibrate --method oscar-mix --base-artifact {oscar} --out oscar-mix.safetensors")


def test_inspect_check_preset_runs_generates_contract(tiny, capsys, oscar, tmp_path):
    """inspect --check --preset oscar-mix refuses what generate refuses: an artifact without key widths."""
    rc, out, err = run_cli(capsys, "inspect", oscar, "--check", "--preset", "oscar-mix")
    assert_user_error(rc, err, f"artifact {oscar} is an oscar artifact", "reads an oscar-mix artifact")
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
    (["--seed", "-1"], ["--seed has to be >= 0"]),
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
    rc, _, err = run_cli(capsys, "demo", "--artifact-dir", str(tmp_path), "--presets", "bf16,oscar-mix,oscar-refine")
    assert f"oscar-mix: no oscar-mix.safetensors in {tmp_path}: it is calibrated" in err
    assert "`rotkv calibrate --method oscar-mix`'s defaults" in err
    assert "oscar-refine: no oscar-mix-long.safetensors" in err and "but with one long key fit" in err
    assert "skipping" not in err  # only the presets named run
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
    from rotkv import switches

    monkeypatch.setenv("ROTKV_TUNING", "refine_split=0")  # recorded: the JSON says which A/B side it is
    rc, stdout, err = run_cli(capsys, "bench", "--methods", "hf-dynamic", "rotkv:oscar-int2", "--artifact", art,
                              "--group-size", "16", "--batch", "1", "--context", "16", "--new-tokens", "2",
                              "--device", "cpu", "--out", str(out))
    assert rc == 1
    assert "rotkv bench: error: rotkv:oscar-int2 at batch 1 x 16:" in err and "made for another model" in err
    data = json.load(open(out))
    rows = {r["method"]: r for r in data["rows"]}
    assert rows["hf-dynamic"]["peak_gb"] > 0.01  # the process's resident memory, not 0.0
    assert data["meta"]["tuning"]["refine_split"] == "0" and set(data["meta"]["tuning"]) == set(switches.TUNING_FIELDS)
    # the JSON names what ran where: the commit (ROTKV_COMMIT or git), the device, the time, the model
    assert data["meta"]["gpu"] == "cpu" and data["meta"]["model"] == "tiny" and data["meta"]["commit"]
    assert data["meta"]["utc"].endswith("Z") and len(data["meta"]["utc"]) == 20


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
    assert_user_error(rc, err, f"--base-artifact {optr} is an optr artifact", "made from an oscar or oscar-mix")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(bytes(range(256)) * 8)
    rc, _, err = run_cli(capsys, "calibrate", "--method", "oscar-mix", "--base-artifact", str(junk),
                         "--out", str(tmp_path / "m.safetensors"))
    assert_user_error(rc, err, "cannot read artifact")


def test_calibrate_read_only_out(no_model, capsys, tmp_path):
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        rc, _, err = run_cli(capsys, "calibrate", "--method", "oscar-mix", "--out", str(ro / "m.safetensors"))
        assert_user_error(rc, err, "--out", "not writable")
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
    assert "recommended preset: oscar-refine" in out
    if "oscar" in presets:  # where the artifacts are, and that this run made them
        name = presets.split(",")[1]
        assert f"artifacts read:\n  {name}: {tmp_path}" in out and "calibrated by this run" in out
    if "oscar" in presets:  # oscar-mix: the OSCAR base beside its own artifact, not in its place
        assert (tmp_path / "oscar.safetensors").exists()
    if "oscar-mix" in presets:
        from rotkv.rotations.artifact import load_artifact

        assert "k_bits" in load_artifact(str(tmp_path / "oscar-mix.safetensors")).tensors
        assert "k_bits" not in load_artifact(str(tmp_path / "oscar.safetensors")).tensors
    if "oscar-mix-long" in presets:  # made from the oscar-mix artifact beside it: same widths, refitted keys
        mix, long = (load_artifact(str(tmp_path / f"{n}.safetensors")) for n in ("oscar-mix", "oscar-mix-long"))
        assert torch.equal(mix.tensors["k_bits"], long.tensors["k_bits"]) and long.meta["longfit_seq_len"] == "4096"
        # demo-sized: only the fit the demo's row uses, and the output says so
        assert "key_fit_lengths" not in long.meta and "key fit of 4096-token sequences only" in out
        assert not torch.equal(mix.tensors["R_K.0"], long.tensors["R_K.0"])
        # each records what it is and what it was made from
        assert (long.meta["kind"], long.meta["base_artifact"]) == ("oscar-mix-long", f"oscar-mix {mix.identity}")
        assert long.meta["presets"] == "oscar-mix-long,oscar-refine"
    if "oscar-mix" in presets:
        base, mix = (load_artifact(str(tmp_path / f"{n}.safetensors")) for n in ("oscar", "oscar-mix"))
        assert (mix.meta["kind"], mix.meta["base_artifact"]) == ("oscar-mix", f"oscar {base.identity}")
        assert mix.meta["presets"] == "oscar-mix,oscar-int2"
        assert (base.meta["kind"], base.meta["presets"]) == ("oscar", "oscar-int2") and "base_artifact" not in base.meta


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


# ---- round 4: every numeric flag's bounds, over-long prompts, paths checked first ---------------------------
def _numeric_flags():
    """(command, flag, type) of every int / float flag of every subcommand."""
    import argparse

    from rotkv.cli import bounded_float, bounded_int, build_parser

    out = []
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command, child in action.choices.items():
                out += [(command, a.option_strings[0], a.type.__name__) for a in child._actions
                        if a.type in (bounded_int, bounded_float)]
    return out


# what each flag needs beside it to be read at all (its command's required flags, the mode it belongs to)
_WITH = {"generate": ["--prompt", "hi"], "calibrate": ["--method", "oscar", "--out", "OUT/o.safetensors"],
         "eval": ["--out", "OUT/e"], "build-kernels": ["--head-dim", "64", "--arch", "90"], "demo": [], "bench": []}
_FLAG_WITH = {("generate", "--temperature"): ["--sample"], ("generate", "--top-p"): ["--sample"],
              ("calibrate", "--key-layers"): ["--method", "oscar-mix"], ("calibrate", "--key-length"): ["--method", "oscar-mix"],
              ("calibrate", "--key-new-tokens"): ["--method", "oscar-mix"],
              ("calibrate", "--key-windows"): ["--method", "oscar-mix"],
              ("calibrate", "--long-sequences"): ["--method", "oscar-mix-long"],
              ("calibrate", "--budget-bpe"): ["--method", "pmkvq"], ("calibrate", "--stretch"): ["--method", "pmkvq"],
              ("bench", "--layers"): ["--random", "smollm2"], ("bench", "--start"): ["--max-batch"],
              ("bench", "--limit"): ["--max-batch"], ("bench", "--max-tries"): ["--max-batch"],
              ("generate", "--refine-every"): ["--refine-tokens", "64"], ("bench", "--refine-every"): ["--refine-tokens", "64"]}


def test_every_numeric_flag_is_found():
    flags = _numeric_flags()
    assert len(flags) >= 40 and ("generate", "--sink", "bounded_int") in flags and ("bench", "--memory-gb", "bounded_float") in flags


@pytest.mark.parametrize("command,flag,kind", _numeric_flags())
@pytest.mark.parametrize("value", ["-5", "huge"])
def test_every_numeric_flag_refuses_out_of_range_values(no_model, capsys, tmp_path, command, flag, kind, value):
    """A negative, huge (integers) or not finite (numbers) value of any numeric flag is one line naming the flag,
    before the model loads."""
    if value == "huge":
        value = "99999999999999999999" if kind == "bounded_int" else "nan"
    argv = [a.replace("OUT", str(tmp_path)) for a in _WITH[command]]
    extra = _FLAG_WITH.get((command, flag), [])
    if extra[:1] == ["--method"]:  # the mode replaces the command's default method
        argv = [a for a in argv if a not in ("--method", "oscar")]
    try:
        rc = main([command, *argv, *extra, flag, value])
    except SystemExit as e:  # argparse: a value out of range or a bad choice
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, (command, flag, value, err)
    assert len(err.splitlines()) == 1 and flag in err and "Traceback" not in err, (flag, err)


def _kinds(tiny, folder, old=False):
    """A plain oscar, an oscar-mix and an oscar-mix-long artifact of the tiny Llama in ``folder``, with their kind
    recorded (or, ``old``, without: made before rotkv recorded it, inferred from what they hold)."""
    from rotkv.contract import kind_meta

    widths = {"k_bits": torch.tensor([4, 2], dtype=torch.int32), "k_gain": torch.tensor([0.1, 0.0])}
    meta = (lambda k: {}) if old else kind_meta
    return {
        "oscar": write_artifact(tiny, folder / "oscar.safetensors", **meta("oscar")),
        "oscar-mix": write_artifact(tiny, folder / "oscar-mix.safetensors", tensors=widths, **meta("oscar-mix")),
        "oscar-mix-long": write_artifact(tiny, folder / "oscar-mix-long.safetensors", longfit_seq_len="4096",
                                         tensors=widths | {"R_K.0": torch.eye(16).expand(2, 16, 16).contiguous()},
                                         **meta("oscar-mix-long")),
    }


@pytest.mark.parametrize("old", [False, True])
@pytest.mark.parametrize("preset,given", [("oscar-refine", "oscar-mix"), ("oscar-mix-long", "oscar-mix"),
                                          ("oscar-mix", "oscar-mix-long"), ("oscar-int2", "oscar-mix-long")])
def test_the_key_refit_and_its_base_are_never_swapped(no_model, capsys, tiny, tmp_path, preset, given, old):
    """generate and inspect refuse an artifact of another kind in one line: the file, what it is, the command."""
    path = _kinds(tiny, tmp_path, old)[given]
    need = "oscar-mix-long" if preset in ("oscar-refine", "oscar-mix-long") else preset.replace("-int2", "")
    needles = [f"artifact {path} is an {given} artifact", f"preset '{preset}' reads an {need} artifact",
               f"rotkv calibrate --method {need}"]
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--preset", preset, "--artifact", path, "--group-size", "16")
    assert_user_error(rc, err, *needles)
    assert "). ." not in err and ". ." not in err
    if need == "oscar-mix-long":  # made from the artifact that was given
        assert f"--base-artifact {path}" in err
    rc, out, err = run_cli(capsys, "inspect", path, "--preset", preset)
    assert_user_error(rc, err, *needles)


def test_each_artifact_is_read_by_its_own_presets(no_model, capsys, tiny, tmp_path):
    for kind, path in _kinds(tiny, tmp_path).items():
        for preset in {"oscar": ["oscar-int2"], "oscar-mix": ["oscar-mix", "oscar-int2"],
                       "oscar-mix-long": ["oscar-mix-long", "oscar-refine"]}[kind]:
            rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--preset", preset, "--artifact", path,
                                 "--group-size", "16")
            assert rc == 1 and "ModelLoaded" in err, (kind, preset, err)  # every early check passed
        rc, out, err = run_cli(capsys, "inspect", path)
        assert rc == 0 and f"is an {kind} artifact" in out, err
        assert "  base: \n" not in out and not any(line.rstrip().endswith(":") for line in out.splitlines()[2:])


def test_without_a_preset_the_artifact_names_it(no_model, capsys, tiny, tmp_path):
    """No --preset: the preset the artifact was made for; no artifact: int4 and a note naming the calibration."""
    from rotkv.cli.common import pick_preset

    own = {"oscar": "oscar-int2", "oscar-mix": "oscar-mix", "oscar-mix-long": "oscar-refine"}  # the recommended preset where the artifact serves it
    for old in (False, True):
        folder = tmp_path / str(old)
        folder.mkdir()
        for kind, path in _kinds(tiny, folder, old).items():
            assert pick_preset(None, path) == (own[kind], None)
    assert pick_preset("bf16", None) == ("bf16", None)
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi")
    lines = err.splitlines()
    assert lines[0].startswith("rotkv generate: note: no preset named and no artifact given: using int4")
    assert "rotkv calibrate --method oscar-mix-long --out oscar-mix-long.safetensors" in lines[0]
    assert rc == 1 and "ModelLoaded" in lines[1] and len(lines) == 2
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--artifact", _kinds(tiny, tmp_path)["oscar-mix"],
                         "--group-size", "16")
    assert rc == 1 and "ModelLoaded" in err and "note" not in err  # oscar-mix, silently: the artifact said so


def test_eval_bench_and_demo_refuse_a_swapped_artifact_before_the_model(no_model, capsys, tiny, tmp_path):
    import shutil

    arts = _kinds(tiny, tmp_path)
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    shutil.copy(arts["oscar-mix"], swapped / "oscar-mix-long.safetensors")  # the base where its refit belongs
    rc, _, err = run_cli(capsys, "eval", "--out", str(tmp_path / "e"), "--methods", "oscar-refine", "--tasks", "nll",
                         "--artifact-dir", str(swapped), "--sink", "preset")
    assert_user_error(rc, err, "--artifact-dir", "is an oscar-mix artifact", "reads an oscar-mix-long artifact")
    rc, _, err = run_cli(capsys, "bench", "--methods", "rotkv:oscar-refine", "--artifact", arts["oscar-mix"],
                         "--group-size", "16", "--device", "cpu")
    assert_user_error(rc, err, "is an oscar-mix artifact", "reads an oscar-mix-long artifact")
    rc, _, err = run_cli(capsys, "demo", "--presets", "bf16,oscar-refine", "--artifact-dir", str(swapped))
    assert_user_error(rc, err, "is an oscar-mix artifact", "reads an oscar-mix-long artifact")


@pytest.mark.parametrize("argv,needles", [
    (["demo", "--presets", "bf16", "--tokens", "20000"], ["--tokens 20000", "longer than the model's context of 8192"]),
    (["eval", "--out", "OUT/e", "--tasks", "nll", "--lengths", "16K"], ["--lengths 16384", "context of 8192"]),
    (["bench", "--context", "8190", "--new-tokens", "8", "--device", "cpu", "--methods", "hf-dynamic"],
     ["--context 8190 plus --new-tokens 8", "context of 8192"]),
    (["calibrate", "--method", "oscar-mix-long", "--long-seq-len", "16384", "--out", "OUT/o.safetensors"],
     ["--long-seq-len 16384", "context of 8192"]),
    (["calibrate", "--method", "oscar-mix", "--key-length", "8190", "--out", "OUT/o.safetensors"],
     ["--key-length 8190 plus --key-new-tokens 32", "context of 8192"]),
    (["generate", "--prompt", "hi", "--max-new-tokens", "9000"], ["--max-new-tokens 9000", "context of 8192"]),
])
def test_over_long_prompts_are_refused_in_every_command(no_model, capsys, tmp_path, argv, needles):
    rc, _, err = run_cli(capsys, *[a.replace("OUT", str(tmp_path)) for a in argv])
    assert_user_error(rc, err, *needles)


@pytest.mark.parametrize("argv,needles", [
    (["build-kernels", "--head-dim", "64", "--arch", "90", "--jobs", "0"], ["--jobs has to be >= 1"]),
    (["build-kernels", "--head-dim", "64", "--arch", "90", "--jobs", "-2"], ["--jobs has to be >= 1"]),
    (["calibrate", "--method", "oscar", "--group-size", "48", "--out", "OUT/o.safetensors"],
     ["--group-size (48)", "head_dim (64)"]),
    (["eval", "--out", "OUT/afile"], ["--out", "is a file"]),
    (["eval", "--out", "OUT/e", "--variants", "nope"], ["--variants", "'nope'"]),
    (["eval", "--out", "OUT/e", "--methods", "nope"], ["--methods", "'nope'"]),
    (["eval", "--out", "OUT/e", "--text", "/no/such.txt"], ["--text", "/no/such.txt"]),
    (["bench", "--out", "OUT", "--methods", "hf-dynamic", "--device", "cpu"], ["--out", "is a directory"]),
    (["bench", "--out", "OUT/afile/b.json", "--methods", "hf-dynamic", "--device", "cpu"], ["--out", "is a file"]),
    (["generate", "--prompt", "hi", "--model", "OUT/afile"], ["is a file but not a .gguf file"]),
])
def test_round4_cases_are_clean_and_early(no_model, capsys, tmp_path, argv, needles):
    (tmp_path / "afile").write_text("not a model")
    rc, _, err = run_cli(capsys, *[a.replace("OUT", str(tmp_path)) for a in argv])
    assert_user_error(rc, err, *needles)


@pytest.mark.parametrize("argv,needle", [
    (["bench", "--prefill-tokens", "abc"], "--prefill-tokens: expected a number of tokens (at most 2147483647) or 'auto', got 'abc'"),
    (["bench", "--prefill-tokens", "1" + "0" * 20], "--prefill-tokens: expected a number of tokens"),
    (["eval", "--out", "x", "--sink", "1" + "0" * 20], "--sink: expected a number of tokens (at most 2147483647) or 'preset'"),
    (["generate", "--prompt", "hi", "--sink", "99999999999999999999"], "--sink: 99999999999999999999 is out of range"),
])
def test_text_and_huge_numbers_name_the_flag(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_read_only_folders_are_refused_before_the_work(no_model, capsys, tmp_path, tiny, monkeypatch):
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    access = os.access
    # a folder this user cannot write (chmod alone does not stop root)
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p).startswith(str(ro)) and mode & os.W_OK
                        else access(p, mode))
    if True:
        rc, _, err = run_cli(capsys, "demo", "--presets", "bf16,oscar-int2", "--artifact-dir", str(ro))
        assert_user_error(rc, err, "--artifact-dir", "not writable", "oscar-int2")
        rc, _, err = run_cli(capsys, "bench", "--out", str(ro / "b.json"), "--methods", "hf-dynamic", "--device", "cpu")
        assert_user_error(rc, err, "--out", "not writable")
        rc, _, err = run_cli(capsys, "eval", "--out", str(ro / "e"))
        assert_user_error(rc, err, "--out", "not writable")


def test_bench_without_out_writes_to_the_current_folder(no_model, capsys, tmp_path, monkeypatch):
    from types import SimpleNamespace as NS

    from rotkv.cli.bench import check_args

    monkeypatch.chdir(tmp_path)
    args = NS(new_tokens=8, prefill_chunk=None, start=1, limit=None, max_tries=None, prefill_tokens="auto", batch=[1],
              context=[64], device="cpu", memory_gb=None, methods=["hf-dynamic"], max_batch=False, out=None,
              layers=None, random=None, model=None, artifact=None)
    check_args(args)
    assert args.out.startswith("rotkv-generate-") and args.out.endswith(".json") and "/" not in args.out


def test_truncated_weights_name_the_model_folder(capsys, tmp_path):
    from rotkv_testing import save_tiny_llama_dir

    d = save_tiny_llama_dir(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hi", "--model", d, "--preset", "int4")
    assert_user_error(rc, err, f"model {d}: cannot read its weights (model.safetensors)", "truncated")


def test_an_unused_artifact_is_said_once(tiny, capsys, monkeypatch, tmp_path):
    art = write_artifact(tiny, tmp_path / "oscar.safetensors")

    class Chars:
        pad_token_id = eos_token_id = 0
        chat_template = None

        def __call__(self, text, return_tensors=None, add_special_tokens=True):
            return SimpleNamespace(input_ids=torch.tensor([[1 + b % 127 for b in text.encode()]]))

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(32 + int(i) % 90) for i in ids)

    monkeypatch.setattr("rotkv.hf.models.load_model", lambda *a, **k: Loaded(tiny, Chars(), "tiny"))
    rc, _, err = run_cli(capsys, "generate", "--prompt", "hello", "--preset", "quarot-int2", "--artifact", art,
                         "--group-size", "16", "--max-new-tokens", "2", "--no-chat")
    assert rc == 0, err
    assert err.count("is not used by preset 'quarot-int2'") == 1, err


def test_a_wrong_base_in_the_artifact_folder_is_refused_before_the_model(no_model, capsys, tiny, tmp_path):
    """eval and demo make a missing oscar-mix artifact from the oscar.safetensors beside it: an OptR file there is
    refused before anything loads (and calibrate_mix refuses it too)."""
    write_artifact(tiny, tmp_path / "oscar.safetensors", method="optr")
    rc, _, err = run_cli(capsys, "eval", "--out", str(tmp_path / "e"), "--methods", "oscar-mix", "--tasks", "nll",
                         "--artifact-dir", str(tmp_path))
    assert_user_error(rc, err, "--artifact-dir", "oscar.safetensors is an optr artifact", "rotkv calibrate --method oscar")
    from rotkv.calibrate.keybits import calibrate_mix

    with pytest.raises(ValueError, match="is an optr artifact .*key widths .* are measured on an oscar artifact"):
        calibrate_mix(Loaded(tiny, None, "tiny"), str(tmp_path / "oscar.safetensors"))


def test_demo_refuses_a_wrong_base_before_the_model(no_model, capsys, tiny, tmp_path):
    write_artifact(tiny, tmp_path / "oscar.safetensors", method="optr")
    rc, _, err = run_cli(capsys, "demo", "--presets", "bf16,oscar-mix", "--artifact-dir", str(tmp_path))
    assert_user_error(rc, err, "--artifact-dir", "oscar.safetensors is an optr artifact")


def test_help_lists_the_commands_in_a_users_order(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "{demo,calibrate,inspect,generate,eval,lm-eval,bench,build-kernels,export}" in out


def test_lm_eval_without_the_harness_is_one_line(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    rc, _, err = run_cli(capsys, "lm-eval", "run", "--model", "rotkv", "--tasks", "arc_easy")
    assert_user_error(rc, err, "lm-eval", "pip install -e '.[lmeval]'")


def test_a_closed_stdout_ends_the_command_quietly(tiny, tmp_path):
    """`rotkv inspect A | head -1`: the reader leaves before the command has written; the command stops with
    SIGPIPE's status and nothing on stderr (no traceback, no 'failed' line, no error at the interpreter's exit)."""
    import os
    import subprocess
    import sys

    art = write_artifact(tiny, tmp_path / "a.safetensors")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.Popen([sys.executable, "-m", "rotkv.cli", "inspect", str(art)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, cwd=root, env={**os.environ, "PYTHONPATH": root})
    p.stdout.close()  # the reader is gone before the first write
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert err == ""
