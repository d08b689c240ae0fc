"""Inter-layer key prediction (`predict_keys`, preset oscar-aqua; rotkv.cache.predict) on a tiny random Llama.

- the cache equals the simulation of studies/aqua_cache.py (the prediction kept beside the pages) on the same inputs;
- a page's reads give back what its flush stored (the flush and the reads predict from the same keys), batched
  rows of different lengths included;
- layer 0 stores what oscar-refine stores;
- the refusals: an artifact without maps or with another model's, the CUDA graph, the vLLM backend, the kernels;
- the maps that commute with RoPE (``--aqua-map rope``, ``rope-head``): the fit recovers such a map, and applied
  before RoPE it equals itself applied to the post-RoPE keys.
"""

import sys

import numpy as np
import pytest
import torch

from rotkv.cache import RotkvCache
from rotkv.cache.layer import HybridLayer
from rotkv.cache.predict import KeyPredictor, map_name
from rotkv.eval.protocol import forward, prefill
from rotkv.hf import compat
from rotkv.hf.fingerprint import model_meta
from rotkv.rotations.artifact import ArtifactMismatch, save_artifact
from rotkv.rotations.identity import random_orthogonal
from rotkv_testing import load_benchmark, make_tiny_llama

L, H, D = 4, 2, 16
K_BITS = [2, 4, 2, 2]  # one layer with 4-bit keys, as the real artifacts have


def _artifact(model, path, maps=True, map_shape=None, kind="oscar-mix-long+aqua", layers=None, listed=None,
              map_class=None):
    """``layers``: the layers that get a map (default: 1 .. L-1); ``listed``: the artifact's ``aqua_layers``;
    ``map_class``: its ``aqua_map_class``."""
    g = torch.Generator().manual_seed(1)
    t = {}
    for i in range(L):
        t[f"R_K.{i}"] = torch.stack([random_orthogonal(D, 10 * i + h) for h in range(H)])
        t[f"R_V.{i}"] = torch.stack([random_orthogonal(D, 10 * i + h + 5) for h in range(H)])
        t[f"k_mean.{i}"] = 0.1 * torch.randn(H, D, generator=g)
    t["clip_k"], t["clip_v"] = torch.full((L,), 0.96), torch.full((L,), 0.92)
    t["k_bits"] = torch.tensor(K_BITS, dtype=torch.int32)
    if maps:
        n = H * D
        shape = map_shape or (n + 1, n)
        for i in (layers if layers is not None else range(1, L)):
            # a map that predicts part of the keys: scaled near-identity plus noise, and a bias
            m = 0.1 * torch.randn(*shape, generator=g)
            if shape == (n + 1, n):
                m[:n] += 0.6 * torch.eye(n)
            t[map_name(i)] = m.half()
    meta = model_meta(model, "tiny") | {"method": "oscar", "bits": 2, "group_size": D, "kind": kind,
                                        "clip_k": ",".join(["0.96"] * L)}
    if listed is not None:
        meta["aqua_layers"] = listed
    if map_class is not None:
        meta["aqua_map_class"] = map_class
    save_artifact(str(path), t, meta)
    return str(path)


@pytest.fixture
def tiny():
    torch.manual_seed(0)
    return make_tiny_llama(seed=3, layers=L, kv_heads=H, q_heads=4, head_dim=D)


def _ids(n, seed=0, rows=1):
    return torch.randint(4, 128, (rows, n), generator=torch.Generator().manual_seed(seed))


def _run(model, cache, ids, new=40, chunk=160):
    """Prefill ``ids [1, n]`` in calls of ``chunk`` tokens, then ``new`` decode steps of teacher-forced tokens;
    the log-probs of the decode steps ``[new, vocab]``."""
    n = ids.shape[1] - new
    out = []
    with torch.no_grad():
        prefill(model, cache, ids[:, :n], chunk)
        for t in range(n, ids.shape[1]):
            out.append(forward(model, ids[:, t:t + 1], cache)[-1])
    return torch.stack(out)


