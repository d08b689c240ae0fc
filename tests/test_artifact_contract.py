"""The artifact contract (method, bits, group size), the format version, refusing malformed or unsound
files, the clip re-fit (the deliberate override) and CacheSpec's own checks. Tiny random models only."""

from types import SimpleNamespace

import pytest
import torch

from rotkv.config import PRESETS, CacheSpec, get_preset
from rotkv.rotations import registry
from rotkv.contract import check_contract, validate_artifact
from rotkv.rotations.artifact import ArtifactMismatch, load_artifact, save_artifact
from rotkv_testing import make_tiny_llama, write_artifact


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama()


# ---- presets and artifacts -----------------------------------------------------------------------
def test_oscar_and_optr_presets_differ_in_method():
    assert PRESETS["oscar-int2"].method == "oscar" and PRESETS["optr-int2"].method == "optr"
    assert PRESETS["oscar-int2"] != PRESETS["optr-int2"]


@pytest.mark.parametrize("preset,method", [(p, m) for p, spec in PRESETS.items() if spec.method
                                           for m in registry.rotation_fits() if m != spec.method])
def test_each_preset_refuses_the_other_methods_artifact(model, tmp_path, preset, method):
    art = load_artifact(write_artifact(model, tmp_path / "a.safetensors", method=method))
    with pytest.raises(ArtifactMismatch, match=f"is an? {method} artifact .*preset '{preset}' reads") as e:
        validate_artifact(art, model, PRESETS[preset])
    assert str(tmp_path / "a.safetensors") in str(e.value) and "rotkv calibrate --method" in str(e.value)
    validate_artifact(art, model)  # without a spec (rotkv/cache/progressive.py): geometry and fingerprint only
    custom = get_preset(preset, artifact_kind=None)  # a spec without a kind compares the method
    with pytest.raises(ArtifactMismatch, match=f"method: artifact '{method}' vs preset '{custom.method}'"):
        check_contract(art, custom)


def test_own_method_and_pmkvq_extension_are_accepted(model, tmp_path):
    validate_artifact(load_artifact(write_artifact(model, tmp_path / "a.safetensors")), model, PRESETS["oscar-int2"])
    optr = load_artifact(write_artifact(model, tmp_path / "b.safetensors", method="optr"))
    validate_artifact(optr, model, PRESETS["optr-int2"])
    pm = load_artifact(write_artifact(model, tmp_path / "c.safetensors", method="oscar+pmkvq",
                                      tensors={"bits": torch.tensor([4, 2], dtype=torch.int32)}))
    validate_artifact(pm, model, PRESETS["oscar-pmkvq"])
    validate_artifact(pm, model, PRESETS["oscar-int2"])  # the same rotations, the widths unread
    # artifact_kind=None and method=None is the Python override: any artifact
    validate_artifact(optr, model, get_preset("oscar-int2", method=None, artifact_kind=None))


# ---- what an artifact is, and which presets read it -------------------------------------------------------------
# every preset that reads an artifact, and the kinds it takes: written out here, so that a new preset or kind has
# to say where it stands
READS = {
    "oscar-int2": {"oscar", "oscar-mix", "oscar+pmkvq"},  # the same OSCAR rotations; the added widths unread
    "optr-int2": {"optr"},
    "oscar-mix": {"oscar-mix"},
    "oscar-mix-long": {"oscar-mix-long", "oscar-mix-long+aqua"},  # the maps unread
    "oscar-refine": {"oscar-mix-long", "oscar-mix-long+aqua"},
    "oscar-aqua": {"oscar-mix-long+aqua"},
    "pmkvq": {"pmkvq"},
    "oscar-pmkvq": {"oscar+pmkvq"},
}
WIDTHS = {"k_bits": torch.tensor([4, 2], dtype=torch.int32), "k_gain": torch.tensor([0.1, 0.0])}
KINDS = {  # kind -> what write_artifact needs to make one (the old-file inference reads the same)
    "oscar": {}, "optr": {"method": "optr"}, "hadamard": {"method": "hadamard"},
    "oscar-mix": {"tensors": WIDTHS},
    "oscar-mix-long": {"tensors": WIDTHS, "longfit_seq_len": "4096"},
    "oscar-long": {"longfit_seq_len": "4096"},
    "oscar-mix-long+aqua": {"tensors": WIDTHS | {"aqua_map.1": torch.zeros(33, 32, dtype=torch.float16)},
                            "longfit_seq_len": "4096"},
    "pmkvq": {"method": "pmkvq", "tensors": {"bits": torch.tensor([4, 2], dtype=torch.int32)}},
    "oscar+pmkvq": {"method": "oscar+pmkvq", "tensors": {"bits": torch.tensor([4, 2], dtype=torch.int32)}},
}


