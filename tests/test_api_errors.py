"""The direct API's errors: RotkvCache's constructor and update() refuse bad arguments with a clear
message, and say (RotkvWarning) when they change or ignore a value."""

import pytest
import torch

from rotkv.cache import RotkvCache
from rotkv.config import RotkvWarning
from rotkv_testing import make_tiny_llama, write_artifact


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama()


@pytest.mark.parametrize("args,kwargs,error,match", [
    ((1,), {}, TypeError, "spec has to be a preset name .* or a CacheSpec, not 1"),
    (("quarot-int2",), {"artifact": 123}, TypeError, "artifact has to be a file path, an Artifact or None, not int"),
    (("no-such-preset",), {}, ValueError, "unknown preset 'no-such-preset'"),
])
def test_constructor_refuses_bad_arguments(tiny, args, kwargs, error, match):
    with pytest.raises(error, match=match):
        RotkvCache(tiny, *args, **kwargs)


def test_constructor_refuses_a_non_model():
    with pytest.raises(TypeError, match="model has to be a transformers model"):
        RotkvCache(object(), "quarot-int2")


def test_group_size_clamp_and_unused_artifact_are_said(tiny, tmp_path):
    with pytest.warns(RotkvWarning, match="group_size 128 is larger than head_dim 16: using 16"):
        cache = RotkvCache(tiny, "quarot-int2", group_size=128)
    assert cache.spec.resolved_group(16) == 16
    art = write_artifact(tiny, tmp_path / "oscar.safetensors")
    with pytest.warns(RotkvWarning, match="the artifact is not used by preset 'quarot-int2'"):
        RotkvCache(tiny, "quarot-int2", art)


def test_oscar_mix_without_key_widths_names_the_command(tiny, tmp_path):
    art = write_artifact(tiny, tmp_path / "oscar.safetensors")
    with pytest.raises(ValueError, match="is an oscar artifact .*reads an oscar-mix artifact.*rotkv calibrate --method oscar-mix"):
        RotkvCache(tiny, "oscar-mix", art, group_size=16)


def kv(b=1, q=3, heads=2, d=16):
    return torch.randn(b, heads, q, d), torch.randn(b, heads, q, d)


@pytest.mark.parametrize("make,layer,error,match", [
    (lambda: kv(), 99, IndexError, r"layer_idx has to be an int in \[0, 1\] but got 99"),
    (lambda: kv(), -1, IndexError, "layer_idx"),
    (lambda: kv(), "0", IndexError, "layer_idx"),
    (lambda: kv(heads=3), 0, ValueError, r"key_states has to be a float tensor \[batch, 2, tokens, 16\].*\(1, 3, 3, 16\)"),
    (lambda: kv(d=8), 0, ValueError, "key_states has to be a float tensor"),
    (lambda: (torch.randn(2, 3, 16), torch.randn(2, 3, 16)), 0, ValueError, "key_states"),
    (lambda: (torch.randn(1, 2, 3, 16), torch.randn(1, 2, 4, 16)), 0, ValueError, "differ in batch or tokens"),
    (lambda: (torch.ones(1, 2, 3, 16, dtype=torch.long), torch.randn(1, 2, 3, 16)), 0, ValueError, "float tensor"),
    (lambda: (torch.full((1, 2, 3, 16), float("nan")), torch.randn(1, 2, 3, 16)), 0, ValueError, "NaN or Inf"),
    (lambda: (torch.randn(1, 2, 3, 16), torch.full((1, 2, 3, 16), float("inf"))), 1, ValueError, "NaN or Inf"),
])
def test_update_refuses_bad_states(tiny, make, layer, error, match):
    cache = RotkvCache(tiny, "quarot-int2", group_size=16)
    k, v = make()
    with pytest.raises(error, match=match):
        cache.update(k, v, layer)
    assert cache.get_seq_length() == 0  # nothing was stored
    k, v = kv()
    cache.update(k, v, 0)  # a good call still goes through afterwards


@pytest.mark.parametrize("kwargs,error,match", [
    ({"decode_score": "foo"}, ValueError, r"decode_score has to be one of \['auto', 'bf16', 'int8'\] or None but got 'foo'"),
    ({"check_finite": "no"}, TypeError, "check_finite has to be a bool but got 'no'"),
    ({"check_finite": 1}, TypeError, "check_finite has to be a bool"),
    ({"sink": 10**20}, ValueError, "`sink` has to be at most 2147483647"),
])
def test_constructor_refuses_bad_options(tiny, kwargs, error, match):
    with pytest.raises(error, match=match):
        RotkvCache(tiny, "quarot-int2", group_size=16, **kwargs)


def _mix_and_long(tiny, tmp_path):
    from rotkv.contract import kind_meta

    widths = {"k_bits": torch.tensor([4, 2], dtype=torch.int32), "k_gain": torch.tensor([0.1, 0.0])}
    mix = write_artifact(tiny, tmp_path / "oscar-mix.safetensors", tensors=widths, **kind_meta("oscar-mix"))
    long = write_artifact(tiny, tmp_path / "oscar-mix-long.safetensors", tensors=widths, longfit_seq_len="4096",
                          **kind_meta("oscar-mix-long"))
    return mix, long


def test_the_api_refuses_a_swapped_artifact(tiny, tmp_path):
    mix, long = _mix_and_long(tiny, tmp_path)
    with pytest.raises(ValueError, match=f"artifact {mix} is an oscar-mix artifact .*preset 'oscar-refine' reads an "
                                         "oscar-mix-long artifact; make one with `rotkv calibrate --method oscar-mix-long"):
        RotkvCache(tiny, "oscar-refine", mix, group_size=16)
    with pytest.raises(ValueError, match=f"artifact {long} is an oscar-mix-long artifact .*reads an oscar-mix artifact"):
        RotkvCache(tiny, "oscar-mix", long, group_size=16)
    assert RotkvCache(tiny, "oscar-refine", long, group_size=16).spec.name == "oscar-refine"


def test_the_default_preset_keeps_the_answer(tiny, tmp_path):
    """No preset: int4 with a note naming the calibration; with an artifact, the preset it was made for."""
    with pytest.warns(RotkvWarning, match="using int4 .*rotkv calibrate --method oscar-mix-long"):
        assert RotkvCache(tiny).spec.name == "int4"
    mix, long = _mix_and_long(tiny, tmp_path)
    assert RotkvCache(tiny, artifact=mix, group_size=16).spec.name == "oscar-mix"
    assert RotkvCache(tiny, None, long, group_size=16).spec.name == "oscar-refine"  # the recommended preset, which that artifact serves
