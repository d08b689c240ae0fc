"""The paged layer against the per-row reference layer, and the page bookkeeping (free lists, row edits)."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st_h

from rotkv.cache import RotkvCache
from rotkv.cache.codecs import make_codecs
from rotkv.cache.layer import HybridLayer
from rotkv.cache.plan import FreeList, PageState
from rotkv.cache.rowstore import RowStoreLayer
from rotkv.config import CacheSpec
from rotkv.generation import generate_batch
from rotkv.hf.compat import cache_kwarg
from rotkv.rotations.registry import build_rotations

H, D = 2, 16


def pair(sink, window, page, chunk, codec="token", bits=2, share=0.0):
    spec = CacheSpec(bits=bits, group_size=16, sink=sink, window=window, page_size=page, prefill_chunk=chunk,
                     tier_dtype="float32", codec=codec, window_share=share)
    rot = build_rotations("hadamard" if codec == "token" else "identity", 1, H, D)[0]
    codecs = make_codecs(codec, bits, 16, 0.9 if codec == "token" else 1.0, 1.0)
    return HybridLayer(spec, rot, D, H, 0, codecs), RowStoreLayer(spec, rot, D, H, 0, codecs)


@pytest.mark.parametrize("sink,window,page,chunk,codec,share", [
    (4, 8, 4, 512, "token", 0.0), (3, 8, 4, 16, "token", 0.0), (0, 5, 4, 7, "token", 0.0), (5, 3, 4, 9, "token", 0.0),
    (0, 8, 4, 16, "kivi", 0.0), (17, 6, 8, 40, "token", 0.0),
    # a window that grows with the row (window_share): rows of different lengths keep different windows
    (4, 3, 4, 16, "token", 0.25), (0, 2, 4, 512, "token", 0.15), (3, 4, 4, 7, "token", 0.3),
])
def test_paged_layer_equals_the_row_reference(sink, window, page, chunk, codec, share):
    """Ragged left-padded prefill, then decode steps and short multi-token calls: same outputs, same
    stored tokens, same byte accounting as the per-row layer."""
    paged, ref = pair(sink, window, page, chunk, codec, share=share)
    g = torch.Generator().manual_seed(sink * 7 + chunk)
    b = 3
    for i, n in enumerate([45, 1, 1, 3, 1, 17, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1]):
        k, v, q = (torch.randn(b, H, n, D, generator=g) for _ in range(3))
        real = None
        if i == 0:
            real = torch.ones(b, n, dtype=torch.bool)
            real[1, :13], real[2, :44] = False, False
        outs = []
        for layer in (paged, ref):
            layer.update(k, v)
            outs.append(layer.attend(q.repeat(1, 2, 1, 1), real, 0.3))
        assert torch.allclose(outs[0], outs[1], atol=1e-5), (i, (outs[0] - outs[1]).abs().max())
    for row in range(b):
        for got, want in zip(paged.read(row), ref.read(ref.rows[row])):
            assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    s_paged, s_ref = paged.stats(), ref.stats()
    for key in ("tokens", "body_tokens", "body_bytes", "tier_bytes"):
        assert s_paged[key] == s_ref[key], key


def test_free_list_hands_out_low_ids_and_grows():
    fl = FreeList(4)
    assert fl.alloc(3).tolist() == [0, 1, 2]
    fl.free(np.array([1]))
    assert fl.alloc(2).tolist() == [1, 3]
    got = fl.alloc(3)  # the stack is empty: it grows
    assert fl.capacity >= 7 and sorted(got.tolist()) == [4, 5, 6]
    assert fl.used == 7


def test_pages_return_to_the_free_list():
    st = PageState(sink=4, window=8, page_size=4, quantized=True, chunk=64)
    st.reset(2)
    st.plan(40, np.array([40, 25]))
    used = (st.tier_free.used, st.body_free.used)
    assert used[1] == int(st.body_count.sum()) and used[0] == int(st.tier_used_pages().sum())
    st.select_rows(np.array([1]))  # row 0 leaves: its pages come back
    assert st.body_free.used == int(st.body_count.sum()) and st.tier_free.used == int(st.tier_used_pages().sum())
    st.select_rows(np.array([0, 0]))  # a row twice: the copy gets its own pages
    assert st.body_free.used == 2 * st.body_count[0] and len(set(st.body_pages[0, :st.body_count[0]]) &
                                                                 set(st.body_pages[1, :st.body_count[1]])) == 0
    st.reset(0)
    assert st.tier_free.used == 0 and st.body_free.used == 0


def test_decode_pages_are_recycled():
    """Tier pages that leave the window are reused: a long decode keeps the tier pool bounded."""
    st = PageState(sink=4, window=8, page_size=4, quantized=True, chunk=64)
    st.reset(1)
    st.plan(10, np.array([10]))
    for _ in range(20):
        st.plan(1, np.array([1]))
    cap = st.tier_free.capacity
    for _ in range(180):
        st.plan(1, np.array([1]))
        assert st.tier_free.used <= 1 + 3 + 1  # sink page, window W + P - 1 tokens, the next page
    assert st.tier_free.capacity == cap and st.body_count[0] == (210 - 4 - 8) // 4


def _greedy(model, cache, ids, n, mask=None):
    return generate_batch(model, ids, cache, n, attention_mask=mask).tokens


def test_batched_generation_matches_transformers_cache(tiny_llama):
    """rotkv's bf16 preset (float32 tiers) generates what transformers' DynamicCache does, batched
    and left padded; the INT2 preset runs the same loop."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 128, (3, 50), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :30] = 0
    want = _greedy(tiny_llama, DynamicCache(config=tiny_llama.config), ids, 12, mask)
    got = _greedy(tiny_llama, RotkvCache(tiny_llama, "bf16", tier_dtype="float32", prefill_chunk=16), ids, 12, mask)
    assert torch.equal(got, want)
    cache = RotkvCache(tiny_llama, "quarot-int2", sink=4, window=8, page_size=4, group_size=16, prefill_chunk=16)
    out = _greedy(tiny_llama, cache, ids, 12, mask)
    assert out.shape == (3, 12) and cache.stats()["body_bytes"] > 0


