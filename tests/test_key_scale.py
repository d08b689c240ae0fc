"""The key scaling in the query eigenbasis (an artifact's ``k_scale``, rotkv.rotations.keyscale): the fit, the
exactness of keys ``(k - mu) S R_K`` read by queries ``q S^-T R_K`` through the cache, the artifact format, the
refit that writes it (``rotkv calibrate --method oscar-mix-long --key-scale ALPHA``) and what refuses it."""

import pytest
import torch

from rotkv.cache import RotkvCache
from rotkv.cli import main
from rotkv.config import CacheSpec
from rotkv.hf.compat import cache_kwarg
from rotkv.rotations.artifact import ArtifactMismatch, load_artifact
from rotkv.rotations.base import LayerRotation, bf16x2_matrix
from rotkv.rotations.keyscale import key_scale, scaled_pair
from rotkv.rotations.identity import random_orthogonal
from rotkv_testing import char_tokenizer, make_tiny_llama, write_artifact


def spd(d: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    """A random symmetric positive definite ``[1, d, d]`` with eigenvalues spread over ``spread`` decades."""
    u = random_orthogonal(d, seed).double()
    e = torch.logspace(0, spread, d, dtype=torch.float64)[torch.randperm(d, generator=torch.Generator().manual_seed(seed))]
    return (u @ torch.diag(e) @ u.T)[None]


def scaled_artifact(model, path, alpha=1.0, **extra):
    """A tiny-Llama artifact with a ``k_scale`` per layer from random covariances."""
    t = {f"k_scale.{l}": key_scale(spd(16, 10 + l), spd(16, 20 + l), alpha).expand(2, 16, 16).contiguous() for l in range(2)}
    return write_artifact(model, path, tensors=t | extra.pop("tensors", {}), **extra)


def test_alpha_zero_is_the_identity_and_one_follows_the_closed_form():
    cq, ck = spd(16, 1), spd(16, 2)
    assert torch.allclose(key_scale(cq, ck, 0.0), torch.eye(16)[None], atol=1e-6)
    # diagonal covariances: U = I, so S = diag(a) with a^2 ~ sqrt(lambda / kappa), mean(a^2) = 1
    lam, kap = torch.tensor([4.0, 1.0, 9.0, 0.25]), torch.tensor([1.0, 4.0, 1.0, 1.0])
    s = key_scale(torch.diag(lam)[None], torch.diag(kap)[None], 1.0)[0]
    a2 = (lam / kap).sqrt()
    a2 = a2 / a2.mean()
    assert torch.allclose(s, torch.diag(a2.sqrt()), atol=1e-6)
    for alpha in (0.25, 0.5, 1.0):
        s = key_scale(cq, ck, alpha)[0].double()
        assert torch.allclose(s, s.T, atol=1e-6) and torch.linalg.eigvalsh(s).min() > 0
        assert torch.trace(s @ s).item() / 16 == pytest.approx(1.0, rel=1e-5)


def test_the_scaling_lowers_the_error_model_it_minimizes():
    """(key spread) x (query-weighted step) = tr(S C_K S) tr(S^-1 C_Q S^-1): alpha = 1 is its minimum over
    scalings in C_Q's eigenbasis, so below OSCAR's (alpha = 0) and below a half step."""
    cq, ck = spd(16, 3), spd(16, 4)

    def cost(s):
        s, si = s[0].double(), torch.linalg.inv(s[0].double())
        return (torch.trace(s @ ck[0] @ s) * torch.trace(si @ cq[0] @ si)).item()

    c0, c5, c1 = (cost(key_scale(cq, ck, a)) for a in (0.0, 0.5, 1.0))
    assert c1 < c5 < c0


def test_bad_alpha_and_shapes_are_refused():
    with pytest.raises(ValueError, match=r"`key_scale` \(alpha\) has to be in \[0, 1\]"):
        key_scale(spd(8, 0), spd(8, 1), 1.5)
    with pytest.raises(ValueError, match="alike"):
        key_scale(spd(8, 0), spd(4, 1), 0.5)


def test_scaled_pair_keeps_every_score():
    r = torch.stack([random_orthogonal(16, i) for i in range(2)])
    s = key_scale(spd(16, 5), spd(16, 6), 1.0)
    keys, queries = scaled_pair(r, s)
    assert torch.allclose(keys @ queries.transpose(-1, -2), torch.eye(16).expand(2, 16, 16), atol=1e-5)
    rot = LayerRotation(R_K=keys, k_mean=torch.randn(2, 16), R_Q=queries)
    q, k = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 7, 16)
    want = q @ (k - rot.k_mean[None, :, None]).repeat_interleave(2, 1).transpose(-1, -2)
    got = rot.queries(q) @ rot.keys(k).repeat_interleave(2, 1).transpose(-1, -2)
    assert torch.allclose(got, want, atol=1e-4)
    # the GPU's split-bf16 matrices take the queries' own matrix
    assert torch.equal(rot._bf16x2("queries")[0], bf16x2_matrix(queries))
    assert torch.equal(rot._bf16x2("keys")[0], bf16x2_matrix(keys, rot.k_mean))
    assert rot.nbytes == (keys.numel() + queries.numel() + rot.k_mean.numel()) * 4
    # read with the keys' own matrix, the scores are wrong: the queries' matrix is what keeps them
    wrong = LayerRotation(R_K=keys, k_mean=rot.k_mean)
    assert not torch.allclose(wrong.queries(q) @ rot.keys(k).repeat_interleave(2, 1).transpose(-1, -2), want, atol=1e-2)


