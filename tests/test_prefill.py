"""The model-level chunked prefill (rotkv.generation.prefill) and the layer's prefill attention."""

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rotkv.cache import RotkvCache
from rotkv.cache.layer import _sdpa, row_groups
from rotkv.generation import generate_batch, prefill, prefill_chunk_of
from rotkv.hf.compat import cache_kwarg

SMALL = dict(sink=4, window=8, page_size=4, group_size=16)


def _ids(b, n, seed=0):
    return torch.randint(1, 128, (b, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _one_call(model, ids, cache, mask=None):
    """The old prefill: the whole prompt in one model call (the cache chunks it inside)."""
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0) if mask is not None else None
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits[:, -1]


@pytest.mark.parametrize("preset", ["quarot-int2", "bf16"])
def test_chunked_prefill_equals_one_call_with_the_same_cache_chunk(tiny_llama, preset):
    """Model calls of C tokens store the same tokens as one call chunked by the cache at C (same
    chunk boundaries, same quantized history), so the last logits and the stored pages agree."""
    ids = _ids(2, 70)
    a = RotkvCache(tiny_llama, preset, prefill_chunk=16, **SMALL)
    b = RotkvCache(tiny_llama, preset, prefill_chunk=16, **SMALL)
    want = _one_call(tiny_llama, ids, a)
    got = prefill(tiny_llama, ids, b)  # default chunk: the cache's own (16)
    assert got.shape == (2, tiny_llama.config.vocab_size)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    for la, lb in zip(a.layers, b.layers):
        ka, va = la.read(1)
        kb, vb = lb.read(1)
        assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
    assert a.get_seq_length() == b.get_seq_length() == 70


def test_chunked_prefill_matches_dynamic_cache_left_padded(tiny_llama):
    """Left padding longer than a chunk (a row's first chunks are all pads): rotkv's bf16 preset at
    float32 and transformers' DynamicCache, both chunked, give the plain model's logits."""
    ids = _ids(3, 50, seed=1)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :30] = 0
    with torch.no_grad():
        plain = tiny_llama(input_ids=ids, attention_mask=mask,
                           position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
    for cache in (DynamicCache(config=tiny_llama.config),
                  RotkvCache(tiny_llama, "bf16", tier_dtype="float32", prefill_chunk=8)):
        got = prefill(tiny_llama, ids, cache, mask, chunk=8)
        assert torch.allclose(got, plain, atol=1e-4, rtol=1e-4), type(cache).__name__


def test_prefill_after_a_cached_context_and_bad_masks(tiny_llama):
    ids = _ids(1, 40, seed=2)
    cache = RotkvCache(tiny_llama, "bf16", tier_dtype="float32")
    prefill(tiny_llama, ids[:, :25], cache, chunk=7)
    got = prefill(tiny_llama, ids[:, 25:], cache, chunk=6)
    with torch.no_grad():
        plain = tiny_llama(input_ids=ids).logits[:, -1]
    assert torch.allclose(got, plain, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        prefill(tiny_llama, ids[:, :5], RotkvCache(tiny_llama, "bf16"), torch.ones(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="prefill chunk"):
        prefill_chunk_of(None, 0)


def test_default_chunk_is_the_caches():
    class Spec:
        prefill_chunk = 1234

    class C:
        spec = Spec()

    assert prefill_chunk_of(C()) == 1234
    assert prefill_chunk_of(object()) == 4096
    assert prefill_chunk_of(C(), 64) == 64


def test_generate_batch_uses_bounded_logits(tiny_llama, monkeypatch):
    """Every prefill call asks for one position's logits and sees at most `chunk` tokens."""
    seen = []
    fwd = tiny_llama.forward

    @functools.wraps(fwd)  # keeps the signature, which prefill reads (logits_to_keep, the cache keyword)
    def spy(*a, **kw):
        out = fwd(*a, **kw)
        seen.append((kw["input_ids"].shape[1], out.logits.shape[1]))
        return out

    monkeypatch.setattr(tiny_llama, "forward", spy)
    run = generate_batch(tiny_llama, _ids(2, 45), RotkvCache(tiny_llama, "quarot-int2", prefill_chunk=16, **SMALL), 3)
    assert run.tokens.shape == (2, 3)
    prefill_calls = seen[:3]
    assert [q for q, _ in prefill_calls] == [16, 16, 13]
    assert all(kept == 1 for _, kept in prefill_calls)


def test_row_groups_bound_the_history_and_give_the_same_output(tiny_llama, monkeypatch):
    assert row_groups(10, 3 << 20, budget_mb=7) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert row_groups(3, 10 << 20, budget_mb=1) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="ROTKV_PREFILL_HISTORY_MB"):
        row_groups(3, 1, budget_mb=0)
    ids = _ids(3, 60, seed=4)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    whole = prefill(tiny_llama, ids, RotkvCache(tiny_llama, "quarot-int2", prefill_chunk=20, **SMALL), mask)
    calls = []
    import rotkv.cache.layer as layer

    monkeypatch.setattr(layer, "row_groups", lambda rows, per_row: calls.append(rows) or [(r, r + 1) for r in range(rows)])
    grouped = prefill(tiny_llama, ids, RotkvCache(tiny_llama, "quarot-int2", prefill_chunk=20, **SMALL), mask)
    assert calls and all(r == 3 for r in calls)
    assert torch.allclose(grouped, whole, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("hq,h", [(4, 2), (2, 2)])
def test_lower_right_sdpa_is_causal_at_the_end(hq, h):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, hq, 5, 8, generator=g)
    k, v = torch.randn(2, h, 12, 8, generator=g), torch.randn(2, h, 12, 8, generator=g)
    got = _sdpa(q, k, v, None, 0.3)
    mask = torch.arange(12)[None, :] <= torch.arange(5)[:, None] + 7  # query j sees keys up to 12 - 5 + j
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(hq // h, 1), v.repeat_interleave(hq // h, 1),
                                          attn_mask=mask, scale=0.3)
    assert torch.allclose(got, want, atol=1e-5)


def test_prefill_output_is_in_the_query_dtype_without_float32_call_buffers(tiny_llama):
    """The layer's prefill output is one [B, q, Hq, D] tensor of the query dtype; with a padded
    batch the per-step outputs go into it, pads zero."""
    cache = RotkvCache(tiny_llama, "quarot-int2", prefill_chunk=8, **SMALL)
    layer = cache.layers[0]
    b, hq, h, q, d = 2, 4, 2, 20, 16
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(b, h, q, d, generator=g), torch.randn(b, h, q, d, generator=g)
    layer.update(k, v)
    query = torch.randn(b, hq, q, d, generator=g).to(torch.bfloat16)
    real = torch.ones(b, q, dtype=torch.bool)
    real[1, :5] = False
    out = layer.attend(query, real, 0.25)
    assert out.dtype == torch.bfloat16 and out.shape == (b, q, hq, d)
    assert (out[1, :5] == 0).all() and out[1, 5:].abs().sum() > 0
    assert np.array_equal(layer.state.lengths(), [20, 15])


def test_generate_prefills_whole_chunks_then_hands_the_last_to_model_generate(tiny_llama, monkeypatch):
    """rotkv.generation.generate: model calls of the cache's chunk, the last (partial) chunk in
    model.generate's own prefill, so the boundaries are the cache's and the tokens the same as
    model.generate on the whole prompt."""
    from rotkv.generation import generate

    class Tok:
        pad_token_id = 0

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    ids = _ids(1, 45, seed=6)
    sizes = []
    fwd = tiny_llama.forward

    @functools.wraps(fwd)
    def spy(*a, **kw):
        sizes.append(kw["input_ids"].shape[1])
        return fwd(*a, **kw)

    monkeypatch.setattr(tiny_llama, "forward", spy)
    got = generate(tiny_llama, Tok(), ids, RotkvCache(tiny_llama, "quarot-int2", prefill_chunk=16, **SMALL),
                   max_new_tokens=5)
    assert sizes[:3] == [16, 16, 13] and all(s == 1 for s in sizes[3:])
    monkeypatch.setattr(tiny_llama, "forward", fwd)
    with torch.no_grad():
        want = tiny_llama.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                                   pad_token_id=0, **{cache_kwarg(tiny_llama): RotkvCache(
                                       tiny_llama, "quarot-int2", prefill_chunk=16, **SMALL)})
    assert got.new_tokens == want[0, 45:].tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("rep", [1, 4])
def test_cuda_prefill_matches_the_cpu_reference(padded, rep):
    """The GPU prefill (Triton dequantizer into the K/V buffer, flash lower-right causal or a mask,
    the fused write kernel over pages assembled from the tier and the call) against the CPU float32
    reference layer on the same inputs: outputs within bf16 tolerance, the same body codes."""
    from rotkv.cache.codecs import make_codecs
    from rotkv.cache.layer import HybridLayer
    from rotkv.config import CacheSpec
    from rotkv.rotations.registry import build_rotations

    h, b, d, g = 2, 2, 128, 64
    spec = CacheSpec(bits=2, group_size=g, sink=8, window=32, page_size=16, prefill_chunk=128, rotation="hadamard")
    rot = build_rotations("hadamard", 1, h, d)[0]
    gen = torch.Generator().manual_seed(0)
    n = 300
    # inputs on the bf16 grid, so both sides quantize the same numbers: with float32 inputs the
    # CPU's own bf16 path is 3.2% off its float32 path (INT2 codes flip at rounding ties), with
    # bf16-exact inputs 0.16% (measured on this test's inputs)
    ks, vs = (torch.randn(b, h, n, d, generator=gen).bfloat16().float() for _ in range(2))
    qs = torch.randn(b, h * rep, n, d, generator=gen).bfloat16().float()
    real = None
    if padded:
        real = torch.ones(b, n, dtype=torch.bool)
        real[1, :45] = False
    outs, layers = [], []
    for dev, dt in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        layer = HybridLayer(spec, rot, d, h, 0, make_codecs("token", 2, g, 1.0, 1.0), dt)
        o = []
        for c0 in range(0, n, 128):  # model-level calls of one chunk, as rotkv.generation.prefill makes
            sl = slice(c0, min(c0 + 128, n))
            layer.update(ks[:, :, sl].to(dev, dt), vs[:, :, sl].to(dev, dt))
            o.append(layer.attend(qs[:, :, sl].to(dev, dt), real[:, sl].to(dev) if real is not None else None,
                                  d ** -0.5).float().cpu())
        outs.append(torch.cat(o, 1))
        layers.append(layer)
    ref, got = outs
    import rotkv.cache.layer as layer_mod

    assert layer_mod._FLASH_FAILED is False, layer_mod._FLASH_FAILED  # the direct flash call ran (rows alike)
    if padded:
        ref, got = ref[real], got[real]
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err
    (rk, rv), (gk, gv) = layers[0].pools.body, layers[1].pools.body
    st = layers[0].state
    assert np.array_equal(st.body_count, layers[1].state.body_count) and st.body_count.min() > 0
    for row in range(b):
        pages = torch.as_tensor(st.body_pages[row, :st.body_count[row]])
        diff = (rk["codes"][pages] != gk["codes"][pages.cuda()].cpu()).float().mean().item()
        assert diff < 2e-2, diff  # bf16 vs float32 arithmetic: codes at rounding ties may differ


def test_token_budget_and_page_reservation(tiny_llama):
    assert prefill_chunk_of(None, 4096, rows=64, max_tokens=65536) == 1024
    assert prefill_chunk_of(None, 4096, rows=4, max_tokens=65536) == 4096
    assert prefill_chunk_of(None, 4096, rows=10_000, max_tokens=65536) == 16
    assert prefill_chunk_of(None, 4096, rows=64, max_tokens=None) == 4096
    cache = RotkvCache(tiny_llama, "quarot-int2", **SMALL)
    generate_batch(tiny_llama, _ids(2, 70), cache, 5, prefill_tokens=64)  # chunk 32 per row
    st = cache.state
    # reserved once: body ceil(75 / 4) pages a row, tier sink page + (window + page) / page + 1
    assert st.body_free.capacity == 2 * 19 and st.tier_free.capacity == 2 * (1 + 3 + 1)
    assert st.body_free.used <= st.body_free.capacity and cache.get_seq_length() == 74