def test_every_preset_that_reads_an_artifact_names_its_kind():
    reading = {n for n, s in PRESETS.items() if s.needs_artifact or s.budget_tokens is not None}
    assert set(READS) == reading and all(PRESETS[n].artifact_kind for n in reading)
    assert all(PRESETS[n].artifact_kind in kinds for n, kinds in READS.items())


def _made(model, folder, kind, old):
    from rotkv.contract import kind_meta

    kw = dict(KINDS[kind])
    if not old:
        kw |= kind_meta(kind)
    return load_artifact(write_artifact(model, folder / f"{kind}-{old}.safetensors", **kw))


@pytest.mark.parametrize("old", [False, True], ids=["recorded", "inferred"])
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("preset", list(READS))
def test_an_artifact_is_read_only_by_the_presets_it_was_made_for(model, tmp_path, preset, kind, old):
    art = _made(model, tmp_path, kind, old)
    assert art.kind == kind and art.kind_inferred == old
    spec = get_preset(preset, group_size=16)
    if kind in READS[preset]:
        validate_artifact(art, model, spec)
        return
    with pytest.raises(ArtifactMismatch) as e:
        validate_artifact(art, model, spec)
    msg = str(e.value)
    need = PRESETS[preset].artifact_kind
    assert len(msg.splitlines()) == 1 and f"artifact {art.path} is a" in msg and f" {kind} artifact" in msg
    assert f"preset '{preset}' reads a" in msg and f" {need} artifact" in msg and "rotkv calibrate --method" in msg
    assert ". ." not in msg and not msg.endswith(".")


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_artifact_records_the_presets_it_serves(model, tmp_path, kind):
    from rotkv.contract import presets_served

    art = _made(model, tmp_path, kind, old=False)
    assert art.presets == presets_served(kind) == [p for p in READS if kind in READS[p]
                                                    and PRESETS[p].artifact_kind == kind] + \
        [p for p in READS if kind in READS[p] and PRESETS[p].artifact_kind != kind]


def test_old_files_infer_their_kind_from_what_they_hold(model, tmp_path):
    """An artifact from before ``kind`` was recorded: the key widths make it oscar-mix, a long refit of those
    oscar-mix-long, a several-fit refit too (key_fit_lengths), and otherwise its method; inspect says so."""
    from rotkv.rotations.artifact import infer_kind

    assert infer_kind(WIDTHS, {"method": "oscar", "key_fit_lengths": "4096,8192"}) == "oscar-mix-long"
    assert infer_kind(WIDTHS, {"method": "oscar+pmkvq"}) == "oscar-mix"
    assert infer_kind({}, {"method": "optr"}) == "optr"
    art = _made(model, tmp_path, "oscar-mix", old=True)
    assert "kind inferred" in art.describe() and "kind: " not in art.summary()
    # a field a method leaves empty (OptR's `base` in an OSCAR file) is not printed as an empty line
    empty = load_artifact(write_artifact(model, tmp_path / "e.safetensors", base="", cs=""))
    assert "  base:" not in empty.summary() and "  cs:" not in empty.summary()


def test_the_base_artifact_is_named_by_its_identity(model, tmp_path):
    from rotkv.contract import kind_meta

    base = _made(model, tmp_path, "oscar", old=False)
    save_artifact(str(tmp_path / "copy.safetensors"), base.tensors, base.meta | {"model_id": "other"})
    copy = load_artifact(str(tmp_path / "copy.safetensors"))  # the same tensors, other metadata
    assert copy.identity == base.identity and len(base.identity) == 16
    assert kind_meta("oscar-mix", base)["base_artifact"] == f"oscar {base.identity}"
    other = _made(model, tmp_path, "oscar-mix", old=False)
    assert other.identity != base.identity


@pytest.mark.parametrize("field,art_kw,spec_kw,want", [
    ("bits", {"bits": 4}, {}, "bits: artifact 4 vs preset 2"),
    ("bits", {}, {"bits": 8}, "bits: artifact 2 vs preset 8"),
    ("group_size", {"group_size": 8}, {}, "group_size: artifact 8 vs preset 16"),  # preset 64 -> head_dim 16
    ("group_size", {}, {"group_size": 4}, "group_size: artifact 16 vs preset 4"),
])
def test_bits_and_group_size_mismatch_names_field_and_values(model, tmp_path, field, art_kw, spec_kw, want):
    art = load_artifact(write_artifact(model, tmp_path / "a.safetensors", **art_kw))
    spec = get_preset("oscar-int2", **spec_kw)
    with pytest.raises(ArtifactMismatch, match=want) as e:
        validate_artifact(art, model, spec)
    assert "--refit-clip" in str(e.value)
    with pytest.raises(ArtifactMismatch, match=want):
        check_contract(art, spec)  # the same check without the model (the CLI runs it before loading)