def test_the_cache_is_exact_with_a_key_scaling_in_fp32(tmp_path):
    """Keys stored ``(k - mu) S R_K`` in the tiers, read by ``q S^-T R_K``: the plain model's logits, in prefill
    and decode, and different from reading them with ``q R_K`` (the scaling is really there)."""
    model = make_tiny_llama()
    path = scaled_artifact(model, tmp_path / "s.safetensors")
    art = load_artifact(path)
    rot = art.layer_rotation(0)
    assert rot.R_Q is not None and not torch.allclose(rot.R_K, art.tensors["R_K.0"])
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    spec = CacheSpec(bits=None, rotation="artifact", key_mean=True, tier_dtype="float32", prefill_chunk=16)
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        cache = RotkvCache(model, spec, path)
        out = model(input_ids=ids[:, :30], **{cache_kwarg(model): cache}).logits
        step = model(input_ids=ids[:, 30:], **{cache_kwarg(model): cache}).logits
    assert torch.allclose(out, ref[:, :30], atol=1e-4, rtol=1e-4)
    assert torch.allclose(step, ref[:, 30:], atol=1e-4, rtol=1e-4)


def test_quantized_presets_run_with_a_key_scaling(tmp_path):
    model = make_tiny_llama()
    path = scaled_artifact(model, tmp_path / "s.safetensors", tensors={"k_bits": torch.tensor([2, 4], dtype=torch.int32)},
                           longfit_seq_len="4096")
    ids = torch.randint(4, 128, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        plain = model(input_ids=ids, **{cache_kwarg(model): RotkvCache(
            model, "oscar-refine", write_artifact(model, tmp_path / "p.safetensors",
                                                  tensors={"k_bits": torch.tensor([2, 4], dtype=torch.int32)},
                                                  longfit_seq_len="4096"), sink=4, window=8)}).logits
        scaled = model(input_ids=ids, **{cache_kwarg(model): RotkvCache(model, "oscar-refine", path, sink=4, window=8)}).logits
    assert torch.isfinite(scaled).all() and not torch.allclose(scaled, plain)
    assert (scaled - ref).abs().mean() < 10 * (plain - ref).abs().mean() + 1e-3


@pytest.mark.parametrize("name, shape, match", [
    ("k_scale.0", (2, 16), "has shape"),
    ("k_scale.5", (2, 16, 16), "names no layer"),
])
def test_malformed_key_scalings_are_refused(tmp_path, name, shape, match):
    model = make_tiny_llama()
    path = write_artifact(model, tmp_path / "a.safetensors", tensors={name: torch.ones(shape)})
    with pytest.raises(ArtifactMismatch, match=match):
        load_artifact(path)


def test_a_scaling_given_for_some_layers_only_is_refused(tmp_path):
    model = make_tiny_llama()
    path = write_artifact(model, tmp_path / "a.safetensors", tensors={"k_scale.0": torch.eye(16)[None]})
    with pytest.raises(ArtifactMismatch, match="k_scale is given for some layers but missing for layers"):
        load_artifact(path)


def test_an_extra_key_fit_carries_its_own_scaling(tmp_path):
    model = make_tiny_llama()
    extra = {}
    for l in range(2):
        extra[f"R_K@8192.{l}"] = torch.stack([random_orthogonal(16, 50 + l + i) for i in range(2)])
        extra[f"k_mean@8192.{l}"] = torch.randn(2, 16)
        extra[f"k_scale@8192.{l}"] = key_scale(spd(16, 60 + l), spd(16, 70 + l), 0.5)
    path = scaled_artifact(model, tmp_path / "m.safetensors", tensors=extra, key_fit_lengths="4096,8192")
    art = load_artifact(path)
    long = art.for_context(8192)
    assert torch.equal(long.tensors["k_scale.1"], extra["k_scale@8192.1"])
    assert torch.equal(long.tensors["k_scale@4096.1"], art.tensors["k_scale.1"])
    no_scale = {k: v for k, v in extra.items() if not k.startswith("k_scale")}
    bad = scaled_artifact(model, tmp_path / "b.safetensors", tensors=no_scale, key_fit_lengths="4096,8192")
    with pytest.raises(ArtifactMismatch, match="k_scale is given but k_scale@8192 is missing"):
        load_artifact(bad)


def test_the_refit_writes_the_scaling_of_its_own_statistics(tmp_path):
    """``refit(key_scale=alpha)``: k_scale is key_scale() of the pooled query covariance and the pooled
    covariance of the centred keys past the sink, as a direct capture computes them; R_K and the key mean are
    those of the refit without it, and a refit without it drops a base's k_scale."""
    from rotkv.calibrate.capture import capturing
    from rotkv.calibrate.longfit import refit

    model, tok = make_tiny_llama(), char_tokenizer()
    path = write_artifact(model, tmp_path / "a.safetensors", tensors={"k_bits": torch.tensor([2, 4], dtype=torch.int32)},
                          sink="4", granularity="layer")
    art = load_artifact(path)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    plain, _ = refit(model, tok, art, seq_len=96, sequences=2, call=32, files=[str(text)])
    tensors, meta = refit(model, tok, art, seq_len=96, sequences=2, call=32, files=[str(text)], key_scale=0.5)
    assert meta["key_scale"] == "0.5" and "k_scale.0" not in plain
    chunks = [tok(text.read_text(), return_tensors="pt").input_ids[:, i * 96:(i + 1) * 96] for i in range(2)]
    cq, kk, ks, kn = {}, {}, {}, {}

    def rec(layer, q, k, v, out, probs):
        g = q[0].double().reshape(2, -1, 16)
        k0 = k[0, :, 4:].double()
        cq[layer] = cq.get(layer, 0) + torch.einsum("htd,hte->hde", g, g)
        kk[layer] = kk.get(layer, 0) + torch.einsum("htd,hte->hde", k0, k0)
        ks[layer] = ks.get(layer, 0) + k0.sum(1)
        kn[layer] = kn.get(layer, 0) + k0.shape[1]

    with torch.no_grad(), capturing(model, rec):
        for c in chunks:
            model(c, use_cache=False)
    for layer in range(2):
        assert torch.equal(tensors[f"R_K.{layer}"], plain[f"R_K.{layer}"])
        mu = ks[layer] / kn[layer]
        ck = (kk[layer] / kn[layer] - torch.einsum("hd,he->hde", mu, mu)).sum(0, keepdim=True)
        want = key_scale(cq[layer].sum(0, keepdim=True), ck, 0.5)  # "layer" granularity: one for both heads
        assert tensors[f"k_scale.{layer}"].shape == art.tensors[f"R_K.{layer}"].shape
        assert torch.allclose(tensors[f"k_scale.{layer}"], want.expand(2, 16, 16), atol=1e-4)
    from rotkv.rotations.artifact import Artifact

    again, meta2 = refit(model, tok, Artifact(tensors, meta), seq_len=96, sequences=2, call=32, files=[str(text)])
    assert not any(k.startswith("k_scale") for k in again) and "key_scale" not in meta2


@pytest.mark.parametrize("argv, needle", [
    (["--method", "oscar-mix-long", "--key-scale", "1.5"], "--key-scale is an exponent in [0, 1] for --method oscar-mix-long but got 1.5"),
    (["--method", "oscar-mix", "--key-scale", "0.5"], "--key-scale is an exponent in [0, 1] for --method oscar-mix-long but got 0.5 with --method oscar-mix"),
])
def test_calibrate_refuses_a_bad_key_scale_before_the_model(no_model, capsys, tmp_path, argv, needle):
    rc = main(["calibrate", *argv, "--out", str(tmp_path / "m.safetensors")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and needle in err, err


def test_the_oscar_export_refuses_a_key_scaling(tmp_path):
    from rotkv.integrations.oscar_export import oscar_states

    art = load_artifact(scaled_artifact(make_tiny_llama(), tmp_path / "s.safetensors"))
    with pytest.raises(ValueError, match="has a key scaling"):
        oscar_states(art)


def test_the_queries_matrix_survives_sharding_and_dropping_the_mean(tmp_path):
    """vLLM's tensor-parallel shard and a preset without key means rebuild the rotation: R_Q goes along."""
    import dataclasses

    from rotkv.integrations.vllm.tp import shard_rotation

    rot = load_artifact(scaled_artifact(make_tiny_llama(), tmp_path / "s.safetensors")).layer_rotation(1)
    part = shard_rotation(rot, total_kv_heads=2, tp_size=2, tp_rank=1)
    assert torch.equal(part.R_Q, rot.R_Q[1:2]) and torch.equal(part.R_K, rot.R_K[1:2])
    plain = dataclasses.replace(rot, k_mean=None)  # what rotkv.cache.assembly does for key_mean=False
    assert torch.equal(plain.R_Q, rot.R_Q) and plain.k_mean is None


def test_calibrate_writes_the_scaling_with_the_key_side(tmp_path, monkeypatch, capsys):
    """``rotkv calibrate --method oscar-mix-long --key-scale 0.5``: the refit's R_K and key means, plus k_scale and
    its exponent in the metadata; a cache built from the file reads it."""
    from rotkv.hf.models import Loaded

    model = make_tiny_llama()
    monkeypatch.setattr("rotkv.hf.models.load_model", lambda *a, **k: Loaded(model, char_tokenizer(), "tiny"))
    monkeypatch.setattr("rotkv.hf.models.peek_geometry", lambda model=None: (2, 2, 16))
    base = write_artifact(model, tmp_path / "base.safetensors", tensors={"k_bits": torch.tensor([2, 4], dtype=torch.int32)},
                          sink="4", granularity="layer", keybits_layers="1", keybits_seconds="1")
    out = {}
    for name, extra in (("plain", []), ("scaled", ["--key-scale", "0.5"])):
        out[name] = str(tmp_path / f"{name}.safetensors")
        rc = main(["calibrate", "--method", "oscar-mix-long", "--long-seq-len", "512", "--long-sequences", "1",
                   "--base-artifact", base, "--out", out[name], *extra])
        assert rc == 0, capsys.readouterr().err
    plain, scaled = load_artifact(out["plain"]), load_artifact(out["scaled"])
    assert scaled.meta["key_scale"] == "0.5" and "key_scale" not in plain.meta
    for layer in range(2):
        assert torch.equal(scaled.tensors[f"R_K.{layer}"], plain.tensors[f"R_K.{layer}"])
        assert torch.equal(scaled.tensors[f"k_mean.{layer}"], plain.tensors[f"k_mean.{layer}"])
        assert f"k_scale.{layer}" in scaled.tensors and f"k_scale.{layer}" not in plain.tensors
    cache = RotkvCache(model, "oscar-refine", out["scaled"], sink=4, window=8)
    assert cache.layers[0].rotation_cpu.R_Q is not None
