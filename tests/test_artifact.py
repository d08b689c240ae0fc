"""Calibration artifacts end to end on a tiny random model: every method, metadata, validation,
`rotkv inspect`, the cache reading the artifact, and folded values."""

import argparse
import copy
from types import SimpleNamespace

import pytest
import torch

from rotkv.calibrate.run import CalibConfig, calibrate
from rotkv.hf.models import Loaded
from rotkv.contract import validate_artifact
from rotkv.rotations.artifact import ArtifactMismatch, load_artifact, save_artifact
from rotkv.rotations import registry
from rotkv.hf.folding import fold_artifact_values
from rotkv_testing import make_tiny_llama


class ByteTokenizer:
    """Bytes modulo the tiny vocabulary: enough to run the calibration driver on a random model."""

    def __call__(self, text, return_tensors=None):
        return SimpleNamespace(input_ids=torch.tensor([[b % 128 for b in text.encode()]]))


META = ("format_version", "method", "model_id", "config_hash", "weights_fingerprint", "num_layers", "kv_heads",
        "head_dim", "bits", "group_size", "clip_k", "clip_v", "calib_tokens", "date", "granularity", "values_folded",
        "threads", "torch_version", "transformers_version")


@pytest.fixture(scope="module")
def tiny():
    return Loaded(make_tiny_llama(), ByteTokenizer(), "tiny-llama")


def _cal(tiny, method, **kw):
    cfg = CalibConfig(method=method, tokens=512, chunk_len=128, steps=10, progress=False, **kw)
    return calibrate(tiny, cfg)


@pytest.mark.parametrize("method", registry.rotation_fits())
def test_every_method_writes_a_valid_artifact(tiny, tmp_path, method):
    tensors, meta = _cal(tiny, method)
    path = str(tmp_path / f"{method}.safetensors")
    save_artifact(path, tensors, meta)
    art = load_artifact(path)
    assert all(k in art.meta for k in META), [k for k in META if k not in art.meta]
    assert art.meta["method"] == method and art.meta["calib_tokens"] == str(2 * 128)  # 2 of 4 chunks held out
    validate_artifact(art, tiny.model)
    for l in range(2):
        r = art.layer_rotation(l)
        assert r.R_K.shape == (2, 16, 16) and r.k_mean.shape == (2, 16)
        for m in (r.R_K, r.R_V):
            torch.testing.assert_close(m.transpose(-1, -2) @ m, torch.eye(16).expand(2, 16, 16), atol=1e-5, rtol=0)
        assert 0.8 < r.clip_k <= 1.0 and 0.8 < r.clip_v <= 1.0
    want = {"layer": 1, "kv-head": 2}[art.meta["granularity"]]
    assert art.tensors["R_K.0"].shape[0] == want
    assert art.meta["granularity"] == registry.get(method).granularity
    if method == "pairwise":
        assert art.tensors["pair_angles_k.0"].shape == (1, 8)


def test_bad_options_name_the_field():
    with pytest.raises(ValueError, match="`cs` has to be one of"):
        CalibConfig(method="oscar", cs="full")
    with pytest.raises(ValueError, match="`method` has to be one of"):
        CalibConfig(method="quarot")


def test_loader_refuses_another_models_artifact(tiny, tmp_path):
    tensors, meta = _cal(tiny, "hadamard", search_clips=False)
    path = str(tmp_path / "a.safetensors")
    save_artifact(path, tensors, meta)
    art = load_artifact(path)
    with pytest.raises(ArtifactMismatch, match="weights_fingerprint.*rotkv calibrate"):
        validate_artifact(art, make_tiny_llama(seed=1))  # same shapes, other weights
    with pytest.raises(ArtifactMismatch, match="kv_heads: artifact 2 vs model 4"):
        validate_artifact(art, make_tiny_llama(kv_heads=4))