def test_contract_skips_what_does_not_apply(model, tmp_path):
    art = load_artifact(write_artifact(model, tmp_path / "a.safetensors", bits=4, group_size=8))
    check_contract(art, get_preset("oscar-int2", bits=None))  # unquantized: clips are unused
    widths = load_artifact(write_artifact(model, tmp_path / "w.safetensors", bits=2, method="oscar+pmkvq",
                                          tensors={"bits": torch.tensor([4, 2], dtype=torch.int32)}))
    check_contract(widths, get_preset("oscar-pmkvq", bits=4))  # progressive widths come from the artifact
    unrecorded = load_artifact(write_artifact(model, tmp_path / "u.safetensors", drop=("bits", "group_size")))
    check_contract(unrecorded, get_preset("oscar-int2", bits=8))


# ---- format version and malformed files ------------------------------------------------------------
def test_artifact_without_format_version_loads_as_version_1(model, tmp_path):
    path = write_artifact(model, tmp_path / "old.safetensors", drop=("format_version",))
    assert load_artifact(path).meta["format_version"] == "1"


@pytest.mark.parametrize("version,match", [("2", "newer rotkv.*upgrade"), ("x", "format_version.*integer"),
                                           ("0", "reads versions 1 to 1")])
def test_unreadable_format_version_is_refused_with_a_reason(model, tmp_path, version, match):
    path = write_artifact(model, tmp_path / "v.safetensors", format_version=version)
    with pytest.raises(ArtifactMismatch, match=match):
        load_artifact(path)


