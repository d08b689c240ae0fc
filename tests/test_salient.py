"""Salient pages (rotkv.cache.salient): the refine tier's 2 more bits for the body pages a prefill call's last
queries read most."""

import numpy as np
import pytest
import torch

from rotkv.cache import RotkvCache
from rotkv.cache.codecs import make_codecs
from rotkv.cache.layer import HybridLayer
from rotkv.cache.salient import OBSERVE, SalientPages, page_mass
from rotkv.config import CacheSpec
from rotkv.hf.compat import cache_kwarg
from rotkv.kernels.plan import check_graph, plan_step
from rotkv.rotations.registry import build_rotations
from test_refine import nested_reference

H, D, G, P, SINK = 2, 16, 16, 4, 4


def layer(salient: int, refine_tokens: int = 4, values: bool = True):
    spec = CacheSpec(bits=2, group_size=G, sink=SINK, window=8, page_size=P, prefill_chunk=512, tier_dtype="float32",
                     refine_tokens=refine_tokens, refine_values=values, refine_salient=salient)
    rot = build_rotations("hadamard", 1, H, D)[0]
    return HybridLayer(spec, rot, D, H, 0, make_codecs("token", 2, G, 0.9, 1.0)), rot


def prompt(n: int, needles: dict, seed: int = 0, strength: float = 4.0):
    """Keys, values and queries ``[2, H, n, D]``: the last OBSERVE queries of row r, head h point along one
    direction, and the keys of body page ``needles[r, h]`` along it too (``strength``)."""
    g = torch.Generator().manual_seed(seed)
    k, v, q = (torch.randn(2, H, n, D, generator=g) * 0.5 for _ in range(3))
    for (r, h), page in needles.items():
        u = torch.nn.functional.normalize(torch.randn(D, generator=g), dim=0)
        q[r, h, -OBSERVE:] = u * 3
        t0 = SINK + page * P
        k[r, h, t0:t0 + P] = u * strength + 0.1 * torch.randn(P, D, generator=g)
    return k, v, q


def run(lay, k, v, q):
    lay.update(k, v)
    return lay.attend(q.repeat_interleave(2, 1), None, 0.3)  # 2 query heads per KV head, in kv-head order


def salient_tier(lay) -> SalientPages:
    return next(t for t in lay.pools.tiers if isinstance(t, SalientPages))


def test_page_mass_is_the_attention_the_queries_give_each_page():
    g = torch.Generator().manual_seed(1)
    q, x = torch.randn(3, 2, 5, D, generator=g), torch.randn(3, 2, P, D, generator=g)
    s = q @ x.transpose(-1, -2)  # every key of the 3 pages, one softmax per query: they are all the keys
    lse = s.transpose(0, 2).reshape(5 * 2, 3 * P).logsumexp(-1).reshape(5, 2).T  # [H, M]
    got = page_mass(q, lse[None].expand(3, -1, -1), x)
    want = torch.softmax(s.permute(1, 2, 0, 3).reshape(2, 5, 3 * P), -1).reshape(2, 5, 3, P).sum((1, 3)).T
    assert torch.allclose(got, want, atol=1e-5) and torch.allclose(got.sum(0), torch.full((2,), 5.0), atol=1e-4)


