"""The refine tier (rotkv.cache.refine): 2 more bits for the keys of each row's newest body pages."""

import sys

import numpy as np
import pytest
import torch

from rotkv import switches
from rotkv.cache import RotkvCache
from rotkv.cache.codecs import TokenCodec, make_codecs
from rotkv.cache.layer import HybridLayer
from rotkv.cache.refine import RefineRing, newest_pages, ring_writes
from rotkv.quant.refine import refine_codes, refine_delta, refined_pages
from rotkv.config import CacheSpec
from rotkv.hf.compat import cache_kwarg
from rotkv.rotations.registry import build_rotations

H, D, G = 2, 16, 16


def nested_reference(x: torch.Tensor, codec: TokenCodec) -> torch.Tensor:
    """The refined reading of exact rows ``x [..., D]``, written from the format's definition: the 2-bit
    code h and its group's (s, lo), then the nearest of the points lo + s * (h + (j - 1.5) / 4), j = 0..3."""
    from rotkv.quant.packing import unpack
    from rotkv.quant.quantizer import quantize

    q = quantize(x, 2, codec.group_size, codec.clip, codec.meta)
    h = unpack(q.codes, 2).float().reshape(*x.shape[:-1], -1, codec.group_size)
    s, lo = q.scale.float().unsqueeze(-1), q.lo.float().unsqueeze(-1)
    points = lo.unsqueeze(-1) + s.unsqueeze(-1) * (h.unsqueeze(-1) + (torch.arange(4.0) - 1.5) / 4)  # [..., G, 4]
    xs = x.float().reshape(h.shape).unsqueeze(-1)
    best = (points - xs).abs().argmin(-1, keepdim=True)
    return points.gather(-1, best).squeeze(-1).reshape(x.shape)


def test_refine_codes_pick_the_nearest_point_of_the_bucket():
    codec = TokenCodec(2, G, 0.9)
    x = torch.randn(5, 3, 7, D, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.2, 3, D)
    enc = codec.encode(x)
    base = codec.decode(enc)
    got = base + refine_delta(refine_codes(x, base, enc["scale"], G), enc["scale"], G)
    assert torch.allclose(got, nested_reference(x, codec), atol=1e-6)
    # never further from x than the 2-bit reading, beyond the s/8 of an element the 2-bit code hits exactly
    s = enc["scale"].float().repeat_interleave(G, -1)
    assert ((got - x).abs() <= (base - x).abs() + s / 8 + 1e-5).all()
    assert ((got - x) ** 2).mean() < ((base - x) ** 2).mean() / 2  # clipped elements move 3/8 s at most
    # unclipped: a 4-bit grid of step s / 4, so every error is at most s / 8 (~16x less MSE than 2 bits)
    codec = TokenCodec(2, G, 1.0)
    enc = codec.encode(x)
    base = codec.decode(enc)
    got = base + refine_delta(refine_codes(x, base, enc["scale"], G), enc["scale"], G)
    s = enc["scale"].float().repeat_interleave(G, -1)
    assert ((got - x).abs() <= s / 8 + 1e-5).all()
    assert ((got - x) ** 2).mean() < ((base - x) ** 2).mean() / 8


def test_newest_pages():
    rows, idx = newest_pages(np.array([0, 2, 7, 3]), 3)
    assert rows.tolist() == [1, 1, 2, 2, 2, 3, 3, 3] and idx.tolist() == [0, 1, 4, 5, 6, 0, 1, 2]
    # the size rule: one refined page per `every` body pages, at most k
    assert refined_pages(np.array([0, 1, 2, 3, 4, 7, 40]), 3, 2).tolist() == [0, 1, 1, 2, 2, 3, 3]
    assert refined_pages(5, 8, 0) == 5 and refined_pages(5, 8, 1) == 5 and refined_pages(5, 8, 4) == 2
    rows, idx = newest_pages(np.array([0, 2, 7, 3]), 3, every=3)
    assert rows.tolist() == [1, 2, 2, 2, 3] and idx.tolist() == [1, 4, 5, 6, 2]


