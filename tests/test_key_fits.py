"""Several key-side fits in one artifact: ``rotkv calibrate --method oscar-mix-long --long-seq-len
4096,8192`` stores one R_K / key mean per calibration length, and a cache given its context length uses the
fit nearest it. The rule, the artifact format and its validation, the cache, the CLI and the eval pass-through,
on the tiny random Llama."""

import json

import pytest
import torch

from rotkv.cli import main
from rotkv.hf.models import Loaded
from rotkv.rotations.artifact import ArtifactMismatch, load_artifact, pick_key_fit, save_artifact
from rotkv.rotations.identity import random_orthogonal
from rotkv_testing import char_tokenizer, make_tiny_llama, write_artifact

K_BITS = torch.tensor([2, 4], dtype=torch.int32)


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama()


def fit_tensors(length: int, seed: int) -> dict[str, torch.Tensor]:
    """An extra key fit for the tiny Llama (2 layers, 2 KV heads, head_dim 16) under its ``@length`` names."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(2):
        out[f"R_K@{length}.{layer}"] = torch.stack([random_orthogonal(16, seed + 10 * layer + i) for i in range(2)])
        out[f"k_mean@{length}.{layer}"] = torch.randn(2, 16, generator=g)
    return out


def multi_fit(model, path, lengths=(4096, 8192), **meta) -> str:
    """An oscar-mix-long artifact whose primary key side is ``lengths[0]``'s, with a fit for every other length."""
    extra = {k: v for i, n in enumerate(lengths[1:]) for k, v in fit_tensors(n, 1000 + 100 * i).items()}
    return write_artifact(model, path, tensors=extra | {"k_bits": K_BITS},
                          key_fit_lengths=",".join(str(n) for n in lengths), **meta)


# ---- the rule -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("context,want", [(2048, 4096), (4096, 4096), (5792, 4096), (5793, 8192), (6144, 8192),
                                          (8192, 8192), (32768, 8192), (1, 4096)])
def test_the_fit_nearest_in_log_distance_is_picked(context, want):
    assert pick_key_fit([4096, 8192], context) == want
    assert pick_key_fit([8192, 4096], context) == want  # the order (which fit is primary) does not matter


def test_a_tie_goes_to_the_longer_fit_and_no_fits_to_the_primary():
    assert pick_key_fit([2048, 8192], 4096) == 8192  # 2x either way
    assert pick_key_fit([8192, 2048], 4096) == 8192
    assert pick_key_fit([2048, 4096, 8192], 4096) == 4096
    assert pick_key_fit([], 4096) is None
    for bad in (0, -5, 1.5, True, "4096"):
        with pytest.raises(ValueError, match="`context_length` has to be a positive int"):
            pick_key_fit([4096, 8192], bad)


# ---- the artifact -------------------------------------------------------------------------------------------------
def test_a_multi_fit_artifact_round_trips_and_swaps_its_primary(tiny, tmp_path):
    art = load_artifact(multi_fit(tiny, tmp_path / "m.safetensors", longfit_seq_len="4096"))
    assert art.key_fit_lengths == [4096, 8192] and "R_K@8192.1" in art.tensors
    saved = tmp_path / "again.safetensors"
    save_artifact(str(saved), art.tensors, art.meta)
    again = load_artifact(str(saved))
    assert again.key_fit_lengths == [4096, 8192] and set(again.tensors) == set(art.tensors)
    assert all(torch.equal(again.tensors[k], art.tensors[k]) for k in art.tensors)

    long = art.for_context(8192)
    assert long.key_fit_lengths == [8192, 4096] and long.meta["longfit_seq_len"] == "8192"
    for layer in range(2):
        for side in ("R_K", "k_mean"):
            assert torch.equal(long.tensors[f"{side}.{layer}"], art.tensors[f"{side}@8192.{layer}"])
            assert torch.equal(long.tensors[f"{side}@4096.{layer}"], art.tensors[f"{side}.{layer}"])
            assert f"{side}@8192.{layer}" not in long.tensors
        assert long.tensors[f"R_V.{layer}"] is art.tensors[f"R_V.{layer}"]  # the value side is shared
    assert all(long.tensors[k] is art.tensors[k] for k in ("clip_k", "clip_v", "k_bits"))
    assert long.for_context(6144) is long and art.for_context(2048) is art and art.for_context(None) is art
    assert long.for_context(2048).key_fit_lengths == [4096, 8192]  # back again
    save_artifact(str(saved), long.tensors, long.meta)  # the swapped artifact is a valid multi-fit one too
    assert load_artifact(str(saved)).key_fit_lengths == [8192, 4096]
    with pytest.raises(ValueError, match="no key fit for length 2048"):
        art.with_key_fit(2048)
    single = load_artifact(write_artifact(tiny, tmp_path / "s.safetensors"))
    assert single.key_fit_lengths == [] and single.for_context(8192) is single


