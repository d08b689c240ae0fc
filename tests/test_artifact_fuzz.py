"""Fuzzing the artifact loader: whatever bytes a file holds, loading either gives a sound artifact
or refuses it with one ValueError (ArtifactMismatch) that says why; it never crashes otherwise."""

import os
import tempfile

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rotkv.rotations.artifact import ArtifactMismatch, load_artifact
from rotkv_testing import make_tiny_llama, write_artifact

_DIR = tempfile.mkdtemp(prefix="rotkv-fuzz-")
_GOOD = write_artifact(make_tiny_llama(), os.path.join(_DIR, "good.safetensors"))
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
