"""The method registry is the one list of methods: the command line, the calibration driver, the
presets, the evaluation and the artifact tests derive from it; a method registered here (a toy)
shows up everywhere without other edits. And the dependencies run one way:
rotations <- calibrate <- eval <- cli."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rotkv.cli import build_parser
from rotkv.config import PRESETS, ROTATIONS, SHARED_ARTIFACTS, CacheSpec, artifact_file, calibration_method
from rotkv.eval import peers
from rotkv.eval.config import EvalConfig, make_config
from rotkv.eval.methods import known_methods, resolve
from rotkv.rotations import registry
from rotkv.rotations.identity import random_orthogonal


def _choices(command: str, flag: str) -> list[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return list(next(a for a in sub._actions if flag in a.option_strings).choices)


def test_cli_choices_are_the_registry():
    # the oscar-mix preset's artifact (OSCAR plus per-layer key widths), oscar-mix-long's (keys refitted), and
    # oscar-aqua's (oscar-mix-long's plus inter-layer key maps)
    from rotkv.cli.calibrate import AQUA, MIX, MIX_LONG

    assert _choices("calibrate", "--method") == [*registry.calibrated(), MIX, MIX_LONG, AQUA]
    assert _choices("calibrate", "--base") == registry.bases()
    assert set(registry.rotation_fits()) <= set(registry.calibrated())


def test_presets_and_registry_agree():
    for name, spec in PRESETS.items():
        if spec.method is not None:
            assert spec.method in registry.METHODS, (name, spec.method)
            assert registry.get(spec.method).needs_calibration
    for m in registry.METHODS.values():
        if m.preset is not None:
            spec = PRESETS[m.preset]
            assert m.name in (spec.method, spec.rotation) or (m.widths and spec.start_bits), m.name
    # a data-free rotation is a CacheSpec rotation; "artifact" stands for every calibrated one
    assert list(ROTATIONS) == registry.data_free() + ["artifact"]


def test_eval_methods_are_the_presets_and_peers():
    assert known_methods() == list(PRESETS) + list(peers.PEERS)
    full = make_config("full").methods
    assert [m for m in full if m in PRESETS] == [n for n, s in PRESETS.items() if s.start_bits is None]
    for name, spec in PRESETS.items():
        if spec.needs_artifact:  # a calibrated preset reads its method's artifact (or its own, made from it)
            assert calibration_method(name) == spec.method
            assert artifact_file(name, base=True) == f"{spec.method}.safetensors"
            assert artifact_file(name) == f"{spec.artifact_kind}.safetensors"  # the kind it reads
            if spec.k_bits == "artifact":  # oscar-refine reads oscar-mix-long's artifact
                assert spec.artifact_kind == SHARED_ARTIFACTS.get(name, name)
    assert artifact_file("oscar-refine") == "oscar-mix-long.safetensors"


def test_build_rotations_dispatches_through_the_registry():
    for kind in registry.data_free():
        rots = registry.build_rotations(kind, 2, 3, 16, seed=1)
        assert len(rots) == 2
        for r in rots:
            if r.R_K is not None:
                torch.testing.assert_close(r.R_K[0].T @ r.R_K[0], torch.eye(16), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="`rotation` has to be one of"):
        registry.build_rotations("oscar", 2, 3, 16)


def _toy_fit(st, opts):
    h, d = st.cq.shape[0], opts.head_dim
    r = random_orthogonal(d, 7).expand(h, d, d).contiguous()
    return r, r, {}


@pytest.fixture
def toy(monkeypatch):
    """A method and its preset, registered the way a new one would be: one Method, one preset."""
    registry.register(registry.RotationMethod("toy", "a fixed random rotation (test)", fit=_toy_fit))
    monkeypatch.setitem(PRESETS, "toy-int2", CacheSpec(name="toy-int2", rotation="artifact", key_mean=True,
                                                       method="toy"))
    yield registry.get("toy")
    registry.unregister("toy")


class _ByteTok:
    def __call__(self, text, return_tensors=None):
        return SimpleNamespace(input_ids=torch.tensor([[b % 128 for b in text.encode()]]))


def test_a_registered_method_shows_up_everywhere(toy, tmp_path):
    from rotkv.calibrate.run import CalibConfig, calibrate
    from rotkv.hf.models import Loaded
    from rotkv.contract import validate_artifact
    from rotkv.rotations.artifact import load_artifact, save_artifact
    from rotkv_testing import make_tiny_llama

    assert "toy" in _choices("calibrate", "--method") and "toy" in registry.rotation_fits()
    assert "toy-int2" in known_methods() and "toy-int2" in make_config("full").methods
    EvalConfig(methods=["toy-int2"])  # accepted
    # the calibration driver fits it, with key means and clip ratios, into a sound artifact
    tiny = Loaded(make_tiny_llama(), _ByteTok(), "tiny")
    tensors, meta = calibrate(tiny, CalibConfig(method="toy", tokens=512, chunk_len=128, progress=False))
    path = tmp_path / artifact_file("toy-int2")
    save_artifact(str(path), tensors, meta)
    art = load_artifact(str(path))
    assert art.meta["method"] == "toy" and art.tensors["R_K.0"].shape == (1, 16, 16)
    torch.testing.assert_close(art.tensors["R_K.0"][0], random_orthogonal(16, 7))
    validate_artifact(art, tiny.model, PRESETS["toy-int2"])
    # the evaluation finds that artifact by the preset's method
    m, why = resolve("toy-int2", None, None, str(tmp_path))
    assert why is None and m.artifact == str(path)


def test_unknown_method_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match="unknown method 'nope'; registered: \\['identity'"):
        registry.get("nope")


ONE_WAY = """
import importlib, pkgutil, sys
import rotkv.{pkg} as pkg
for m in pkgutil.iter_modules(pkg.__path__):
    importlib.import_module("rotkv.{pkg}." + m.name)
{extra}
bad = sorted(n for n in sys.modules if n.split(".")[:2] in {forbidden})
print(bad)
sys.exit(1 if bad else 0)
"""


@pytest.mark.parametrize("pkg,forbidden,extra", [
    ("rotations", [["rotkv", "calibrate"], ["rotkv", "eval"], ["rotkv", "cli"]],
     "from rotkv.rotations import registry\n"
     "[m.fn(r) for m in registry.METHODS.values() for r in ('fit', 'build', 'refine')]"),
    ("calibrate", [["rotkv", "eval"], ["rotkv", "cli"]], ""),
])
def test_dependencies_run_one_way(pkg, forbidden, extra):
    """Importing every module of a package (and every registered function) loads none of the packages above it."""
    code = ONE_WAY.format(pkg=pkg, forbidden=forbidden, extra=extra)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_listing_the_methods_imports_no_torch():
    code = ("import sys; from rotkv.rotations import registry; from rotkv.cli import build_parser; build_parser(); "
            "print(registry.calibrated()); sys.exit('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
