"""Bookkeeping of the paged hybrid layer across the sink / body / window boundaries, on random tensors."""

import pytest
import torch

from rotkv.cache.codecs import make_codecs
from rotkv.cache.layer import HybridLayer
from rotkv.config import CacheSpec
from rotkv.quant.quantizer import dequantize, quantize
from rotkv.rotations.base import LayerRotation

S, W, P, H, D = 4, 8, 4, 2, 16


def make_layer(**kw):
    spec = CacheSpec(bits=2, group_size=16, sink=S, window=W, page_size=P, prefill_chunk=kw.pop("chunk", 512),
                     tier_dtype="float32", **kw)
    return HybridLayer(spec, LayerRotation(), D, H, 0, make_codecs("token", 2, 16, 1.0, 1.0))


def feed(layer, n, step=None, seed=0):
    """Send n tokens (in steps of `step`, default all at once); returns all keys and values sent."""
    g = torch.Generator().manual_seed(seed)
    ks, vs = torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)
    step = step or n
    for i in range(0, n, step):
        k, v = ks[:, :, i:i + step], vs[:, :, i:i + step]
        layer.update(k, v)
        layer.attend(torch.randn(1, H, k.shape[2], D), None, D**-0.5)
    return ks[0], vs[0]


def expected_tiers(n):
    sink = min(n, S)
    rest = n - sink
    body = P * ((rest - W) // P) if rest >= W + P else 0
    return sink, body, rest - body


def tiers(layer, row=0):
    st = layer.state
    sink = int(st.sink_tokens()[row])
    return sink, int(st.body_count[row]) * P, int(st.tier_tokens[row]) - sink


@pytest.mark.parametrize("n", [1, S, S + W, S + W + 1, S + W + P - 1, S + W + P, S + W + P + 1, 200])
@pytest.mark.parametrize("step", [None, 1, 5])
def test_tier_sizes_and_contents(n, step):
    layer = make_layer()
    ks, vs = feed(layer, n, step)
    sink, body, win = expected_tiers(n)
    assert tiers(layer) == (sink, body, win)
    assert W <= win < W + P or n < S + W + P
    assert layer.get_seq_length() == n
    k_read, v_read = layer.read(0)  # decoded from the stored format
    # sink and window are exact; the body equals quantize -> dequantize of the same tokens
    assert torch.equal(k_read[:, :sink], ks[:, :sink]) and torch.equal(k_read[:, sink + body:], ks[:, sink + body:])
    if body:
        ref = dequantize(quantize(ks[:, sink:sink + body], 2, 16))
        assert torch.allclose(k_read[:, sink:sink + body], ref, atol=1e-6)
        ref_v = dequantize(quantize(vs[:, sink:sink + body], 2, 16))
        assert torch.allclose(v_read[:, sink:sink + body], ref_v, atol=1e-6)


def test_byte_accounting_is_measured():
    layer = make_layer()
    feed(layer, 200)
    st = layer.stats()
    sink, body, win = expected_tiers(200)
    assert st["tier_bytes"] == 2 * (sink + win) * H * D * 4  # float32 tiers in this test
    # INT2 codes (D/4 bytes) + fp16 scale and lo per 16-dim group, for K and V
    assert st["body_bytes"] == 2 * body * H * (D // 4 + 2 * 2 * (D // 16))
    assert st["pool_bytes"] >= st["body_bytes"] + st["tier_bytes"]


def test_bf16_spec_keeps_everything_unquantized():
    spec = CacheSpec(bits=None, sink=S, window=W, page_size=P, tier_dtype="float32")
    layer = HybridLayer(spec, LayerRotation(), D, H, 0, None)
    ks, _ = feed(layer, 100, 7)
    assert layer.state.body_count[0] == 0
    assert torch.equal(layer.read(0)[0], ks)


def test_prefill_chunks_see_the_quantized_cache():
    """A one-call prefill with chunk C equals sending the same tokens in calls of C tokens."""
    a, b = make_layer(chunk=16), make_layer()
    g = torch.Generator().manual_seed(1)
    k, v, q = (torch.randn(1, H, 64, D, generator=g) for _ in range(3))
    a.update(k, v)
    out_a = a.attend(q, None, 0.25)
    outs = []
    for i in range(0, 64, 16):
        b.update(k[:, :, i:i + 16], v[:, :, i:i + 16])
        outs.append(b.attend(q[:, :, i:i + 16], None, 0.25))
    assert torch.allclose(out_a, torch.cat(outs, 1), atol=1e-6)
    assert torch.equal(a.read(0)[0], b.read(0)[0])


def test_left_padding_rows_match_single_rows():
    layer, alone = make_layer(), make_layer()
    g = torch.Generator().manual_seed(2)
    k, v, q = (torch.randn(2, H, 40, D, generator=g) for _ in range(3))
    real = torch.ones(2, 40, dtype=torch.bool)
    real[1, :13] = False  # row 1 has 13 pads on the left
    layer.update(k, v)
    out = layer.attend(q, real, 0.25)
    alone.update(k[1:, :, 13:], v[1:, :, 13:])
    ref = alone.attend(q[1:, :, 13:], None, 0.25)
    assert torch.allclose(out[1, 13:], ref[0], atol=1e-6)
    assert torch.equal(out[1, :13], torch.zeros_like(out[1, :13]))
    assert layer.state.lengths().tolist() == [40, 27]


def test_right_padding_is_refused():
    layer = make_layer()
    k = torch.randn(1, H, 5, D)
    layer.update(k, k)
    with pytest.raises(ValueError, match="left padding"):
        layer.attend(torch.randn(1, H, 5, D), torch.tensor([[True, True, False, True, True]]), 0.25)


def test_nan_in_states_is_refused_and_nothing_else_changes():
    layer = make_layer()
    feed(layer, S + W + P)  # a page is about to leave the window
    before = layer.read(0)[0].clone()
    pages = layer.state.tier_free.used, layer.state.body_free.used
    k = torch.randn(1, H, P, D)
    k[0, 1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):  # refused where it arrives (the update)
        layer.update(k, k)
    assert layer.pending is None
    assert torch.equal(layer.read(0)[0], before)
    assert (layer.state.tier_free.used, layer.state.body_free.used) == pages
    assert layer.get_seq_length() == S + W + P
    feed(layer, 3, seed=5)  # and it keeps working
    assert layer.get_seq_length() == S + W + P + 3