def _study(monkeypatch):
    """studies/aqua_cache.py as a module (its argument parser reads sys.argv at import); its patch of
    HybridLayer.lazy_initialization is undone after the test."""
    monkeypatch.setattr(sys, "argv", ["aqua_cache.py", "--mode", "aqua"])
    threads = torch.get_num_threads()
    mod = load_benchmark("aqua_cache", "studies")
    torch.set_num_threads(threads)
    monkeypatch.setattr(HybridLayer, "lazy_initialization", HybridLayer.lazy_initialization)
    return mod


def test_cache_equals_the_study_simulation(tiny, tmp_path, monkeypatch):
    path = _artifact(tiny, tmp_path / "a.safetensors")
    ids = _ids(420)
    over = dict(prefill_chunk=64)
    mine = RotkvCache(tiny, "oscar-aqua", path, **over)
    logp = _run(tiny, mine, ids)
    keys = [layer.read(0)[0] for layer in mine.layers]

    study = _study(monkeypatch)
    from safetensors.torch import load_file

    tensors = load_file(path)
    maps = [None] + [tensors[map_name(i)].double() for i in range(1, L)]
    cos, sin = study.rope_tables(tiny, 4096)
    study.install(study.Chain(maps, cos, sin, 4))
    sim = RotkvCache(tiny, "oscar-refine", path, **over)
    logp_sim = _run(tiny, sim, ids)
    assert all(isinstance(layer.key_codec, study.AquaCodec) for layer in sim.layers)
    keys_sim = [layer.read(0)[0] for layer in sim.layers]

    # the same bytes per token (the simulation leaves its float32 prediction out of its count)
    assert mine.stats()["kv_bytes"] == sim.stats()["kv_bytes"]
    assert mine.stats()["key_map_bytes"] == (L - 1) * (H * D + 1) * H * D * 2
    for i, (a, b) in enumerate(zip(keys, keys_sim)):
        assert a.shape == b.shape
        err = (a - b).abs()
        # float32 against the study's float64 map: a rare element may round to the next code
        assert (err > 1e-4).float().mean() < 1e-3, f"layer {i}: {(err > 1e-4).float().mean():.2e} differ"
        assert torch.quantile(err.flatten(), 0.999) < 1e-4
    d_sim = (logp - logp_sim).abs().max()
    assert d_sim < 1e-4
    # and the prediction matters: oscar-refine itself is another cache
    monkeypatch.undo()
    plain = RotkvCache(tiny, "oscar-refine", path, **over)
    logp_plain = _run(tiny, plain, ids)
    d_plain = (logp - logp_plain).abs().max()
    assert d_plain > 5e-4 and d_plain > 20 * d_sim


def _record_flushes(monkeypatch):
    """Every flush of predicted keys: (layer, page ids, what its reads have to give back) -- the prediction it
    subtracted plus the decoded residual it stored."""
    seen = []
    residual, wrote = KeyPredictor.residual, KeyPredictor.wrote

    def res(self, x, ids, index):
        r, state = residual(self, x, ids, index)
        self._last = (x.float() - r)  # (p - mu) R_K, or 0 for layer 0
        return r, state

    def wr(self, ids, decoded, state, capacity):
        seen.append((self.layer, ids.clone(), self._last + decoded))
        return wrote(self, ids, decoded, state, capacity)

    monkeypatch.setattr(KeyPredictor, "residual", res)
    monkeypatch.setattr(KeyPredictor, "wrote", wr)
    return seen


