"""HybridLayer.attend(output=False) (the key-width search's shared first chunk): the same stores, no output."""

import pytest
import torch

from test_cache_layer import D, H, make_layer


@pytest.mark.parametrize("chunk,steps", [(512, [64]), (16, [64]), (16, [40, 1, 1, 7, 1])])
def test_store_only_attend_stores_what_attend_stores(chunk, steps):
    a, b = make_layer(chunk=chunk), make_layer(chunk=chunk)
    g = torch.Generator().manual_seed(3)
    for n in steps:
        k, v, q = (torch.randn(2, H, n, D, generator=g) for _ in range(3))
        for layer in (a, b):
            layer.update(k, v)
        assert a.attend(q, None, 0.25).shape == (2, n, H, D)
        assert b.attend(q, None, 0.25, output=False) is None
    for row in range(2):
        for x, y in zip(a.read(row), b.read(row)):
            assert torch.equal(x, y)
    # and attention afterwards reads the same cache
    k, v, q = (torch.randn(2, H, 1, D, generator=g) for _ in range(3))
    outs = []
    for layer in (a, b):
        layer.update(k, v)
        outs.append(layer.attend(q, None, 0.25))
    assert torch.equal(*outs)
