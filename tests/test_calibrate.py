"""Calibration pieces on tiny tensors and a tiny random model: OSCAR, P_br, stats, errors, OptR, pairwise."""

import math

import pytest
import torch

from rotkv.calibrate import clip
from rotkv.calibrate.capture import capturing
from rotkv.calibrate.error import causal_attention, output_error
from rotkv.calibrate.run import collect
from rotkv.calibrate.stats import Sample, weighted_cs
from rotkv.quant.quantizer import fake_quantize
from rotkv.rotations import optr, oscar, pairwise
from rotkv.rotations.base import LayerRotation
from rotkv.rotations.hadamard import hadamard_matrix
from rotkv.rotations.identity import random_orthogonal


def _spd(d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * d, d, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, d, dtype=torch.float64)
    return x.T @ x


def test_bitrev_permutation_reference_convention():
    e = torch.tensor([0.5, 3.0, 1.0, 2.0, 7.0, 0.1, 4.0, 6.0])  # descending order: 4 7 6 1 3 2 0 5
    perm = oscar.bitrev_permutation(e)
    order = [4, 7, 6, 1, 3, 2, 0, 5]
    for i in range(8):
        assert perm[oscar.bitrev(i, 3)] == order[i]
    assert [oscar.bitrev(i, 3) for i in range(8)] == [0, 4, 2, 6, 1, 5, 3, 7]


@pytest.mark.parametrize("d", [16, 64, 128])
def test_oscar_rotation_orthogonal_and_equalizes_energy(d):
    c = torch.stack([_spd(d, 0), _spd(d, 1)])
    r = oscar.oscar_rotation(c).double()
    torch.testing.assert_close(r.transpose(-1, -2) @ r, torch.eye(d, dtype=torch.float64).expand(2, d, d), atol=1e-5, rtol=0)
    diag = torch.diagonal(r.transpose(-1, -2) @ c @ r, dim1=-2, dim2=-1)  # every coordinate carries tr(C)/D
    tr = torch.diagonal(c, dim1=-2, dim2=-1).sum(-1, keepdim=True) / d
    torch.testing.assert_close(diag, tr.expand_as(diag), rtol=1e-4, atol=0)
    # without the Hadamard the eigenbasis does not equalize (the check can fail)
    e, u = torch.linalg.eigh(c)
    assert (torch.diagonal(u.transpose(-1, -2) @ c @ u, dim1=-2, dim2=-1) / tr).max() > 2


def test_pooled_granularity():
    c = torch.stack([_spd(8, 0), _spd(8, 1)])
    assert torch.equal(oscar.pooled(c, "kv-head"), c)
    torch.testing.assert_close(oscar.pooled(c, "layer")[1], c.sum(0))
    with pytest.raises(ValueError, match="granularity"):
        oscar.pooled(c, "head")


def test_pair_angles_equalize_variance_and_are_so2():
    c = _spd(16, 3)
    a = pairwise.pair_angles(c[None])[0]
    r = pairwise.pair_matrix(a).double()
    assert torch.det(r[[0, 8]][:, [0, 8]]) > 0  # a proper rotation on the pair (0, 8)
    torch.testing.assert_close(r.T @ r, torch.eye(16, dtype=torch.float64), atol=1e-6, rtol=0)
    var = torch.diagonal(r.T @ c @ r)
    torch.testing.assert_close(var[:8], var[8:], rtol=1e-4, atol=1e-6)


def test_block_hadamard_ends():
    assert torch.equal(pairwise.block_hadamard(64, 1), torch.eye(64))
    assert torch.equal(pairwise.block_hadamard(64, 64), hadamard_matrix(64))
    with pytest.raises(ValueError, match="block"):
        pairwise.block_hadamard(64, 3)


def test_ste_fake_quant_matches_quantizer_and_has_gradient():
    x = torch.randn(3, 40, 64) * 3
    y = optr.ste_fake_quant(x, 2, 64, 1.0)
    # the reference rounds its metadata to fp16, the STE version does not: a few codes near a rounding
    # boundary land one level apart, everything else agrees closely
    diff = (y - fake_quantize(x, 2, 64)).abs()
    assert (diff > 0.02 * x.abs().max()).float().mean() < 0.005
    xr = x.clone().requires_grad_(True)
    optr.ste_fake_quant(xr, 2, 32, 0.96).pow(2).sum().backward()
    assert xr.grad.abs().sum() > 0


