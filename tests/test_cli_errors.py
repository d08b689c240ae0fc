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
    (["--prompt", "hi", "--group-size", "12"], ["--group-size (12)", "allowed: [1, 2, 4, 8, 16, 32, 64]"]),
    (["--prompt", "hi", "--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--prompt", "hi", "--model", "/no/such/model"], ["model '/no/such/model' not found"]),
    (["--prompt", "hi", "--device", "tpu"], ["--device has to be cpu, cuda"]),
    (["--prompt", "hi", "--preset", "oscar-int2"], ["--artifact", "oscar-int2", "rotkv calibrate --method oscar"]),
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


@pytest.mark.parametrize("argv,flag", [(["--sink", "many"], "--sink"), (["--preset", "nope"], "--preset")])
def test_argparse_errors_are_one_line(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        main(["generate", "--prompt", "hi", *argv])
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