def _malformed(tiny, tmp_path, change: dict, drop=(), **meta):
    t = fit_tensors(8192, 7) | {"k_bits": K_BITS}
    t = {k: v for k, v in (t | change).items() if k not in drop}
    return write_artifact(tiny, tmp_path / "bad.safetensors", tensors=t, **({"key_fit_lengths": "4096,8192"} | meta))


@pytest.mark.parametrize("change,drop,meta,match", [
    ({}, ["R_K@8192.1"], {}, "R_K@8192 is given for some layers but missing for layers [1]"),
    ({}, ["k_mean@8192.0", "k_mean@8192.1"], {}, "the key fit for length 8192 (key_fit_lengths) is incomplete: "
                                                 "k_mean is given but k_mean@8192 is missing"),
    ({"R_K@8192.0": torch.randn(2, 16, 8)}, [], {}, "'R_K@8192.0' has shape (2, 16, 8), expected (2, 16, 16)"),
    ({"k_mean@8192.1": torch.randn(2, 8)}, [], {}, "'k_mean@8192.1' has shape (2, 8), expected (2, 16)"),
    ({"R_K@8192.2": torch.eye(16)[None]}, [], {}, "'R_K@8192.2' names no layer of 2"),
    ({"R_K@2048.0": torch.eye(16)[None]}, [], {}, "'R_K@2048.0' is no extra key fit"),
    ({"R_V@8192.0": torch.eye(16)[None]}, [], {}, "'R_V@8192.0' is no extra key fit"),
    ({}, [], {"key_fit_lengths": "4096"}, "'R_K@8192.0' is no extra key fit"),
    ({}, [], {"key_fit_lengths": "4096,abc"}, "`key_fit_lengths` has to be a comma list of positive integers"),
    ({}, [], {"key_fit_lengths": "8192,8192"}, "`key_fit_lengths` names 8192 twice"),
    ({"R_K@8192.0": torch.randn(2, 16, 16)}, [], {}, "not orthogonal, worst R_K@8192.0"),
    ({"k_mean@8192.0": torch.full((2, 16), float("nan"))}, [], {}, "k_mean@8192.0 has 32 non-finite"),
])
def test_malformed_fits_are_refused_naming_the_tensor(tiny, tmp_path, change, drop, meta, match):
    path = _malformed(tiny, tmp_path, change, drop, **meta)
    with pytest.raises(ArtifactMismatch, match=match.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                       .replace("]", r"\]")):
        load_artifact(path)


def test_a_multi_fit_artifact_meets_the_preset_contract(tiny, tmp_path):
    from rotkv.config import get_preset
    from rotkv.contract import validate_artifact

    art = load_artifact(multi_fit(tiny, tmp_path / "m.safetensors"))
    validate_artifact(art, tiny, get_preset("oscar-mix-long"))
    validate_artifact(art.for_context(8192), tiny, get_preset("oscar-mix-long"))


# ---- the cache ------------------------------------------------------------------------------------------------
def _logits(model, cache, ids):
    with torch.no_grad():
        model(input_ids=ids[:, :40], past_key_values=cache)
        return model(input_ids=ids[:, 40:], past_key_values=cache).logits