def test_the_page_the_last_queries_read_is_refined_and_read_so():
    """Each (row, KV head) keeps the page its last queries point at, its keys and values read on the refined
    grid (the refine tier's nested reference); every other page reads as without salient pages; the bytes count
    the chosen pages' codes and indices; and a decode step attends over those reads."""
    needles = {(0, 0): 3, (0, 1): 5, (1, 0): 1, (1, 1): 3}
    k, v, q = prompt(60, needles)
    sal, rot = layer(1)
    base, _ = layer(0)
    for lay in (sal, base):
        run(lay, k, v, q)
    tier = salient_tier(sal)
    for (r, h), page in needles.items():
        assert int(tier.index[r, h, 0]) == page, (r, h, tier.index[r, h])
    kr, vr = rot.keys(k, torch.float32), rot.values(v, torch.float32)
    for r in range(2):
        ks, vs = sal.read(r)
        bk, bv = base.read(r)
        for h in range(H):
            t0 = SINK + needles[r, h] * P
            want_k, want_v = bk[h].clone(), bv[h].clone()
            want_k[t0:t0 + P] = nested_reference(kr[r, h, t0:t0 + P], sal.key_codec)
            want_v[t0:t0 + P] = nested_reference(vr[r, h, t0:t0 + P], sal.value_codec)
            assert torch.allclose(ks[h], want_k, atol=1e-5) and torch.allclose(vs[h], want_v, atol=1e-5), (r, h)
            assert not torch.allclose(bk[h, t0:t0 + P], want_k[t0:t0 + P], atol=1e-3)  # the page did change
    extra = sal.stats()["body_bytes"] - base.stats()["body_bytes"]
    assert extra == 2 * H * 1 * (4 + 2 * P * D // 4)
    # a decode step: attention over the reads, by hand
    g = torch.Generator().manual_seed(9)
    k1, v1, q1 = (torch.randn(2, H, 1, D, generator=g) for _ in range(3))
    out = run(sal, k1, v1, q1)
    for r in range(2):
        ks, vs = sal.read(r)
        qr = rot.queries(q1[r:r + 1].repeat_interleave(2, 1), torch.float32)[0, :, 0]
        p = torch.softmax((qr[:, None] * ks.repeat_interleave(2, 0)).sum(-1) * 0.3, -1)
        o = rot.outputs((p[:, :, None] * vs.repeat_interleave(2, 0)).sum(1)[None, :, None], torch.float32)[0, :, 0]
        assert torch.allclose(out[r, -1], o, atol=1e-4)


def test_a_page_among_the_newest_is_refined_once():
    """The needle in the newest body page, which the refine ring holds: the reads equal the refine tier's alone."""
    n = 60
    newest = (n - 8 - SINK) // P - 1  # the body pages a 60-token prefill leaves, less one: the newest
    k, v, q = prompt(n, {(r, h): newest for r in range(2) for h in range(H)})
    sal, _ = layer(1)
    base, _ = layer(0)
    for lay in (sal, base):
        run(lay, k, v, q)
    assert (salient_tier(sal).index[:, :, 0] == newest).all()
    assert int(sal.state.body_count[0]) == newest + 1
    for r in range(2):
        for a, b in zip(sal.read(r), base.read(r)):
            assert torch.equal(a, b)


def test_a_decode_flush_is_no_candidate_and_a_new_prompt_drops_the_old_choice():
    sal, _ = layer(1)
    k, v, q = prompt(60, {(r, h): 2 for r in range(2) for h in range(H)}, strength=8.0)
    run(sal, k, v, q)
    tier = salient_tier(sal)
    before = tier.index.clone()
    g = torch.Generator().manual_seed(3)
    for _ in range(2 * P):  # decode steps flush pages out of the window: not candidates
        run(sal, *(torch.randn(2, H, 1, D, generator=g) * 4 for _ in range(3)))
    assert torch.equal(tier.index, before)
    # the rows start again in the same pools (a batch's rows refilled; a cache's reset builds new pools): writing
    # a row's first body page drops what it held, so a weaker needle elsewhere wins over the old, stronger one
    sal.state.reset(2)
    k, v, q = prompt(60, {(r, h): 6 for r in range(2) for h in range(H)}, seed=5, strength=2.0)
    run(sal, k, v, q)
    assert salient_tier(sal) is tier and (tier.index[:, :, 0] == 6).all(), tier.index


def test_kernels_and_graphs_leave_salient_pages_to_the_pytorch_reader():
    assert plan_step(torch.zeros(1, 2, D), None, None, readable=True, salient=True) is None
    with pytest.raises(ValueError, match="salient"):
        check_graph(refine=True, salient=True)
    check_graph(refine=False, salient=False)


def test_salient_spec_errors():
    with pytest.raises(ValueError, match="refine_salient"):
        CacheSpec(bits=2, refine_salient=2)
    with pytest.raises(ValueError, match="refine_salient"):
        CacheSpec(bits=2, refine_tokens=64, refine_salient=-1)
    with pytest.raises(ValueError, match="refine_salient"):
        CacheSpec(bits=2, refine_tokens=64, refine_salient=2, predict_keys=True, rotation="artifact")
    assert CacheSpec(bits=2, refine_tokens=64, refine_salient=2).refine_salient == 2


def test_salient_pages_in_a_model_cache(tiny_llama):
    """Through a model: prefill and decode run, the bytes grow by the chosen pages, and the CUDA-graph decoder
    refuses the cache, naming the pages."""
    ids = torch.randint(0, 100, (2, 150), generator=torch.Generator().manual_seed(0))
    caches = {}
    for s in (0, 2):
        c = RotkvCache(tiny_llama, "quarot-int2", sink=4, window=8, refine_tokens=16, refine_salient=s)
        kw = {cache_kwarg(tiny_llama): c}
        assert tiny_llama(input_ids=ids, use_cache=True, **kw).logits.isfinite().all()
        assert tiny_llama(input_ids=torch.tensor([[5], [7]]), use_cache=True, **kw).logits.isfinite().all()
        caches[s] = c
    layers = sum(1 for layer in caches[2].layers if isinstance(layer, HybridLayer))
    kv = caches[2].layers[0].kv_heads
    d = caches[2].layers[0].head_dim
    assert caches[2].stats()["body_bytes"] - caches[0].stats()["body_bytes"] == layers * 2 * kv * 2 * (4 + 16 * d // 4)
    from rotkv.cache.graph import StaticDecode

    with pytest.raises(ValueError, match="salient"):
        StaticDecode(caches[2], 2, 256)
    np.testing.assert_array_equal(caches[2].state.body_count, caches[0].state.body_count)
