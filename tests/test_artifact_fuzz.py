"""Fuzzing the artifact loader: whatever bytes a file holds, loading either gives a sound artifact
or refuses it with one ValueError (ArtifactMismatch) that says why; it never crashes otherwise. The same for
what an artifact says it is (``kind``, ``presets``, ``base_artifact``): whatever text they hold, the file is
refused at load or every preset's contract check accepts or refuses it in one line."""

import os
import tempfile

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rotkv.config import PRESETS
from rotkv.contract import check_contract, kind_meta
from rotkv.rotations.artifact import ArtifactMismatch, load_artifact
from rotkv_testing import make_tiny_llama, write_artifact

_DIR = tempfile.mkdtemp(prefix="rotkv-fuzz-")
_MODEL = make_tiny_llama()
_GOOD = write_artifact(_MODEL, os.path.join(_DIR, "good.safetensors"),
                       **kind_meta("oscar") | {"base_artifact": "oscar 0123456789abcdef"})
with open(_GOOD, "rb") as f:
    GOOD = f.read()


def _load(data: bytes):
    path = os.path.join(_DIR, "case.safetensors")
    with open(path, "wb") as f:
        f.write(data)
    return load_artifact(path)


def _refused_or_sound(data: bytes) -> None:
    try:
        art = _load(data)
    except ArtifactMismatch as e:
        assert str(e)  # a reason, one exception type
        return
    assert art.tensors and art.meta.get("method")


def test_the_unmodified_file_loads():
    assert _load(GOOD).meta["method"] == "oscar"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(GOOD) - 1))
def test_truncated_files_are_refused(n):
    try:
        _load(GOOD[:n])
    except ArtifactMismatch:
        return
    raise AssertionError(f"a file cut to {n} of {len(GOOD)} bytes loaded")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(GOOD) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_flipped_bytes_are_refused_or_still_sound(edits):
    data = bytearray(GOOD)
    for pos, value in edits:
        data[pos] = value
    _refused_or_sound(bytes(data))


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_are_refused(data):
    _refused_or_sound(data)


_TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["oscar", "oscar-mix", "oscar-mix-long", "oscar+pmkvq", "", ",",
                                                         "oscar-mix,oscar-int2", "oscar 0123456789abcdef", "OSCAR",
                                                         "oscar 0123", "a" * 70, "oscar-mix-long,", "x\ny"]))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(["kind", "presets", "base_artifact"]), _TEXT, min_size=1))
def test_what_an_artifact_says_it_is_is_checked(fields):
    path = os.path.join(_DIR, "kind.safetensors")
    write_artifact(_MODEL, path, tensors={"k_bits": torch.tensor([4, 2], dtype=torch.int32)}, **fields)
    try:
        art = load_artifact(path)
    except ArtifactMismatch as e:
        assert any(f"`{k}`" in str(e) for k in fields), e  # names the field
        return
    assert art.kind and art.describe().startswith(("a ", "an "))
    for name, spec in PRESETS.items():
        try:
            check_contract(art, spec.replace(group_size=16))
        except ArtifactMismatch as e:
            assert len(str(e).splitlines()) == 1 and path in str(e) and "rotkv calibrate" in str(e), e