def test_ring_growth_moves_every_rows_pages_to_their_new_slots():
    ring = RefineRing(4, 1, 2, 8, 8, "cpu")
    ring.fit(2)
    ring.grow(np.array([0, 0]), 2)  # rows of up to 2 pages: 2 slots
    assert ring.pages == 2 and ring.data.shape == (2, 2, 1, 2, 2)
    # row 0 holds pages 0..4 (the ring keeps 3 and 4), row 1 page 0: page i's bytes are i + 10 * row
    counts = np.array([5, 1])
    for row, n in enumerate(counts):
        for i in range(max(0, n - 2), n):
            ring.data[row, i % 2] = i + 10 * row
    ring.grow(counts, 6)  # a flush takes row 0 to 6 pages: 4 slots, the cap
    assert ring.pages == 4 and ring.data.shape[1] == 4
    assert ring.data[0, 3 % 4].unique().tolist() == [3] and ring.data[0, 4 % 4].unique().tolist() == [4]
    assert ring.data[1, 0].unique().tolist() == [10]
    ring.grow(counts, 40)  # never past the cap
    assert ring.pages == 4
    ring.fit(3)  # a new batch starts at one slot again
    assert ring.pages == 1 and ring.data.shape[:2] == (3, 1)


def test_ring_writes_keep_each_rows_newest_pages_of_a_flush():
    # a prefill flushes rows 0 and 2 many pages at once: a 2-slot ring keeps the newest 2 of each
    rows = np.array([0, 0, 0, 0, 2, 2, 2, 1])
    index = np.array([3, 4, 5, 6, 0, 1, 2, 9])
    assert ring_writes(rows, index, 2).tolist() == [2, 3, 5, 6, 7]
    assert ring_writes(rows, index, 4) is None  # every page has a slot of its own
    assert ring_writes(np.array([], dtype=np.int64), np.array([], dtype=np.int64), 2) is None


def refined_layer(refine_tokens, sink=4, window=8, page=4, chunk=512, share=0.0, values=False, every=0):
    spec = CacheSpec(bits=2, group_size=G, sink=sink, window=window, page_size=page, prefill_chunk=chunk,
                     tier_dtype="float32", window_share=share, refine_tokens=refine_tokens, refine_values=values,
                     refine_every=every)
    rot = build_rotations("hadamard", 1, H, D)[0]
    return HybridLayer(spec, rot, D, H, 0, make_codecs("token", 2, G, 0.9, 1.0)), rot