def test_truncated_file_and_directory_are_refused(model, tmp_path):
    path = write_artifact(model, tmp_path / "a.safetensors")
    data = open(path, "rb").read()
    for n in (0, 7, 100, len(data) // 2, len(data) - 1):
        with open(tmp_path / "t.safetensors", "wb") as f:
            f.write(data[:n])
        with pytest.raises(ArtifactMismatch, match="cannot read artifact"):
            load_artifact(str(tmp_path / "t.safetensors"))
    with pytest.raises(ArtifactMismatch, match="is a directory"):
        load_artifact(str(tmp_path))


@pytest.mark.parametrize("tensors,match", [
    ({"R_K.0": torch.eye(8).expand(2, 8, 8).contiguous()}, r"'R_K.0' has shape \(2, 8, 8\)"),
    ({"k_mean.1": torch.zeros(3, 16)}, r"'k_mean.1' has shape"),
    ({"R_K.5": torch.eye(16)[None]}, "names no layer"),
    ({"clip_k": torch.ones(3)}, r"'clip_k' has shape \(3,\)"),
    ({"R_V.0": torch.eye(16, dtype=torch.int32)[None].expand(2, 16, 16).contiguous()}, "dtype"),
    ({"bits": torch.tensor([2.0, 4.0])}, "'bits' has dtype"),
])
def test_shapes_and_dtypes_that_do_not_fit_are_refused(model, tmp_path, tensors, match):
    path = write_artifact(model, tmp_path / "a.safetensors", tensors=tensors)
    with pytest.raises(ArtifactMismatch, match=match):
        load_artifact(path)


def test_huge_declared_geometry_and_missing_layers_are_refused(model, tmp_path):
    with pytest.raises(ArtifactMismatch, match="num_layers"):
        load_artifact(write_artifact(model, tmp_path / "h.safetensors", num_layers=10**12))
    path = write_artifact(model, tmp_path / "m.safetensors")
    art = load_artifact(path)
    t = dict(art.tensors)
    del t["R_K.1"]
    save_artifact(str(tmp_path / "n.safetensors"), t, art.meta)
    with pytest.raises(ArtifactMismatch, match=r"R_K is given for some layers but missing for layers \[1\]"):
        load_artifact(str(tmp_path / "n.safetensors"))


@pytest.mark.parametrize("bad,match", [
    ({"R_K.1": torch.full((2, 16, 16), float("nan"))}, "R_K.1 has 512 non-finite"),
    ({"k_mean.0": torch.tensor([[float("inf")] * 16] * 2)}, "k_mean.0 has 32 non-finite"),
    ({"R_V.0": 1.5 * torch.eye(16).expand(2, 16, 16).contiguous()}, "not orthogonal, worst R_V.0"),
    ({"clip_v": torch.tensor([0.9, 1.2])}, "clip_v has ratios outside"),
])
def test_unsound_values_do_not_load_silently(model, tmp_path, bad, match):
    path = write_artifact(model, tmp_path / "a.safetensors", tensors=bad)
    with pytest.raises(ArtifactMismatch, match=match):
        load_artifact(path)
    load_artifact(path, check=False)  # what `rotkv inspect --check` reads to report every problem


# ---- the override: re-fit the clip ratios -----------------------------------------------------------
class ByteTokenizer:
    def __call__(self, text, return_tensors=None):
        return SimpleNamespace(input_ids=torch.tensor([[b % 128 for b in text.encode()]]))


def test_refit_clip_keeps_rotations_and_meets_the_new_contract(model, tmp_path):
    from rotkv.calibrate.refit import refit_clips
    from rotkv.hf.models import Loaded

    art = load_artifact(write_artifact(model, tmp_path / "a.safetensors", bits=2, group_size=16))
    loaded = Loaded(model, ByteTokenizer(), "tiny")
    tensors, meta = refit_clips(loaded, art, bits=4, group_size=8, tokens=256, chunk_len=128, progress=False)
    save_artifact(str(tmp_path / "b.safetensors"), tensors, meta)
    new = load_artifact(str(tmp_path / "b.safetensors"))
    assert new.meta["bits"] == "4" and new.meta["group_size"] == "8" and "a.safetensors" in new.meta["refit_from"]
    for name in ("R_K.0", "R_V.1", "k_mean.0"):
        assert torch.equal(new.tensors[name], art.tensors[name])
    assert new.tensors["clip_k"].shape == (2,) and ((new.tensors["clip_k"] > 0.8) & (new.tensors["clip_k"] <= 1)).all()
    spec = get_preset("oscar-int2", bits=4, group_size=8)
    validate_artifact(new, model, spec)
    with pytest.raises(ArtifactMismatch, match="bits: artifact 2 vs preset 4"):
        validate_artifact(art, model, spec)


def test_refit_clip_refuses_folded_and_width_artifacts(model, tmp_path):
    from rotkv.calibrate.refit import check_refittable

    widths = load_artifact(write_artifact(model, tmp_path / "w.safetensors",
                                          tensors={"bits": torch.tensor([4, 2], dtype=torch.int32)}))
    with pytest.raises(ValueError, match="per-layer widths"):
        check_refittable(widths)
    folded = load_artifact(write_artifact(model, tmp_path / "f.safetensors", values_folded="1"))
    with pytest.raises(ValueError, match="folded"):
        check_refittable(folded)


# ---- CacheSpec: types and None ------------------------------------------------------------------------
@pytest.mark.parametrize("field,value", [("sink", "16"), ("window", 8.0), ("bits", "2"), ("clip_k", True),
                                         ("rotate_values", 1), ("rotation", None), ("method", 3)])
def test_spec_types_are_checked_naming_the_field(field, value):
    with pytest.raises(TypeError, match=f"`{field}` has to be"):
        CacheSpec(**{field: value})


def test_none_is_meaningful_for_nullable_fields(model):
    from rotkv.cache import RotkvCache

    assert get_preset("quarot-int2", bits=None).bits is None
    assert get_preset("quarot-int2", group_size=None).group_size is None
    assert get_preset("quarot-int2", sink=None).sink == PRESETS["quarot-int2"].sink  # not nullable: not given
    cache = RotkvCache(model, "quarot-int2", bits=None, sink=2, window=2)
    assert not cache.spec.quantized
    with torch.no_grad():
        model(torch.randint(1, 128, (1, 24)), past_key_values=cache)
    assert cache.stats()["bits_per_element"] == 16.0
    with pytest.raises(ValueError, match="unknown CacheSpec field"):
        get_preset("quarot-int2", sinks=4)


def test_group_size_error_lists_every_divisor():
    from rotkv.quant.quantizer import check_group

    with pytest.raises(ValueError, match=r"allowed: \[1, 2, 4, 8, 16, 32, 64\]"):
        check_group(12, 64)
    check_group(16, 64)


def test_calibration_refuses_too_few_tokens_for_its_held_out_chunks():
    from rotkv.calibrate.run import CalibConfig

    with pytest.raises(ValueError, match=r"`tokens` has to be >= 1536 .* but got 256"):
        CalibConfig(method="oscar", tokens=256)
    cfg = CalibConfig(method="oscar", tokens=256, search_clips=False)
    assert cfg.rounded_tokens == 512
    with pytest.raises(ValueError, match="OptR early stopping"):
        CalibConfig(method="optr", tokens=1000, search_clips=False)


def test_the_artifact_format_imports_neither_the_model_side_nor_the_presets():
    """rotkv/rotations/artifact.py reads and writes the format: the model comes in as its geometry and
    fingerprint, the contract lives beside CacheSpec (rotkv/contract.py)."""
    import ast

    import rotkv.rotations.artifact as mod

    tree = ast.parse(open(mod.__file__).read())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in imported if m and (m.startswith("rotkv.hf") or m == "rotkv.config")], imported