@pytest.mark.parametrize("rows,odd", [(1, False), (2, False), (2, True)])
def test_reads_give_back_what_flushes_stored(tiny, tmp_path, monkeypatch, rows, odd):
    path = _artifact(tiny, tmp_path / "a.safetensors", **(dict(layers=[1, 3], listed="1,3") if odd else {}))
    seen = _record_flushes(monkeypatch)
    # no refine tier: a read is then the prediction plus the decoded residual alone
    cache = RotkvCache(tiny, "oscar-aqua", path, prefill_chunk=64, refine_tokens=0, refine_values=False,
                       refine_every=0)
    ids = _ids(300, seed=1, rows=rows)
    mask = torch.ones_like(ids)
    if rows == 2:
        mask[1, :37] = 0  # row 1: 37 pads, so the rows hold different numbers of body pages
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    kw = compat.cache_kwarg(tiny)
    with torch.no_grad():
        for c0, c1 in ((0, 150), (150, 280)):
            tiny(input_ids=ids[:, c0:c1], attention_mask=mask[:, :c1], position_ids=pos[:, c0:c1],
                 **{kw: cache})
        for t in range(280, 300):  # decode steps, each may flush a page
            tiny(input_ids=ids[:, t:t + 1], attention_mask=mask[:, :t + 1], position_ids=pos[:, t:t + 1],
                 **{kw: cache})
    st = cache.state
    assert rows == 1 or st.body_count[0] != st.body_count[1]
    stored = {}
    for layer, ids_, keys in seen:
        for j, page in enumerate(ids_.tolist()):
            stored[(layer, page)] = keys[j]
    assert {layer for layer, _ in stored} == set(range(L))
    for layer in cache.layers:
        for row in range(rows):
            k, _ = layer.read(row)
            s = min(int(st.tier_tokens[row]), st.sink)
            n = int(st.body_count[row])
            body = k[:, s:s + n * 16].reshape(H, n, 16, D).transpose(0, 1)
            for j, page in enumerate(st.body_pages[row, :n].tolist()):
                want = stored[(layer.layer_idx, page)]
                torch.testing.assert_close(body[j], want, atol=2e-5, rtol=1e-5)


def test_layer0_stores_what_oscar_refine_stores(tiny, tmp_path):
    path = _artifact(tiny, tmp_path / "a.safetensors")
    ids = _ids(300, seed=2)
    caches = [RotkvCache(tiny, name, path, prefill_chunk=64) for name in ("oscar-aqua", "oscar-refine")]
    for c in caches:
        _run(tiny, c, ids, new=20)
    a, b = (c.layers[0] for c in caches)
    n = int(a.state.body_count[0])
    assert n > 0 and np.array_equal(a.state.body_pages[0, :n], b.state.body_pages[0, :n])
    pages = torch.as_tensor(a.state.body_pages[0, :n])
    for side in range(2):
        for name, t in a.pools.body[side].items():
            assert torch.equal(t[pages], b.pools.body[side][name][pages]), (side, name)
    # layer 1 stores residuals: other codes
    a1, b1 = (c.layers[1] for c in caches)
    assert not torch.equal(a1.pools.body[0]["codes"][pages], b1.pools.body[0]["codes"][pages])


def test_odd_layers_predict_from_plain_ones(tiny, tmp_path, monkeypatch):
    """An artifact that maps layers 1 and 3 only (``--aqua-layers odd``): layers 0 and 2 store their keys plainly
    (nothing subtracted), 1 and 3 predict; the maps' bytes count two maps; the cache is neither oscar-refine nor the
    chain."""
    path = _artifact(tiny, tmp_path / "odd.safetensors", layers=[1, 3], listed="1,3")
    seen = []
    residual = KeyPredictor.residual

    def res(self, x, ids, index):
        r, state = residual(self, x, ids, index)
        seen.append((self.layer, bool(torch.equal(r, x.float()))))
        return r, state

    monkeypatch.setattr(KeyPredictor, "residual", res)
    ids = _ids(300, seed=4)
    odd = RotkvCache(tiny, "oscar-aqua", path, prefill_chunk=64)
    logp = _run(tiny, odd, ids, new=20)
    assert [layer.predict.A is None for layer in odd.layers] == [True, False, True, False]
    assert {layer: plain for layer, plain in seen} == {0: True, 1: False, 2: True, 3: False}
    assert odd.stats()["key_map_bytes"] == 2 * (H * D + 1) * H * D * 2
    monkeypatch.undo()
    full = _artifact(tiny, tmp_path / "all.safetensors")
    for name, other in (("oscar-aqua", full), ("oscar-refine", path)):
        d = (logp - _run(tiny, RotkvCache(tiny, name, other, prefill_chunk=64), ids, new=20)).abs().max()
        assert d > 5e-4, name


@pytest.mark.parametrize("layers,listed,match", [
    ([1, 3], "1,2,3", "without the inter-layer key maps"),
    ([1, 2, 3], "1,3", "leaves out"),
    ([1, 3], "1,x", "comma-separated"),
    ([1, 3], "0,1,3", "outside 1..3"),
])
def test_odd_layer_artifacts_are_checked(tiny, tmp_path, layers, listed, match):
    path = _artifact(tiny, tmp_path / "a.safetensors", layers=layers, listed=listed)
    with pytest.raises(ArtifactMismatch, match=match):
        RotkvCache(tiny, "oscar-aqua", path)


def test_an_unknown_map_class_is_refused(tiny, tmp_path):
    with pytest.raises(ArtifactMismatch, match="aqua_map_class 'spline'"):
        RotkvCache(tiny, "oscar-aqua", _artifact(tiny, tmp_path / "a.safetensors", map_class="spline"))


def test_artifact_without_maps_is_refused(tiny, tmp_path):
    plain = _artifact(tiny, tmp_path / "plain.safetensors", maps=False, kind="oscar-mix-long")
    with pytest.raises(ArtifactMismatch, match="oscar-aqua.*rotkv calibrate --method aqua"):
        RotkvCache(tiny, "oscar-aqua", plain)
    # an aqua-kind artifact whose maps are missing
    empty = _artifact(tiny, tmp_path / "empty.safetensors", maps=False)
    with pytest.raises(ArtifactMismatch, match="without the inter-layer key maps.*oscar-aqua"):
        RotkvCache(tiny, "oscar-aqua", empty)
    # the plain preset still takes the aqua artifact (it holds oscar-mix-long's tensors)
    RotkvCache(tiny, "oscar-refine", _artifact(tiny, tmp_path / "a.safetensors"))


def test_maps_of_another_model_shape_are_refused(tiny, tmp_path):
    wrong = _artifact(tiny, tmp_path / "w.safetensors", map_shape=(3 * D + 1, 3 * D))
    with pytest.raises(ArtifactMismatch, match=r"aqua_map.1.*\(49, 48\).*oscar-aqua.*\(33, 32\)"):
        RotkvCache(tiny, "oscar-aqua", wrong)


def test_kernel_paths_refuse_or_fall_back(tiny, tmp_path):
    from rotkv.cache.graph import StaticDecode
    from rotkv.integrations.vllm.config import check_spec
    from rotkv.config import get_preset
    from rotkv.kernels import plan as kernel_plan

    path = _artifact(tiny, tmp_path / "a.safetensors")
    cache = RotkvCache(tiny, "oscar-aqua", path)
    _run(tiny, cache, _ids(120), new=2)
    with pytest.raises(ValueError, match="oscar-aqua.*predict_keys.*without cuda_graph"):
        StaticDecode(cache, 1, 256)
    with pytest.raises(ValueError, match="oscar-aqua.*predict_keys"):
        check_spec(get_preset("oscar-aqua"))
    for layer in cache.layers:  # no decode, dequantize or key-write kernel reads another layer's prediction
        pools = layer.pools
        assert pools.part_kernels[0] is False and pools.dequant_kernel is False
        assert pools.decode_plan(torch.zeros(1, 4, D), kernel_plan.decode_config(None)) is None


def test_spec_checks():
    from rotkv.config import get_preset

    with pytest.raises(ValueError, match="predict_keys"):
        get_preset("int4", predict_keys=True)
    with pytest.raises(TypeError, match="predict_keys"):
        get_preset("oscar-aqua", predict_keys="yes")


def test_calibrate_refuses_a_wrong_base(tiny, tmp_path, capsys):
    from rotkv.cli import main

    assert main(["calibrate", "--method", "aqua", "--out", str(tmp_path / "o.safetensors")]) != 0
    assert "--base-artifact" in capsys.readouterr().err
    oscar = _artifact(tiny, tmp_path / "o1.safetensors", maps=False, kind="oscar")
    assert main(["calibrate", "--method", "aqua", "--base-artifact", oscar, "--out", str(tmp_path / "o2.safetensors")]) != 0
    assert "oscar-mix-long" in capsys.readouterr().err


def test_calibrate_writes_maps_the_preset_reads(tmp_path, capsys):
    from rotkv.cli import main
    from rotkv.rotations.artifact import load_artifact
    from rotkv.hf.models import load_model
    from rotkv_testing import save_tiny_llama_dir

    folder = save_tiny_llama_dir(tmp_path / "m", seed=3, layers=L, kv_heads=H, q_heads=4, head_dim=D)
    model = load_model(folder).model
    base = _artifact(model, tmp_path / "base.safetensors", maps=False, kind="oscar-mix-long")
    out = tmp_path / "aqua.safetensors"
    assert main(["calibrate", "--method", "aqua", "--model", folder, "--base-artifact", base, "--tokens", "4096",
                 "--out", str(out)]) == 0
    art = load_artifact(str(out))
    assert art.kind == "oscar-mix-long+aqua" and "oscar-aqua" in art.presets
    assert [tuple(art.tensors[map_name(i)].shape) for i in range(1, L)] == [(H * D + 1, H * D)] * (L - 1)
    assert all(art.tensors[map_name(i)].dtype == torch.float16 for i in range(1, L))
    assert map_name(0) not in art.tensors
    for name, t in load_artifact(base).tensors.items():  # the base's tensors, unchanged
        assert torch.equal(art.tensors[name], t)
    cache = RotkvCache(model, "oscar-aqua", str(out))
    _run(model, cache, _ids(200), new=4)
    assert cache.stats()["key_map_bytes"] == (L - 1) * (H * D + 1) * H * D * 2
    # --aqua-layers odd: maps for layers 1 and 3, named in the artifact
    odd = tmp_path / "odd.safetensors"
    assert main(["calibrate", "--method", "aqua", "--aqua-layers", "odd", "--model", folder, "--base-artifact", base,
                 "--tokens", "4096", "--out", str(odd)]) == 0
    art = load_artifact(str(odd))
    assert art.meta["aqua_layers"] == "1,3" and sorted(n for n in art.tensors if n.startswith("aqua_map")) == [
        map_name(1), map_name(3)]
    # layer 1 predicts from layer 0 in both: the same fit
    assert torch.equal(art.tensors[map_name(1)], load_artifact(str(out)).tensors[map_name(1)])
    cache = RotkvCache(model, "oscar-aqua", str(odd))
    _run(model, cache, _ids(200), new=4)
    assert cache.stats()["key_map_bytes"] == 2 * (H * D + 1) * H * D * 2
    capsys.readouterr()
    assert main(["calibrate", "--method", "oscar-mix-long", "--aqua-layers", "odd", "--model", folder,
                 "--base-artifact", base, "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "--aqua-layers" in capsys.readouterr().err
    # --aqua-map rope: maps that commute with RoPE, their bias after RoPE
    rp = tmp_path / "rope.safetensors"
    assert main(["calibrate", "--method", "aqua", "--aqua-layers", "odd", "--aqua-map", "rope", "--model", folder,
                 "--base-artifact", base, "--tokens", "4096", "--out", str(rp)]) == 0
    art = load_artifact(str(rp))
    assert art.meta["aqua_map_class"] == "rope" and art.meta["aqua_layers"] == "1,3"
    mu = [load_artifact(base).tensors[f"k_mean.{i}"].double().reshape(-1) for i in range(L)]
    for i in (1, 3):
        A = art.tensors[map_name(i)].double()
        assert torch.allclose(A[-1], mu[i] - mu[i - 1] @ A[:-1], atol=2e-3)  # the bias maps the means
        blk = A[:-1].reshape(H, D, H, D)
        assert torch.equal(blk[:, : D // 2, :, : D // 2], blk[:, D // 2:, :, D // 2:])  # complex-linear per pair
        assert torch.equal(blk[:, : D // 2, :, D // 2:], -blk[:, D // 2:, :, : D // 2])
    cache = RotkvCache(model, "oscar-aqua", str(rp))
    _run(model, cache, _ids(200), new=4)
    capsys.readouterr()
    assert main(["calibrate", "--method", "oscar-mix-long", "--aqua-map", "rope", "--model", folder,
                 "--base-artifact", base, "--out", str(tmp_path / "y.safetensors")]) == 2
    assert "--aqua-map" in capsys.readouterr().err


@pytest.mark.parametrize("per_head", [False, True])
def test_rope_maps_are_recovered_and_commute_with_rope(per_head):
    from rotkv.calibrate.aqua import apply_map, fit_rope_map
    from rotkv.cache.predict import rope

    g = torch.Generator().manual_seed(5)
    h, d, n = 3, 8, 4000
    f = d // 2
    c = torch.complex(torch.randn(f, h, h, generator=g, dtype=torch.float64),
                      torch.randn(f, h, h, generator=g, dtype=torch.float64))
    if per_head:
        c = c * torch.eye(h, dtype=torch.float64)
    x = torch.randn(n, h * d, generator=g, dtype=torch.float64)
    zx = torch.complex(x.reshape(n, h, d)[..., :f], x.reshape(n, h, d)[..., f:])
    zy = torch.einsum("nhf,fhg->ngf", zx, c)
    y = torch.cat([zy.real, zy.imag], -1).reshape(n, h * d)
    A = fit_rope_map(x, y, h, ridge=0.0, per_head=per_head)
    assert torch.allclose(x @ A[:-1], y, atol=1e-9) and not A[-1].any()
    if per_head:  # each head from the same head only
        blk = A[:-1].reshape(h, d, h, d)
        assert not blk[0, :, 1].any() and not blk[2, :, 0].any()
    # before RoPE (unRoPE, map, RoPE: what the cache does) equals the map on the post-RoPE keys as they are
    t = 50
    theta = torch.rand(t, f, generator=g, dtype=torch.float64) * 6.28
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    prev = rope(torch.randn(h, t, d, generator=g, dtype=torch.float64), cos, sin)  # post-RoPE [H, T, D]
    direct = (prev.permute(1, 0, 2).reshape(t, h * d) @ A[:-1]).reshape(t, h, d).permute(1, 0, 2)
    assert torch.allclose(apply_map(A, prev, cos, sin), direct, atol=1e-9)


def test_a_rope_map_predicts_after_rope_with_its_bias():
    """The cache's prediction with a map of a class that commutes with RoPE (``post_bias``) equals the map applied to
    the post-RoPE keys as they are, plus its bias (what the calibration fits)."""
    from rotkv.cache.predict import KeyChain, rope
    from rotkv.calibrate.aqua import apply_post_map, fit_rope_map

    g = torch.Generator().manual_seed(9)
    h, d, p, n = 2, 8, 4, 3
    x = torch.randn(500, h * d, generator=g, dtype=torch.float64)
    A = fit_rope_map(x, x @ torch.randn(h * d, h * d, generator=g, dtype=torch.float64), h)
    A[-1] = torch.randn(h * d, generator=g, dtype=torch.float64)
    chain = KeyChain(None, 0, p, h, d)
    prev = torch.randn(n, h, p, d, generator=g, dtype=torch.float64)  # unRoPE'd keys of layer 0 by page id
    chain.held[0], chain.fresh = prev.float(), {0}
    pred = KeyPredictor(1, A.half(), chain, post_bias=True)
    pred.A = A.float()
    theta = torch.rand(n, 1, p, d // 2, generator=g, dtype=torch.float64) * 6.28
    cos, sin = torch.cat([theta.cos()] * 2, -1), torch.cat([theta.sin()] * 2, -1)
    got = pred.predict(torch.arange(n), (cos.float(), sin.float())).double()
    post = rope(prev, cos, sin)  # [n, H, P, D]
    want = torch.stack([apply_post_map(A, post[i]) for i in range(n)])
    assert torch.allclose(got, want, atol=1e-4)