def test_the_cache_rotates_keys_with_the_fit_picked_for_its_context_length(tiny, tmp_path):
    from rotkv.cache import RotkvCache, make_cache

    path = multi_fit(tiny, tmp_path / "m.safetensors")
    art = load_artifact(path)
    kw = dict(sink=4, window=8)
    default, short, long = (RotkvCache(tiny, "oscar-mix-long", path, context_length=n, **kw) for n in (None, 2048, 6144))
    assert (default.key_fit_length, short.key_fit_length, long.key_fit_length) == (4096, 4096, 8192)
    assert long.stats()["key_fit_length"] == 8192 and default.stats()["key_fit_length"] == 4096
    for layer in range(2):
        for cache, name in ((default, "{}.{}"), (short, "{}.{}"), (long, "{}@8192.{}")):
            rot = cache.layers[layer].rotation_cpu
            assert torch.equal(rot.R_K, art.tensors[name.format("R_K", layer)].expand(2, 16, 16))
            assert torch.equal(rot.k_mean, art.tensors[name.format("k_mean", layer)])
            assert torch.equal(rot.R_V, art.tensors[f"R_V.{layer}"])
    # the cache built from the multi-fit artifact at 6144 is the cache of an artifact holding only the 8K fit
    only8k = {k.replace("@8192", ""): v for k, v in art.tensors.items() if k.partition(".")[0] not in ("R_K", "k_mean")}
    save_artifact(str(tmp_path / "8k.safetensors"), only8k,  # one long refit: its length, no key_fit_lengths
                  {k: v for k, v in art.meta.items() if k != "key_fit_lengths"} | {"longfit_seq_len": "8192"})
    ids = torch.randint(4, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    want = _logits(tiny, RotkvCache(tiny, "oscar-mix-long", str(tmp_path / "8k.safetensors"), **kw), ids)
    assert torch.equal(_logits(tiny, make_cache(tiny, "oscar-mix-long", art, context_length=6144, **kw), ids), want)
    assert not torch.allclose(_logits(tiny, RotkvCache(tiny, "oscar-mix-long", path, **kw), ids), want)
    single = RotkvCache(tiny, "oscar-mix-long", write_artifact(tiny, tmp_path / "s.safetensors", tensors={"k_bits": K_BITS},
                                                               longfit_seq_len="4096"), context_length=8192, **kw)
    assert single.key_fit_length is None and single.stats()["key_fit_length"] is None
    assert RotkvCache(tiny, "int4", context_length=8192).key_fit_length is None
    with pytest.raises(ValueError, match="`context_length` has to be a positive int"):
        RotkvCache(tiny, "int4", context_length=0)


def test_the_eval_harness_and_generate_pass_the_context_length(tiny, tmp_path, monkeypatch, capsys):
    from rotkv.eval import nll
    from rotkv.eval.methods import Method

    seen = []

    class Spy(Method):
        def build(self, model, context_length=None):
            cache = super().build(model, context_length)
            seen.append((context_length, cache.key_fit_length))
            return cache

    path = multi_fit(tiny, tmp_path / "m.safetensors", lengths=(16, 64))
    ids = torch.randint(4, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = nll.reference(tiny, ids, 32, 8)
    nll.score_window(tiny, Spy("oscar-mix-long", "rotkv", 2.0, {"sink": 4, "window": 8}, path), ids, 32, 8, 16, ref)
    assert seen == [(40, 64)]

    monkeypatch.setattr("rotkv.hf.models.load_model", lambda *a, **k: Loaded(tiny, char_tokenizer(), "tiny"))
    for prompt, fit in (("hello there", 16), ("x" * 60, 64)):
        rc = main(["generate", "--preset", "oscar-mix-long", "--artifact", path, "--prompt", prompt, "--no-chat",
                   "--max-new-tokens", "3", "--sink", "4", "--window", "8", "--json"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert json.loads(out)["key_fit_length"] == fit


def test_the_lm_eval_adapter_builds_each_cache_for_its_request_length(tiny, tmp_path):
    from types import SimpleNamespace

    pytest.importorskip("lm_eval")
    from rotkv.integrations.lm_eval import RotkvLM

    path = multi_fit(tiny, tmp_path / "m.safetensors", lengths=(16, 64))
    lm = SimpleNamespace(model=tiny, preset="oscar-mix-long", artifact_path=path, overrides={"sink": 4, "window": 8})
    assert [RotkvLM.make_cache(lm, n).key_fit_length for n in (12, 60)] == [16, 64]


# ---- the command line -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,needle", [
    ("0", "--long-seq-len has to be a comma list of positive integers (e.g. 4096,8192) but got '0'"),
    ("abc", "--long-seq-len has to be a comma list of positive integers (e.g. 4096,8192) but got 'abc'"),
    ("4096,", "--long-seq-len has to be a comma list of positive integers"),
    ("256", "--long-seq-len has to be >= 512 (the refit's call size) but got 256"),
    ("4096,100", "--long-seq-len has to be >= 512 (the refit's call size) but got 100"),
    ("4096,4096", "--long-seq-len names 4096 twice"),
])
def test_calibrate_refuses_bad_length_lists_before_the_model(no_model, capsys, tmp_path, value, needle):
    rc = main(["calibrate", "--method", "oscar-mix-long", "--long-seq-len", value, "--out", str(tmp_path / "m.safetensors")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and needle in err, err


def test_calibrate_parses_one_length_or_a_list():
    from rotkv.cli.calibrate import parse_long_seq_len

    assert parse_long_seq_len("4096") == [4096]
    assert parse_long_seq_len("4096,8192") == [4096, 8192]
    assert parse_long_seq_len(" 8192, 4096 ") == [8192, 4096]  # the first is the primary, as given


def test_calibrate_writes_one_fit_per_length_equal_to_the_single_length_fits(tiny, tmp_path, monkeypatch, capsys):
    """The combined artifact's fits are, tensor for tensor, the artifacts of one length each; R_V, clips and key
    widths are the base's."""
    monkeypatch.setattr("rotkv.hf.models.load_model", lambda *a, **k: Loaded(tiny, char_tokenizer(), "tiny"))
    monkeypatch.setattr("rotkv.hf.models.peek_geometry", lambda model=None: (2, 2, 16))
    base = write_artifact(tiny, tmp_path / "base.safetensors", tensors={"k_bits": K_BITS}, sink="4", granularity="layer",
                          keybits_layers="1", keybits_seconds="1")  # what an oscar-mix artifact records
    out, printed = {}, {}
    for lengths in ("512,1024", "512", "1024"):
        out[lengths] = str(tmp_path / f"{lengths.replace(',', '-')}.safetensors")
        rc = main(["calibrate", "--method", "oscar-mix-long", "--long-seq-len", lengths, "--long-sequences", "1",
                   "--base-artifact", base, "--out", out[lengths]])
        printed[lengths], err = capsys.readouterr()
        assert rc == 0, err
    assert "key side refitted on 512,1024-token sequences" in printed["512,1024"]
    assert "key side refitted on 512-token sequences" in printed["512"]
    # the key widths are the base's: its measuring time (keybits_seconds 1) is not reported as this run's
    assert "4-bit keys in layers 1 (the base's)" in printed["512"] and "measured in" not in printed["512"]
    both, a512, a1024 = (load_artifact(out[k]) for k in ("512,1024", "512", "1024"))
    b = load_artifact(base)
    assert both.key_fit_lengths == [512, 1024] and both.meta["longfit_seq_len"] == "512"
    assert a512.key_fit_lengths == [] and "key_fit_lengths" not in a1024.meta and a1024.meta["longfit_seq_len"] == "1024"
    for layer in range(2):
        for side in ("R_K", "k_mean"):
            assert torch.equal(both.tensors[f"{side}.{layer}"], a512.tensors[f"{side}.{layer}"])
            assert torch.equal(both.tensors[f"{side}@1024.{layer}"], a1024.tensors[f"{side}.{layer}"])
        assert not torch.equal(a512.tensors[f"R_K.{layer}"], a1024.tensors[f"R_K.{layer}"])
        assert torch.equal(both.tensors[f"R_V.{layer}"], b.tensors[f"R_V.{layer}"])
    for k in ("clip_k", "clip_v", "k_bits"):
        assert torch.equal(both.tensors[k], b.tensors[k])
    # refitting a multi-fit artifact replaces its key side whole: no stale extra fits
    rc = main(["calibrate", "--method", "oscar-mix-long", "--long-seq-len", "1024", "--long-sequences", "1",
               "--base-artifact", out["512,1024"], "--out", str(tmp_path / "again.safetensors")])
    assert rc == 0, capsys.readouterr().err
    again = load_artifact(str(tmp_path / "again.safetensors"))
    assert again.key_fit_lengths == [] and not any("@" in k for k in again.tensors)
    # each says what it is and what it was made from
    assert (both.kind, both.meta["base_artifact"]) == ("oscar-mix-long", f"oscar-mix {b.identity}")
    assert (again.kind, again.meta["base_artifact"]) == ("oscar-mix-long", f"oscar-mix-long {both.identity}")