@pytest.mark.parametrize("refine,sink,window,page,chunk,share,values,every", [
    (8, 4, 8, 4, 512, 0.0, False, 0), (12, 3, 8, 4, 16, 0.0, False, 0), (5, 0, 5, 4, 7, 0.0, False, 0),
    (16, 4, 3, 4, 16, 0.25, False, 0), (100, 2, 4, 4, 9, 0.0, False, 0),
    (8, 4, 8, 4, 512, 0.0, True, 0), (12, 3, 8, 4, 16, 0.0, True, 0), (16, 4, 3, 4, 16, 0.25, True, 0),
    (100, 2, 4, 4, 9, 0.0, True, 3), (24, 4, 8, 4, 16, 0.0, False, 2),  # the size rule: one per 3 (2) body pages
])
def test_refined_layer_reads_and_attends_the_nested_keys(refine, sink, window, page, chunk, share, values, every,
                                                         monkeypatch):
    """Ragged prefill, decode steps and short calls: every row reads its newest ceil(refine / page) body
    pages' keys refined (with ``every``, min of that and ceil(body pages / every); written from the exact
    rotated keys), older ones as the plain 2-bit body, the values and tiers as without the tier; each decode
    step's attention is dense attention over those reads; the bytes count 2 bits per key element of the
    refined pages (``values``: the same for the values); and no ring write puts two pages in one slot (a
    prefill flushes many pages of a row at once, and which write lands is undefined on the GPU)."""
    write = RefineRing.write

    def checked_write(ring, x, base, scale, rows, index):
        slots = rows * ring.pages + index % ring.pages
        assert len(torch.unique(slots)) == len(slots), "two pages written to one ring slot"
        return write(ring, x, base, scale, rows, index)

    monkeypatch.setattr(RefineRing, "write", checked_write)
    paged, rot = refined_layer(refine, sink, window, page, chunk, share, values, every)
    plain, _ = refined_layer(0, sink, window, page, chunk, share)
    codec = paged.key_codec
    kpages = -(-refine // page)
    g = torch.Generator().manual_seed(refine + chunk)
    b = 3
    exact = [[] for _ in range(b)]  # every row's real rotated keys in order
    exact_v = [[] for _ in range(b)]
    checked = 0
    for i, n in enumerate([45, 1, 1, 3, 1, 17, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 9, 1]):
        k, v, q = (torch.randn(b, H, n, D, generator=g) for _ in range(3))
        real = None
        if i == 0:
            real = torch.ones(b, n, dtype=torch.bool)
            real[1, :13], real[2, :44] = False, False
        kr, vr = rot.keys(k, torch.float32), rot.values(v, torch.float32)
        for r in range(b):
            keep = real[r] if real is not None else torch.ones(n, dtype=torch.bool)
            exact[r].append(kr[r][:, keep])
            exact_v[r].append(vr[r][:, keep])
        counts = paged.state.body_count.copy() if paged.is_initialized else np.zeros(b, dtype=np.int64)
        outs = []
        for layer in (paged, plain):
            layer.update(k, v)
            outs.append(layer.attend(q.repeat(1, 2, 1, 1), real, 0.3))
        st = paged.state
        for r in range(b):
            ks, vs = paged.read(r)
            pk, pv = plain.read(r)
            allk = torch.cat(exact[r], 1)
            s, nb = int(st.sink_tokens()[r]), int(st.body_count[r])
            want = pk.clone()
            first = nb - refined_pages(nb, kpages, every)
            lo, hi = s + first * page, s + nb * page
            want_v = pv.clone()
            if hi > lo:
                want[:, lo:hi] = nested_reference(allk[:, lo:hi], codec)
                if values:
                    want_v[:, lo:hi] = nested_reference(torch.cat(exact_v[r], 1)[:, lo:hi], paged.value_codec)
            assert torch.allclose(ks, want, atol=1e-5), (i, r)
            assert torch.allclose(vs, want_v, atol=1e-5) if values else torch.equal(vs, pv), (i, r)
            if nb > kpages:  # older pages read exactly as the plain body
                assert torch.equal(ks[:, s:lo], pk[:, s:lo])
            if n > 1 or nb != counts[r]:  # a prefill call attends its own tokens exactly; a decode step reads what
                continue  # is stored, and a page it flushes was still in the tier when it attended
            # the decode step's query against the row's reads, by hand
            qr = rot.queries(q[r:r + 1, :, -1:].repeat(1, 2, 1, 1), torch.float32)[0, :, 0]  # [Hq, D]
            kk = ks.repeat_interleave(2, 0)
            p = torch.softmax((qr[:, None] * kk).sum(-1) * 0.3, -1)
            o = rot.outputs((p[:, :, None] * vs.repeat_interleave(2, 0)).sum(1)[None, :, None], torch.float32)[0, :, 0]
            assert torch.allclose(outs[0][r, -1], o, atol=1e-4), (i, r, (outs[0][r, -1] - o).abs().max())
            checked += int(nb > 0)
    assert checked >= 10  # decode steps over a refined body were compared
    n_refined = int(refined_pages(paged.state.body_count, kpages, every).sum())
    if every:  # the rule refines fewer pages than the cap at the end: it was exercised
        assert n_refined < int(np.minimum(paged.state.body_count, kpages).sum())
    extra = paged.stats()["body_bytes"] - plain.stats()["body_bytes"]
    assert extra == n_refined * H * page * D // 4 * (2 if values else 1)
    # the rings hold what is counted: as many slots as the longest row reads (they grew from one)
    for ring in paged.pools.refine_rings:
        assert ring.pages == refined_pages(int(paged.state.body_count.max()), kpages, every)
        assert ring.data.shape[1] == ring.pages  # 2 bits per refined element, no metadata


def test_refine_tier_in_a_model_cache(tiny_llama, monkeypatch):
    """Through a model: the refine tier changes the logits (less error than without it), survives
    row edits (each row keeps its own ring) and counts its bytes; a refined cache is refused by the
    CUDA-graph decoder with a message that names the tier."""
    ids = torch.randint(0, 100, (2, 150), generator=torch.Generator().manual_seed(0))
    logits = {}
    caches = {}
    for rt in (0, 64):
        c = RotkvCache(tiny_llama, "quarot-int2", sink=4, window=8, refine_tokens=rt)
        kw = {cache_kwarg(tiny_llama): c}
        out = tiny_llama(input_ids=ids, use_cache=True, **kw)
        nxt = torch.tensor([[5], [7]])
        logits[rt] = [tiny_llama(input_ids=nxt, use_cache=True, **kw).logits[:, -1]]
        caches[rt] = c
        assert out.logits.isfinite().all()
    c = caches[64]
    assert c.stats()["body_bytes"] > caches[0].stats()["body_bytes"]
    before = [layer.read(1) for layer in c.layers]
    c.reorder_cache(torch.tensor([1, 1]))  # row 1 twice: both rows read row 1's tokens, refinements included
    for layer, (k, v) in zip(c.layers, before):
        for row in (0, 1):
            k2, v2 = layer.read(row)
            assert torch.equal(k2, k) and torch.equal(v2, v)
    from rotkv.cache.graph import StaticDecode

    switches.configure(refine_kernel=False)  # the kernel turned off: the graph cannot read the tier
    with pytest.raises(ValueError, match="refine tier"):
        StaticDecode(c, 2, 256)
    cv = RotkvCache(tiny_llama, "quarot-int2", sink=4, window=8, refine_tokens=64, refine_values=True)
    out = tiny_llama(input_ids=ids, use_cache=True, **{cache_kwarg(tiny_llama): cv})
    assert out.logits.isfinite().all() and cv.stats()["body_bytes"] > c.stats()["body_bytes"]
    with pytest.raises(ValueError, match="refine tier"):
        StaticDecode(cv, 2, 256)


def test_refine_spec_errors():
    with pytest.raises(ValueError, match="refine_tokens"):
        CacheSpec(bits=4, refine_tokens=64)
    with pytest.raises(ValueError, match="refine_tokens"):
        CacheSpec(bits=2, codec="kivi", rotation="identity", refine_tokens=64)
    with pytest.raises(ValueError, match="refine_tokens"):
        CacheSpec(bits=2, refine_tokens=-1)
    with pytest.raises(TypeError, match="refine_tokens"):
        CacheSpec(bits=2, refine_tokens="64")
    with pytest.raises(ValueError, match="refine_values"):
        CacheSpec(bits=2, refine_values=True)
    with pytest.raises(ValueError, match="refine_every"):
        CacheSpec(bits=2, refine_every=16)
    with pytest.raises(ValueError, match="refine_every"):
        CacheSpec(bits=2, refine_tokens=64, refine_every=-1)
    assert CacheSpec(bits=2, refine_tokens=64).refine_tokens == 64


def test_four_bit_key_layers_have_no_ring():
    """Layers whose keys are at 4 bits ignore the tier (no ring, no bytes)."""
    spec = CacheSpec(bits=2, group_size=G, sink=2, window=4, page_size=4, tier_dtype="float32", refine_tokens=8,
                     k_bits="0:4")
    rot = build_rotations("hadamard", 1, H, D)[0]
    layer = HybridLayer(spec, rot, D, H, 0, make_codecs("token", 2, G, 0.9, 1.0, key_bits=4))
    k = torch.randn(1, H, 30, D)
    layer.update(k, k)
    layer.attend(torch.randn(1, 4, 30, D), None, 0.3)
    assert layer.pools.refine is None


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