def test_expm_skew_matches_matrix_exp():
    a = torch.randn(3, 32, 32) * 0.7
    torch.testing.assert_close(optr.expm_skew(a), torch.matrix_exp(a - a.transpose(-1, -2)), atol=2e-5, rtol=0)


def _sample(h=2, r=2, t=96, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(h, t, d, generator=g) * torch.linspace(0.2, 2, d)
    k[:, :, 3] += 5  # an outlier channel, as post-RoPE keys have
    return Sample(torch.randn(h * r, t, d, generator=g), k, torch.randn(h, t, d, generator=g))


def test_output_error_zero_unquantized_and_ordered_by_bits():
    s = [_sample()]
    w = torch.randn(64, 4 * 32) / 8
    rot = LayerRotation(random_orthogonal(32, 0).expand(2, 32, 32), random_orthogonal(32, 1).expand(2, 32, 32),
                        torch.randn(2, 32))
    assert output_error(s, rot, w, None, 32, sink=4) < 1e-10  # rotation + mean-centering are exact
    e2, e4, e8 = (output_error(s, rot, w, b, 32, sink=4) for b in (2, 4, 8))
    assert e2 > e4 > e8 > 0


def test_key_mean_helps_an_offset_channel_and_clip_search_picks_from_grid():
    s = [_sample(seed=1)]
    w = torch.randn(64, 4 * 32) / 8
    h = hadamard_matrix(32).expand(2, 32, 32)
    mu = s[0].k[:, 4:].mean(1)
    e_plain = output_error(s, LayerRotation(h, h), w, 2, 32, sink=4, quant_v=False)
    e_mean = output_error(s, LayerRotation(h, h, mu), w, 2, 32, sink=4, quant_v=False)
    assert e_mean < e_plain
    ck, cv = clip.search_layer(s, LayerRotation(h, h, mu), w, 2, 32, 4, 32**-0.5)
    assert ck in clip.GRID and cv in clip.GRID


def test_optr_never_worse_than_base_and_orthogonal():
    w = torch.randn(64, 4 * 32) / 8
    base = hadamard_matrix(32).expand(2, 32, 32).contiguous()
    tr, held = [_sample(seed=2), _sample(seed=3)], [_sample(seed=4)]
    rk, rv, info = optr.optimize_layer(tr, held, base, base, None, w, 2, 32, 1.0, 1.0, 4, 32**-0.5, steps=40, n_queries=48)
    for r in (rk, rv):
        torch.testing.assert_close(r.transpose(-1, -2) @ r, torch.eye(32).expand(2, 32, 32), atol=1e-4, rtol=0)
    assert all(b <= a + 1e-7 for a, b in zip(info["key_base"], info["key_best"]))
    assert info["heads_improved_k"] >= 1  # the outlier channel leaves room to improve on Hadamard
    # a head that did not improve keeps R_base exactly
    for g in range(2):
        if info["key_best"][g] >= info["key_base"][g]:
            assert torch.equal(rk[g], base[g])


def test_capture_matches_sdpa_and_streams_exact_cs(tiny_llama):
    ids = torch.randint(0, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = tiny_llama(ids).logits
        seen = {}
        with capturing(tiny_llama, lambda l, q, k, v, o, p: seen.setdefault(l, (q, k, v, o, p))):
            out = tiny_llama(ids).logits
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert tiny_llama.config._attn_implementation != "rotkv_capture"  # restored
    q, k, v, o, p = seen[1]
    torch.testing.assert_close(o[0], causal_attention(q[0], k[0], v[0], tiny_llama.model.layers[1].self_attn.scaling))
    rec = collect(tiny_llama, [ids, ids[:, :32]], sink=4, keep={0}, keep_kv=True, progress=False)
    st = rec.layers[1]
    o2 = o[0].double().reshape(2, 2 * 48, 16)  # query heads 0,1 -> KV head 0; 2,3 -> 1
    assert st.n_q == 2 * (48 + 32)
    full = o2.transpose(-1, -2) @ o2
    assert torch.allclose(st.cs, full + _cs_of(tiny_llama, ids[:, :32]), atol=1e-6)
    kb = torch.cat([k[0, :, 4:], _keys_of(tiny_llama, ids[:, :32])[:, 4:]], 1)
    torch.testing.assert_close(st.k_mean, kb.mean(1), atol=1e-5, rtol=1e-5)
    assert weighted_cs(st).shape == (2, 16, 16)
    assert set(st.samples) == {0}


def _capture_one(model, ids):
    got = {}
    with torch.no_grad(), capturing(model, lambda l, q, k, v, o, p: got.setdefault(l, (q, k, v, o))):
        model(ids)
    return got[1]


def _cs_of(model, ids):
    o = _capture_one(model, ids)[3][0].double().reshape(2, -1, 16)
    return o.transpose(-1, -2) @ o


def _keys_of(model, ids):
    return _capture_one(model, ids)[1][0]


def test_key_widths_are_chosen_by_measured_gain(tiny_llama, tmp_path):
    """keybits: one cache run per layer on calibration text; the layers with the largest KL drop get 4 bits."""
    import numpy as np

    from rotkv.calibrate.keybits import layer_gains, with_key_bits
    from rotkv.rotations.artifact import load_artifact
    from test_cache_model import write_random_artifact

    class Loaded:  # the tiny model with a character tokenizer over the built-in calibration text
        model = tiny_llama
        tokenizer = staticmethod(lambda text, return_tensors=None: type("T", (), {
            "input_ids": torch.tensor([[1 + ord(c) % 120 for c in text[:4000]]])})())

    path = tmp_path / "a.safetensors"
    write_random_artifact(tiny_llama, path)
    art = load_artifact(str(path))
    spec = "quarot-int2"
    from rotkv.config import get_preset

    gains, base = layer_gains(Loaded, art, get_preset(spec, rotation="artifact", group_size=16), length=96, new=8,
                              windows=2, chunk=32, sink=4, window=8, progress=False)
    assert gains.shape == (2,) and np.isfinite(gains).all() and base > 0
    tensors, _ = with_key_bits(art, gains, 1)
    assert tensors["k_bits"].tolist()[int(np.argmax(gains))] == 4 and sorted(tensors["k_bits"].tolist()) == [2, 4]


def test_the_key_width_search_reduces_each_token_as_it_comes(tiny_llama, tmp_path, monkeypatch):
    """The search keeps per decode token a [runs, windows] KL, never every token's log-probabilities: bit for bit
    the KL of the stacked [runs, windows, new, vocab] log-probabilities (the form it replaced)."""
    import rotkv.calibrate.keybits as kb
    from rotkv.cache import RotkvCache
    from rotkv.config import get_preset
    from rotkv.rotations.artifact import load_artifact
    from test_cache_model import write_random_artifact

    path = tmp_path / "a.safetensors"
    write_random_artifact(tiny_llama, path)
    art = load_artifact(str(path))
    spec = get_preset("quarot-int2", rotation="artifact", group_size=16)
    kw = dict(sink=4, window=8, prefill_chunk=32)
    variants = [{}, {"k_bits": "0:4"}, {"k_bits": "1:4"}]
    torch.manual_seed(2)
    ids = torch.randint(1, 120, (2, 96 + 8))
    length, new, g = 96, 8, len(variants)
    ref = torch.stack([kb._logp(tiny_llama, ids[w:w + 1, :length + new - 1], keep=new) for w in range(2)])
    seen = []
    real = kb._chunk_logp
    monkeypatch.setattr(kb, "_chunk_logp", lambda *a: seen.append(real(*a)) or seen[-1])
    got = kb.grouped_decode_kl(tiny_llama, [RotkvCache(tiny_llama, spec, art, **kw, **v) for v in variants], ids,
                               length, new, 32, ref, first=[None, 0, 1])
    lps = [seen[-new].repeat(g, 1) if seen[-new].shape[0] == 2 else seen[-new]] + seen[-new + 1:]
    lp = torch.stack(lps, 1).view(g, 2, new, -1)
    assert torch.equal(got, (ref.exp()[None] * (ref[None] - lp)).sum(-1).clamp_min(0))


def test_the_key_width_search_in_batches_of_rows_finds_the_same_gains(tmp_path):
    """layer_gains runs its cache runs through the model a few rows at a time (``max_rows``, each batch with a run of
    the preset again): the gains, the preset's KL and the order of the layers are those of the one-batch search, to
    float rounding. A 4-layer Llama with sharpened attention and logits, so that the gains stand well above it."""
    import numpy as np

    from rotkv.calibrate.keybits import layer_gains
    from rotkv.config import get_preset
    from rotkv.rotations.artifact import load_artifact
    from rotkv_testing import make_tiny_llama
    from test_cache_model import write_random_artifact

    model = make_tiny_llama(layers=4)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4)
            layer.self_attn.k_proj.weight.mul_(4)
        model.lm_head.weight.mul_(20)

    class Loaded:  # the model with a character tokenizer over the built-in calibration text
        tokenizer = staticmethod(lambda text, return_tensors=None: type("T", (), {
            "input_ids": torch.tensor([[1 + ord(c) % 120 for c in text[:4000]]])})())

    Loaded.model = model
    path = tmp_path / "a.safetensors"
    write_random_artifact(model, path)
    art = load_artifact(str(path))
    spec = get_preset("quarot-int2", rotation="artifact", group_size=16)
    kw = dict(length=96, new=8, windows=2, chunk=32, sink=4, window=8, progress=False)
    whole, base = layer_gains(Loaded, art, spec, max_rows=10, **kw)  # the preset and the 4 layers' runs in one batch
    assert np.abs(whole).min() > 1e-3 and base > 1e-2  # gains far above the rounding below
    for rows in (6, 4):  # 2 layers' runs, then 1, per batch beside a run of the preset
        sliced, base_s = layer_gains(Loaded, art, spec, max_rows=rows, **kw)
        assert abs(base_s - base) <= 1e-5 * base  # float32 sums over other batch shapes (1.1e-6 seen)
        np.testing.assert_allclose(sliced, whole, rtol=1e-3, atol=1e-6)
        assert (np.argsort(-sliced) == np.argsort(-whole)).all()
    with pytest.raises(ValueError, match="max_rows"):
        layer_gains(Loaded, art, spec, max_rows=3, **kw)


@pytest.mark.parametrize("prune", [False, True])
def test_grouped_key_width_runs_match_the_lone_runs(tiny_llama, tmp_path, prune):
    """The key-width search runs every cache variant and window as rows of one batch (the first
    prefill chunk once; with prune, the run of layer l skips the layers below l): the per-token KL
    of each (variant, window) is that of its lone run."""
    from rotkv.cache import RotkvCache
    from rotkv.calibrate.keybits import _logp, decode_kl, grouped_decode_kl
    from rotkv.config import get_preset
    from rotkv.rotations.artifact import load_artifact
    from test_cache_model import write_random_artifact

    path = tmp_path / "a.safetensors"
    write_random_artifact(tiny_llama, path)
    art = load_artifact(str(path))
    spec = get_preset("quarot-int2", rotation="artifact", group_size=16)
    kw = dict(sink=4, window=8, prefill_chunk=32)
    variants = [{}, {"k_bits": "0:4"}, {"k_bits": "1:4"}]
    torch.manual_seed(1)
    ids = torch.randint(1, 120, (2, 96 + 8))
    length, new = 96, 8
    ref = torch.stack([_logp(tiny_llama, ids[w:w + 1, :length + new - 1], keep=new) for w in range(2)])
    grouped = grouped_decode_kl(tiny_llama, [RotkvCache(tiny_llama, spec, art, **kw, **v) for v in variants], ids,
                                length, new, 32, ref, first=[None, 0, 1] if prune else None)
    assert grouped.shape == (3, 2, new)
    for j, v in enumerate(variants):
        for w in range(2):
            lone = decode_kl(tiny_llama, lambda: RotkvCache(tiny_llama, spec, art, **kw, **v), ids[w:w + 1], length,
                             new, 32, ref[w])
            torch.testing.assert_close(grouped[j, w], lone, rtol=1e-3, atol=1e-6)
    assert (grouped[1:] != grouped[0]).any()  # the variants differ: the runs did not share their caches
