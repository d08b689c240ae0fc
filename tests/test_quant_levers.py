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
