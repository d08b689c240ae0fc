"""The PyTorch reader of the paged layer decodes the body a chunk of pages at a time and keeps no
float32 copy of it: what the pools hold is what the cache holds."""

import numpy as np
import pytest
import torch

import rotkv.cache.layer as layer_mod
import rotkv.cache.pools as pools_mod
from rotkv.cache.codecs import make_codecs
from rotkv.cache.layer import HybridLayer
from rotkv.config import CacheSpec
from rotkv.eval import peers
from rotkv.rotations.registry import build_rotations

H, D, G = 2, 16, 16


def make_layer(refine=0, values=False, tier="float32", k_bits=None):
    spec = CacheSpec(bits=2, group_size=G, sink=3, window=8, page_size=4, prefill_chunk=24, tier_dtype=tier,
                     refine_tokens=refine, refine_values=values)
    rot = build_rotations("hadamard", 1, H, D)[0]
    return HybridLayer(spec, rot, D, H, 0, make_codecs("token", 2, G, 0.9, 1.0, key_bits=k_bits))


def run(layer, seed=0, calls=(70, 1, 1, 5, 1, 1, 1, 1)):
    """Outputs of a ragged prefill (rows with 0, 13 and 40 pads), a short call and decode steps."""
    g = torch.Generator().manual_seed(seed)
    outs, b = [], 3
    for i, n in enumerate(calls):
        k, v, q = (torch.randn(b, H, n, D, generator=g) for _ in range(3))
        real = None
        if i == 0:
            real = torch.ones(b, n, dtype=torch.bool)
            real[1, :13], real[2, :40] = False, False
        layer.update(k, v)
        outs.append(layer.attend(q.repeat(1, 2, 1, 1), real, 0.3))
    return outs


@pytest.mark.parametrize("refine,values,k_bits", [(0, False, None), (0, False, 4), (12, False, None), (12, True, None)])
@pytest.mark.parametrize("pages", [1, 3])
def test_chunked_reads_equal_a_whole_body_read(refine, values, k_bits, pages, monkeypatch):
    """Chunks of 1 or 3 body pages (rows of up to 17 body pages, refined or not, 2- or 4-bit keys) give the
    outputs of one read of the whole body, within float32 rounding (the sum over chunks is regrouped)."""
    whole = run(make_layer(refine, values, k_bits=k_bits))
    for mod in (layer_mod, pools_mod):
        monkeypatch.setattr(mod, "READ_PAGES", pages)
    chunked_layer = make_layer(refine, values, k_bits=k_bits)
    chunked = run(chunked_layer)
    assert int(chunked_layer.state.body_count.max()) > 3 * pages  # several chunks were read
    for a, b in zip(whole, chunked):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()


def test_a_chunk_as_large_as_the_body_is_bit_exact(monkeypatch):
    """A body within one chunk is read in one piece: the same operations, bit for bit."""
    ref = run(make_layer(12))
    monkeypatch.setattr(layer_mod, "READ_PAGES", 10**6)
    monkeypatch.setattr(pools_mod, "READ_PAGES", 10**6)
    for a, b in zip(ref, run(make_layer(12))):
        assert torch.equal(a, b)


def test_decode_reads_match_dense_attention_over_the_stored_tokens(monkeypatch):
    """A decode step read in chunks of 2 pages is softmax attention over ``read`` (the whole row decoded)."""
    for mod in (layer_mod, pools_mod):
        monkeypatch.setattr(mod, "READ_PAGES", 2)
    layer = make_layer(12, True)
    run(layer, calls=(70,))
    g = torch.Generator().manual_seed(5)
    k, v, q = (torch.randn(3, H, 1, D, generator=g) for _ in range(3))
    q = q.repeat(1, 2, 1, 1)
    rot = layer.rotation
    before = [layer.read(r) for r in range(3)]  # what is stored before the step (a flush after it changes that)
    layer.update(k, v)
    out = layer.attend(q, None, 0.3)  # [B, 1, Hq, D]
    qr, kr, vr = rot.queries(q, torch.float32), rot.keys(k, torch.float32), rot.values(v, torch.float32)
    for r in range(3):
        ks = torch.cat([before[r][0], kr[r]], 1).repeat_interleave(2, 0)  # the new token at tier precision
        vs = torch.cat([before[r][1], vr[r]], 1).repeat_interleave(2, 0)
        p = (torch.einsum("hd,hnd->hn", qr[r, :, 0], ks) * 0.3).softmax(-1)
        want = rot.outputs(torch.einsum("hn,hnd->hd", p, vs)[None, :, None], torch.float32)[0, :, 0]
        assert torch.allclose(out[r, 0], want, atol=1e-5), r


def test_the_layer_holds_its_pools_and_nothing_else():
    """2-bit body, bf16 tiers: the resident bytes are the pools' (no float32 copy of the body), well under
    the bf16 bytes of the same tokens."""
    layer = make_layer(tier="bfloat16")
    run(layer, calls=(600, 1, 1))
    st = layer.stats()
    assert st["scratch_bytes"] == 0 and st["resident_bytes"] == st["pool_bytes"] == layer.pools.nbytes()
    bf16 = st["elements"] * 2
    assert st["body_bytes"] + st["tier_bytes"] <= st["resident_bytes"] < 0.5 * bf16, (st, bf16)
    assert peers.resident_bytes([layer.pools])["kv_bytes"] == st["resident_bytes"]  # every tensor the pools reach
    assert np.all(layer.state.body_count > 100)