def test_inspect_prints_summary(tiny, tmp_path, capsys):
    from rotkv.cli import inspect

    tensors, meta = _cal(tiny, "oscar", search_clips=False)
    path = str(tmp_path / "o.safetensors")
    save_artifact(path, tensors, meta)
    assert inspect.run(argparse.Namespace(file=path, model=None, check=True)) == 0
    out = capsys.readouterr().out
    assert "method: oscar" in out and "R_K: 2 tensor(s)" in out and "max |R^T R - I|" in out


def test_cache_reads_artifact_and_folded_values_match(tiny, tmp_path):
    from rotkv.cache import RotkvCache
    from rotkv.hf import compat

    tensors, meta = _cal(tiny, "oscar", bits=8)  # the contract: clips fitted for the INT8 body used below
    path = str(tmp_path / "o.safetensors")
    save_artifact(path, tensors, meta)
    art = load_artifact(path)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    ref = tiny.model(ids).logits
    kw = dict(bits=8, sink=4, window=8, page_size=4, prefill_chunk=16)
    with torch.no_grad():
        arg = compat.cache_kwarg(tiny.model)
        plain = tiny.model(ids, **{arg: RotkvCache(tiny.model, "oscar-int2", art, **kw)}).logits
        folded_model = copy.deepcopy(tiny.model)
        folded = fold_artifact_values(folded_model, art)
        assert folded.values_folded and "R_V.0" not in folded.tensors
        got = folded_model(ids, **{arg: RotkvCache(folded_model, "oscar-int2", folded, **kw)}).logits
    assert (plain - ref).abs().max() < 0.05  # INT8 body: near the fp model
    torch.testing.assert_close(got, plain, atol=2e-3, rtol=0)  # folding moves R_V, not the stored values
    with pytest.raises(ValueError, match="already"):
        fold_artifact_values(folded_model, art)


def test_artifact_loads_under_another_default_device(tiny, tmp_path):
    """vLLM builds its model under ``with torch.device("cuda")``; loading and checking an artifact there must not
    mix the default device into the artifact's CPU tensors (the meta device stands in for CUDA here)."""
    tensors, meta = _cal(tiny, "oscar", bits=8)
    path = str(tmp_path / "o.safetensors")
    save_artifact(path, tensors, meta)
    ref = load_artifact(path)
    with torch.device("meta"):
        art = load_artifact(path)
    assert set(art.tensors) == set(ref.tensors)
    assert all(t.device.type == "cpu" and torch.equal(t, ref.tensors[k]) for k, t in art.tensors.items())


def test_eval_provenance_names_an_artifact_by_its_tensors_as_well_as_its_file(tmp_path):
    """Two files with the same tensors and other metadata (a date) differ in their file hash; the provenance of an
    evaluation also records the tensors' id, equal for both, so a report can tell the same artifact apart."""
    import json
    from rotkv.eval import run as eval_run
    from rotkv_testing import write_artifact

    model = make_tiny_llama()
    means = {f"k_mean.{l}": torch.ones(2, 16) for l in range(2)}  # (write_artifact draws them at random)
    a = write_artifact(model, tmp_path / "a.safetensors", tensors=means, date="2026-12-06T03:20:01+00:00")
    b = write_artifact(model, tmp_path / "b.safetensors", tensors=means, date="2026-12-06T07:59:54+00:00")
    c = write_artifact(model, tmp_path / "c.safetensors", tensors=means | {"k_mean.0": torch.zeros(2, 16)})
    methods = [SimpleNamespace(name=n, artifact=p) for n, p in (("a", a), ("b", b), ("c", c))]
    cfg = SimpleNamespace(to_dict=lambda: {})
    eval_run._write_provenance(cfg, str(tmp_path), SimpleNamespace(model_id="tiny"), methods, {})
    arts = json.load(open(tmp_path / "config.json"))["artifacts"]
    assert arts["a"]["sha256_16"] != arts["b"]["sha256_16"]
    assert arts["a"]["id"] == arts["b"]["id"] != arts["c"]["id"]
