"""The environment switches (rotkv.switches): read once into one typed config, every bad value refused
with the variable's name on any device (here: a CPU), before a model loads; the variables documented in
docs/configuration.md are the ones read; no other module of rotkv reads the environment."""

import ast
import re
from pathlib import Path

import pytest

from rotkv import switches
from rotkv.cli import main

ROOT = Path(__file__).resolve().parents[1]

BAD = [  # (variable, value, what the message says)
    ("ROTKV_DECODE_BACKEND", "cdua", "ROTKV_DECODE_BACKEND='cdua': expected one of auto, cuda, triton"),
    ("ROTKV_WRITE_BACKEND", "fast", "ROTKV_WRITE_BACKEND='fast': expected one of auto, cuda, triton"),
    ("ROTKV_KERNELS", "off please", "ROTKV_KERNELS='off please': expected 1 or 0"),
    ("ROTKV_DECODE_CONFIG", "wide_num_warps=4", "ROTKV_DECODE_CONFIG is no longer read: set ROTKV_TUNING="),
    ("ROTKV_PREFILL_HISTORY_MB", "0", "ROTKV_PREFILL_HISTORY_MB='0': expected a whole number"),
    ("ROTKV_NO_MODEL_CACHE", "maybe", "ROTKV_NO_MODEL_CACHE='maybe'"),
    ("ROTKV_NVCC", "/nonexistent/nvcc", "ROTKV_NVCC='/nonexistent/nvcc': not an executable file"),
    ("ROTKV_TUNING", "wide_num_warps=3", "ROTKV_TUNING: wide_num_warps must be a power of two"),
    ("ROTKV_TUNING", "refine_kernel=maybe", "ROTKV_TUNING: bad value 'maybe' for refine_kernel"),
    ("ROTKV_TUNING", "decode_score=int4", "ROTKV_TUNING decode_score must be one of"),
    ("ROTKV_TUNING", "refine_split=yes", "ROTKV_TUNING refine_split must be one of"),
    ("ROTKV_TUNING", "blocks=2", "'blocks=2' is not name=value with a tuning field"),
] + [(var, "1", f"{var} is no longer read: set ROTKV_TUNING={rep}") for var, rep in switches.RETIRED.items()]


@pytest.mark.parametrize("var, value, message", BAD)
def test_a_bad_switch_is_refused_on_a_cpu_when_the_cache_is_made(var, value, message, monkeypatch,
                                                                  tiny_llama):
    from rotkv.cache import RotkvCache

    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=re.escape(message)):
        switches.reload()
    with pytest.raises(ValueError, match=re.escape(message)):
        RotkvCache(tiny_llama, "quarot-int2")


@pytest.mark.parametrize("var, value, message", [b for b in BAD if b[0] != "ROTKV_NVCC"][:5])
def test_a_bad_switch_fails_the_command_before_the_model_loads(var, value, message, monkeypatch, capsys):
    def load_model(*a, **k):
        raise AssertionError("the model was loaded before the switches were checked")

    monkeypatch.setattr("rotkv.hf.models.load_model", load_model)
    monkeypatch.setenv(var, value)
    assert main(["generate", "--prompt", "hi", "--preset", "int4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rotkv generate: error: ") and message in err and len(err.splitlines()) == 1


def test_switches_are_read_once(monkeypatch):
    first = switches.get()
    assert switches.get() is first
    monkeypatch.setenv("ROTKV_DECODE_BACKEND", "triton")
    assert switches.get().decode_backend == first.decode_backend  # read once: the change waits for reload
    assert switches.reload().decode_backend == "triton"


def test_tuning_fields_and_overrides():
    sw = switches.from_environ({"ROTKV_TUNING": "refine_kernel=0, decode_score=bf16,wide_num_warps=2,cuda_min_blocks=none",
                                "ROTKV_KERNELS": "false", "ROTKV_COMMIT": "abc"})
    assert (sw.refine_kernel, sw.decode_score, sw.kernels, sw.commit) == (False, "bf16", False, "abc")
    cfg = sw.decode_config()
    assert (cfg.score, cfg.wide_num_warps, cfg.cuda_min_blocks) == ("bf16", 2, None)
    assert sw.decode_config() is cfg and sw.decode_config("int8").score == "int8"
    default = switches.get()
    with switches.override(write_backend="triton", decode={"block_n": 32}) as on:
        assert switches.get() is on and on.write_backend == "triton" and on.decode_config().block_n == 32
    assert switches.get() is default
    with pytest.raises(ValueError, match="ROTKV_WRITE_BACKEND must be one of"):
        switches.configure(write_backend="cdua")
    with pytest.raises(ValueError, match="not DecodeConfig fields"):
        switches.configure(decode={"blocks": 1})


def test_plans_follow_the_switches():
    """A plan made under other switches is not reused (the plans are cached per switches)."""
    import torch

    from rotkv.kernels import plan
    from rotkv.kernels.body import PagedBody

    body = PagedBody.zeros(4, 2, 16, 64, (2, 2), 32)
    q = torch.zeros(1, 4, 64)
    refined = plan.plan_decode(q, body, plan.DecodeConfig(), refine=(True, False))
    assert refined.covered and refined.launch(100).v2 is False and "refine" in refined.describe()
    with switches.override(refine_kernel=False):
        off = plan.plan_decode(q, body, plan.DecodeConfig(), refine=(True, False))
        assert not off.covered and "refine_kernel=0" in off.why
    assert plan.plan_decode(q, body, plan.DecodeConfig(), refine=(True, False)).covered


def test_the_documented_variables_are_the_ones_read():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    named = set(re.findall(r"`(ROTKV_[A-Z0-9_]+)", doc))
    read = set(switches.VARIABLES) | {switches.TUNING, switches.COMMIT}
    assert read <= named, read - named
    assert named - read <= set(switches.RETIRED), named - read - set(switches.RETIRED)
    assert len(switches.VARIABLES) <= 8
    for name in switches.TUNING_FIELDS:
        assert f"`{name}`" in doc, name


def test_only_the_switches_module_reads_the_environment():
    readers = []
    for path in (ROOT / "rotkv").rglob("*.py"):
        if path.name == "switches.py" and path.parent.name == "rotkv":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv") and \
                    isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers == []
