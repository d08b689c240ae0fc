"""Dense-and-sparse outliers and non-uniform grids (rotkv.quant.outliers / grid) and their codecs."""

import pytest
import torch

from rotkv.cache.codecs import GridTokenCodec, SparseTokenCodec, TokenCodec
from rotkv.quant.grid import dequantize_grid, lloyd_max, normalized_samples, quantize_grid, uniform_grid
from rotkv.quant.outliers import merge_outliers, outlier_count, split_outliers
from rotkv.quant.quantizer import fake_quantize


def test_outliers_roundtrip_exact():
    x = torch.randn(2, 3, 16, 64)
    x[0, 1, 3, 7] = 40.0
    dense, vals, idx = split_outliers(x, 10)
    assert vals.dtype == torch.float16 and idx.dtype == torch.int16 and vals.shape == (2, 3, 10)
    assert dense[0, 1, 3, 7] == 0 and (idx[0, 1] == 3 * 64 + 7).any()
    back = merge_outliers(dense, vals, idx)
    kept = back != dense
    assert torch.allclose(back[kept], x[kept].half().float())
    assert torch.equal(back[~kept], x[~kept])


def test_outlier_count_and_errors():
    assert outlier_count(0.01, 16, 64) == 10
    assert outlier_count(0.0001, 16, 64) == 1
    with pytest.raises(ValueError, match="fraction"):
        outlier_count(0.0, 16, 64)
    with pytest.raises(ValueError, match="count"):
        split_outliers(torch.randn(1, 1, 2, 4), 9)


def test_sparse_codec_beats_dense_on_outliers_and_counts_bytes():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 64)
    x.view(-1)[torch.randperm(x.numel())[:60]] *= 12  # heavy entries
    dense = TokenCodec(2, 64, 1.0)
    sparse = SparseTokenCodec(2, 64, 1.0, None, 10)
    e_d = (dense.decode(dense.encode(x)) - x).pow(2).mean()
    parts = sparse.encode(x)
    e_s = (sparse.decode(parts) - x).pow(2).mean()
    assert e_s < 0.5 * e_d
    assert parts["ovals"].shape == (4, 3, 10) and parts["oidx"].shape == (4, 3, 10)


def test_uniform_grid_equals_the_uniform_quantizer():
    torch.manual_seed(1)
    x = torch.randn(5, 3, 16, 64)
    g = uniform_grid(2).expand(3, 4)
    got = dequantize_grid(quantize_grid(x, g, 2, 64, 0.96), g, 2, 64)
    ref = fake_quantize(x, 2, 64, 0.96)
    assert torch.allclose(got, ref, atol=1e-5)


def test_grid_per_head_levels_and_lloyd_max():
    torch.manual_seed(2)
    x = torch.randn(64, 2, 16, 64)
    u = normalized_samples(x, 2, 64)
    lv = lloyd_max(u, 2)
    assert lv.shape == (4,) and (lv[1:] > lv[:-1]).all()
    assert 0.2 < lv[1] < 1 / 3 + 0.1 and lv[0] > 0.0  # Gaussian rows: inner levels move in, outer levels leave the ends
    grid = torch.stack([uniform_grid(2), lv])
    codec = GridTokenCodec(2, 64, 1.0, None, grid)
    y = codec.decode(codec.encode(x))
    e = (y - x).pow(2).mean(dim=(0, 2, 3))
    assert e[1] < 0.9 * e[0]  # the fitted grid has less error than the uniform one on the same data
    assert torch.allclose(y[:, 0], fake_quantize(x[:, 0], 2, 64), atol=1e-5)


def test_grid_validation():
    with pytest.raises(ValueError, match="levels"):
        GridTokenCodec(2, 64, 1.0, None, torch.zeros(3, 8))
    with pytest.raises(ValueError, match="increasing"):
        GridTokenCodec(2, 64, 1.0, None, torch.tensor([[0.0, 0.5, 0.4, 1.0]]))


def test_pq_roundtrip_shapes_and_beats_int2_on_gaussian_rows():
    from rotkv.cache.codecs import PQCodec
    from rotkv.quant.vq import fit_pq

    torch.manual_seed(3)
    scales = torch.linspace(0.5, 2.0, 64)
    calib = torch.randn(2, 4096, 64) * scales
    book, sigma = fit_pq(calib, 4, 8, iters=10)
    assert book.shape == (2, 256, 4) and sigma.shape == (2, 64)
    codec = PQCodec(book, sigma)
    x = torch.randn(3, 2, 16, 64) * scales
    parts = codec.encode(x)
    assert parts["codes"].shape == (3, 2, 16, 16) and parts["codes"].dtype == torch.uint8
    assert parts["scale"].shape == (3, 2, 16) and parts["scale"].dtype == torch.float16
    y = codec.decode(parts)
    e_pq = (y - x).pow(2).mean()
    e_int2 = (fake_quantize(x, 2, 64) - x).pow(2).mean()
    assert e_pq < 0.8 * e_int2  # fewer bytes (18 against 20 per row) and less error
    # the nearest centroid: no other centroid is closer to a normalized sub-vector
    from rotkv.quant.vq import normalize
    yn, _ = normalize(x, sigma)
    sub = yn[0, 1, 0, :4]
    d = (book[1] - sub).pow(2).sum(-1)
    assert int(parts["codes"][0, 1, 0, 0]) == int(d.argmin())


def test_pq_errors():
    from rotkv.quant.vq import encode_pq
    with pytest.raises(ValueError, match="divide"):
        encode_pq(torch.randn(1, 1, 2, 64), torch.randn(1, 16, 3), torch.ones(1, 64))
    with pytest.raises(ValueError, match="sigma"):
        encode_pq(torch.randn(1, 1, 2, 64), torch.randn(1, 16, 4), torch.ones(1, 32))


@pytest.mark.parametrize("kind", ["sparse", "grid", "pq"])
def test_lever_codecs_in_a_hybrid_layer_store_read_and_count_their_bytes(kind):
    """The cache's CPU path stores each lever's parts in the pools, reads back exactly the codec's decode, and
    counts every part (side table, scale) in the measured body bytes."""
    from rotkv.cache.codecs import PQCodec, make_codecs
    from rotkv.cache.layer import HybridLayer
    from rotkv.config import CacheSpec
    from rotkv.quant.vq import fit_pq
    from rotkv.rotations.base import LayerRotation

    S, W, P, H, D = 4, 8, 4, 2, 16
    spec = CacheSpec(bits=2, group_size=16, sink=S, window=W, page_size=P, tier_dtype="float32")
    kc, vc = make_codecs("token", 2, 16, 1.0, 1.0)
    if kind == "sparse":
        kc, per_token = SparseTokenCodec(2, 16, 1.0, None, 3), D // 4 + 4 + 3 * 4 / P
    elif kind == "grid":
        kc, per_token = GridTokenCodec(2, 16, 1.0, None, torch.tensor([[0.1, 0.4, 0.6, 0.9]] * H)), D // 4 + 4
    else:
        book, sigma = fit_pq(torch.randn(H, 512, D), 4, 4, iters=5)
        kc, per_token = PQCodec(book, sigma), D // 4 + 2
    layer = HybridLayer(spec, LayerRotation(), D, H, 0, (kc, vc))
    g = torch.Generator().manual_seed(0)
    ks, vs = torch.randn(1, H, 60, D, generator=g), torch.randn(1, H, 60, D, generator=g)
    layer.update(ks, vs)
    layer.attend(torch.randn(1, H, 60, D), None, D**-0.5)
    k_read, _ = layer.read(0)
    body = int(layer.state.body_count[0]) * P
    assert body > 0
    pages = ks[:, :, S:S + body].reshape(1, H, body // P, P, D).transpose(1, 2)[0]  # [nb, H, P, D]
    ref = kc.decode(kc.encode(pages)).transpose(0, 1).reshape(H, body, D)
    assert torch.allclose(k_read[:, S:S + body], ref, atol=1e-6)
    st = layer.stats()
    assert st["body_bytes"] == body * H * per_token + body * H * (D // 4 + 4)  # keys (lever) + INT2 values


@pytest.mark.parametrize("table", ["grid", "pq"])
def test_key_table_preset_path_reads_the_artifact_tables(tmp_path, table):
    """A spec with ``k_table`` builds the calibrated key codec from the artifact for its 2-bit key layers only,
    runs end to end through the model, and refuses an artifact without the tables."""
    from rotkv.cache import RotkvCache
    from rotkv.cache.codecs import PQCodec
    from rotkv.config import get_preset
    from rotkv.quant.vq import fit_pq
    from rotkv_testing import make_tiny_llama, write_artifact

    model = make_tiny_llama()
    if table == "grid":
        extra = {"k_grid": torch.tensor([0.1, 0.4, 0.6, 0.9]).expand(2, 2, 4).contiguous()}
    else:
        book, sigma = fit_pq(torch.randn(2, 512, 16), 4, 4, iters=3)
        extra = {"pq_book": torch.stack([book, book]), "pq_sigma": torch.stack([sigma, sigma])}
    extra["k_bits"] = torch.tensor([2, 4], dtype=torch.int32)
    path = write_artifact(model, tmp_path / "a.safetensors", tensors=extra)
    spec = get_preset("oscar-mix", method=None, k_table=table, sink=4, window=8, page_size=4, group_size=16)
    cache = RotkvCache(model, spec, path)
    want = GridTokenCodec if table == "grid" else PQCodec
    assert isinstance(cache.layers[0].key_codec, want)
    assert isinstance(cache.layers[1].key_codec, TokenCodec) and cache.layers[1].key_codec.bits == 4
    ids = torch.randint(1, 128, (1, 60))
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache).logits
    assert torch.isfinite(out).all() and cache.layers[0].state.body_count[0] > 0
    bare = write_artifact(model, tmp_path / "b.safetensors", tensors={"k_bits": extra["k_bits"]})
    with pytest.raises(ValueError, match="k_table"):
        RotkvCache(model, spec, bare)
    with pytest.raises(ValueError, match="k_table"):
        get_preset("oscar-mix", k_table="lut")
    with pytest.raises(ValueError, match="k_table"):
        get_preset("int4", k_table=table)


def test_longfit_refits_keys_only_and_matches_a_direct_fit(tmp_path):
    """The long-sequence refit keeps R_V, clips and key widths; its key mean is the mean of the keys past the
    sink and its R_K is OSCAR's rotation of the summed query covariance of all positions (a one-call fit)."""
    from rotkv.calibrate.capture import capturing
    from rotkv.calibrate.longfit import long_stats, refit
    from rotkv.rotations.artifact import load_artifact
    from rotkv.rotations.base import pooled
    from rotkv.rotations.oscar import oscar_rotation
    from rotkv_testing import char_tokenizer, make_tiny_llama, write_artifact

    model, tok = make_tiny_llama(), char_tokenizer()
    path = write_artifact(model, tmp_path / "a.safetensors", tensors={"k_bits": torch.tensor([2, 4], dtype=torch.int32)},
                          sink="4", granularity="layer")
    art = load_artifact(path)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    tensors, meta = refit(model, tok, art, seq_len=96, sequences=2, call=32, files=[str(text)])
    for k in ("R_V.0", "R_V.1", "clip_k", "clip_v", "k_bits"):
        assert torch.equal(tensors[k], art.tensors[k])
    assert meta["longfit_seq_len"] == "96"
    # a direct fit: each 96-token sequence in one call (no cache); the chunked DynamicCache path must agree
    chunks = [tok(text.read_text(), return_tensors="pt").input_ids[:, i * 96:(i + 1) * 96] for i in range(2)]
    cq, ks, kn = {}, {}, {}

    def rec(layer, q, k, v, out, probs):
        g = q[0].double().reshape(2, -1, 16)
        cq[layer] = cq.get(layer, 0) + torch.einsum("htd,hte->hde", g, g)
        ks[layer] = ks.get(layer, 0) + k[0, :, 4:].double().sum(1)
        kn[layer] = kn.get(layer, 0) + k.shape[2] - 4

    with torch.no_grad(), capturing(model, rec):
        for c in chunks:
            model(c, use_cache=False)
    for layer in range(2):
        assert torch.allclose(tensors[f"k_mean.{layer}"], (ks[layer] / kn[layer]).float(), atol=1e-5)
        want = oscar_rotation(pooled(cq[layer], "layer"))[:1]
        got = tensors[f"R_K.{layer}"]
        assert got.shape == art.tensors[f"R_K.{layer}"].shape
        assert torch.allclose(got @ got.transpose(-1, -2), torch.eye(16).expand_as(got), atol=1e-5)
        # eigenvectors are defined up to sign: compare the projectors of each rotated coordinate
        assert torch.allclose(got.abs(), want.abs(), atol=1e-3)
    c2, _, _ = long_stats(model, chunks, 4, 32)
    assert torch.allclose(c2[0], cq[0], rtol=1e-6)
    with pytest.raises(ValueError, match="seq_len"):
        refit(model, tok, art, seq_len=16, sequences=1, call=32, files=[str(text)])


def test_long_artifact_keeps_or_reranks_the_base_key_layers(tmp_path):
    """oscar-mix-long keeps its base's 4-bit key layers, or with ``layers`` takes that many by the base's
    k_gain; a base without k_gain cannot be re-ranked and says so."""
    from types import SimpleNamespace

    from rotkv.calibrate.longfit import calibrate_mix_long
    from rotkv.rotations.artifact import load_artifact
    from rotkv_testing import char_tokenizer, make_tiny_llama, write_artifact

    model, tok = make_tiny_llama(), char_tokenizer()
    loaded = SimpleNamespace(model=model, tokenizer=tok)
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    base = dict(sink="4", granularity="layer")
    ranked = load_artifact(write_artifact(model, tmp_path / "a.safetensors", tensors={
        "k_bits": torch.tensor([2, 4], dtype=torch.int32), "k_gain": torch.tensor([0.5, 0.7])}, **base))
    kw = dict(seq_len=512, sequences=1, files=[str(text)], log=lambda m: None)
    assert calibrate_mix_long(loaded, ranked, **kw)[0]["k_bits"].tolist() == [2, 4]  # the base's
    assert calibrate_mix_long(loaded, ranked, layers=1, **kw)[0]["k_bits"].tolist() == [2, 4]
    tensors, meta = calibrate_mix_long(loaded, ranked, layers=2, **kw)
    assert tensors["k_bits"].tolist() == [4, 4] and meta["keybits_layers"] == "0,1"
    assert meta["base_artifact"] == f"{ranked.kind} {ranked.identity}"  # the given artifact, not its in-memory copy
    bare = load_artifact(write_artifact(model, tmp_path / "b.safetensors",
                                        tensors={"k_bits": torch.tensor([2, 4], dtype=torch.int32)}, **base))
    with pytest.raises(ValueError, match="no k_gain ranking"):
        calibrate_mix_long(loaded, bare, layers=2, **kw)
    with pytest.raises(ValueError, match="--key-layers"):
        calibrate_mix_long(loaded, ranked, layers=3, **kw)