def test_beam_search_copies_pages(tiny_llama):
    """transformers' beam search reorders rows through the cache: it runs, and pages stay unshared."""
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = RotkvCache(tiny_llama, "quarot-int2", sink=4, window=8, page_size=4, group_size=16)
    out = tiny_llama.generate(input_ids=ids, max_new_tokens=6, num_beams=3, do_sample=False, pad_token_id=0,
                              **{cache_kwarg(tiny_llama): cache})
    assert out.shape[1] == 46
    st = cache.state
    pages = [p for r in range(st.rows) for p in st.body_pages[r, :st.body_count[r]]]
    assert len(pages) == len(set(pages))


@pytest.mark.parametrize("chunk", [128, 4096])
def test_a_long_prefill_needs_no_tier_pages_for_its_chunks(chunk):
    """A prefill step's tokens that leave the window go straight to the body: the tier pool holds
    sink + window (+ one page) per row whatever the chunk, not the chunk and not the prompt."""
    st = PageState(sink=16, window=64, page_size=16, quantized=True, chunk=chunk)
    st.reset(4)
    st.plan(4096, np.full(4, 4096))
    per_row = 1 + (64 + 16 - 1) // 16  # the sink page, the window's W..W+P-1 tokens
    assert st.tier_free.capacity <= 4 * per_row
    assert st.body_count.tolist() == [(4096 - 16 - 64) // 16] * 4


def test_a_growing_window_keeps_its_share_of_each_row():
    """window_share: each row keeps max(window, ceil(share * tokens)) recent tokens unquantized (up to
    a page more before a flush), and the tier reservation covers the largest window."""
    st = PageState(sink=16, window=32, page_size=16, quantized=True, chunk=4096, window_share=1 / 64)
    st.reset(3)
    n = np.array([2048, 4096, 8192])
    st.plan(8192, n)
    win = st.tier_tokens - 16
    want = np.maximum(32, np.ceil(n / 64)).astype(int)
    assert ((win >= want) & (win < want + 16)).all(), (win, want)
    assert st.body_count.tolist() == ((n - 16 - win) // 16).tolist()
    for _ in range(64):  # decode: the windows grow by one token every 64
        st.plan(1, np.ones(3, dtype=np.int64))
    win, n = st.tier_tokens - 16, n + 64
    want = np.maximum(32, np.ceil(n / 64)).astype(int)
    assert ((win >= want) & (win < want + 16)).all(), (win, want)
    assert st.tier_pages_for(8192 + 64) == 1 + -(-(129 + 16) // 16) + 1
    with pytest.raises(ValueError, match="window_share"):
        CacheSpec(window_share=1.0)
    with pytest.raises(ValueError, match="budget_tokens"):
        CacheSpec(window_share=0.1, budget_tokens=128)


@pytest.mark.parametrize("share", [0.0, 1 / 64, 0.2])
def test_the_graph_reservation_holds_every_decode_step(share):
    """What a CUDA-graph decode reserves per row (tier_pages_for(max_len) pages; the graph sizes its
    grid by them) covers the tier of every step up to max_len, and the eager flush never needs more
    pages than that per row (checked on the host: the graph itself needs CUDA)."""
    max_len = 1500
    st = PageState(sink=16, window=32, page_size=16, quantized=True, chunk=512, window_share=share)
    st.reset(2)
    n = np.array([300, 700])
    st.plan(512, np.minimum(n, 512))
    st.plan(512, np.maximum(n - 512, 0))
    cap = st.tier_pages_for(max_len)
    while st.lengths().max() < max_len:
        step = st.plan(1, np.ones(2, dtype=np.int64))[-1]
        t = st.tables(step, "cpu")
        assert t.tier_max <= cap * 16, (st.lengths(), t.tier_max, cap)
        assert (st.tier_used_pages() <= cap).all()


def _select(layer, index):
    """What RotkvCache does for its layers: one page-list edit, then the page copies."""
    copies = layer.state.select_rows(np.asarray(index))
    layer.pools.fit(layer.state.tier_free.capacity, layer.state.body_free.capacity)
    layer.pools.copy_pages(*(torch.as_tensor(c) for c in copies))


def _check_pages(st):
    """Every used page belongs to exactly one row; every other page is on the free list."""
    tier = [p for r in range(st.rows) for p in st.tier_pages[r, :st.tier_used_pages()[r]]]
    body = [p for r in range(st.rows) for p in st.body_pages[r, :st.body_count[r]]]
    assert len(tier) == len(set(tier)) == st.tier_free.used
    assert len(body) == len(set(body)) == st.body_free.used
    free = set(st.tier_free._stack[:st.tier_free._top].tolist())
    assert not free & set(tier) and len(free) == st.tier_free.free_count


@settings(max_examples=25, deadline=None)
@given(st_h.lists(st_h.tuples(st_h.sampled_from(["prefill", "decode", "select", "reset"]),
                              st_h.integers(0, 10**6)), min_size=1, max_size=12))
def test_churn_keeps_pages_and_contents_consistent(ops):
    """Random calls, ragged prefills, row removal and duplication, resets: the paged layer keeps
    what the per-row layer keeps, and no page is lost or shared."""
    paged, ref = pair(sink=5, window=6, page=4, chunk=9)
    rows = 2
    for op, seed in ops:
        g = torch.Generator().manual_seed(seed)
        if op == "reset":
            paged.reset(), ref.reset()
            continue
        if op == "select":
            if not paged.is_initialized or paged.state.rows == 0:
                continue
            n = paged.state.rows
            index = torch.randint(0, n, (int(torch.randint(1, 4, (1,), generator=g)),), generator=g).tolist()
            _select(paged, index)
            ref.reorder_cache(torch.tensor(index))
            rows = len(index)
        else:
            b = paged.state.rows if paged.is_initialized and paged.state.rows else rows
            q = 1 if op == "decode" else int(torch.randint(1, 30, (1,), generator=g))
            k, v, x = (torch.randn(b, H, q, D, generator=g) for _ in range(3))
            real = None
            if op == "prefill":
                real = torch.ones(b, q, dtype=torch.bool)
                for i in range(b):
                    real[i, : int(torch.randint(0, q, (1,), generator=g))] = False
            outs = []
            for layer in (paged, ref):
                layer.update(k, v)
                outs.append(layer.attend(x.repeat(1, 2, 1, 1), real, 0.3))
            assert torch.allclose(outs[0], outs[1], atol=1e-5)
        if paged.is_initialized:
            _check_pages(paged.state)
            for r in range(paged.state.rows):
                assert torch.allclose(paged.read(r)[0], ref.read(ref.rows[r])[0], atol=1e-6)


def test_static_decode_loads_the_step_tables_in_two_copies(tiny_llama):
    """StaticDecode's buffers (views of one int64 and one int32 buffer, each loaded by one copy) hold
    what the eager step reads: the write slots as (page, offset) and element rows, and the body and
    tier page tables, over a ragged batch through page flushes (on the CPU: the same code as on CUDA)."""
    from rotkv.cache.graph import StaticDecode

    cache = RotkvCache(tiny_llama, "quarot-int2", sink=4, window=8, page_size=4, prefill_chunk=16)
    ids = torch.randint(1, 100, (3, 30), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    kw = {cache_kwarg(tiny_llama): cache}
    tiny_llama(input_ids=ids, attention_mask=mask, use_cache=True, **kw)
    st = cache.state
    sd = StaticDecode(cache, 3, 80)
    p = st.page
    for _ in range(12):
        step = st.plan(1, np.ones(3, dtype=np.int64))[0]
        sd.load(step)
        want = st.tables(step, "cpu")
        for got, ref in zip(sd.body + sd.tier, want.body + want.tier):
            assert torch.equal(got[: ref.numel()], ref)
        slots = torch.as_tensor(step.write_slots)
        assert torch.equal(sd.slot_at, torch.stack([slots // p, slots % p]))
        s0, _, s2, _ = sd.tier_strides
        assert torch.equal(sd.tier_rows, slots // p * s0 + slots % p * s2)
    with pytest.raises(ValueError, match="capacity"):
        StaticDecode(cache, 3, 20).load(st.plan(1, np.ones(3, dtype=np.int64))[0])
