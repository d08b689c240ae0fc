"""Budgeted layers inside a model: progressive shrinking, its exactness, the over-budget error, eviction."""

import pytest
import torch

from rotkv.cache import RotkvCache, make_cache
from rotkv.cache.progressive import EvictingLayer, ProgressiveLayer, layer_budget
from rotkv.config import CacheSpec, get_preset
from rotkv.hf.compat import cache_kwarg

BASE = dict(group_size=16, sink=4, window=16, page_size=8, prefill_chunk=16, tier_dtype="float32")


def feed(model, cache, ids, step=16):
    """Teacher-forced in chunks; returns the logits and each layer's (tokens, bytes, width) after every chunk.
    After every chunk, what the attention reads (the float32 read view) must be what is stored."""
    outs, trace = [], []
    with torch.no_grad():
        for i in range(0, ids.shape[1], step):
            outs.append(model(input_ids=ids[:, i : i + step], **{cache_kwarg(model): cache}).logits)
            for l in cache.layers:
                if not hasattr(l, "rows"):  # a paged layer (fixed width): nothing to cross-check here
                    continue
                if hasattr(l, "held_bytes"):  # the budget's count, from token counts: every row's tensors' bytes
                    assert l.held_bytes() == sum(r.tier_bytes() + r.body_bytes() for r in l.rows)
                for r in l.rows:
                    read, stored = l.read(r), l.decode_row(r)
                    assert read[0].shape == stored[0].shape and torch.equal(read[0], stored[0]) and torch.equal(read[1], stored[1])
            trace.append([(l.rows[0].length, sum(r.tier_bytes() + r.body_bytes() for r in l.rows), getattr(l, "bits", None))
                          if hasattr(l, "rows") else (int(l.state.lengths()[0]), l.stats()["body_bytes"] + l.stats()["tier_bytes"], None)
                          for l in cache.layers])
    return torch.cat(outs, 1), trace


def test_progressive_shrinks_in_steps_and_stays_within_budget(tiny_llama):
    spec = CacheSpec(bits=2, start_bits=16, budget_tokens=160, **BASE)
    cache = make_cache(tiny_llama, spec)
    assert isinstance(cache, RotkvCache) and all(isinstance(l, ProgressiveLayer) for l in cache.layers)
    assert [lp.kind for lp in cache.plan.layers] == ["progressive"] * 2
    # built straight from the class (as an evaluation harness does), a budgeted preset still gets its layers
    direct = RotkvCache(tiny_llama, "pmkvq", **BASE)
    assert all(isinstance(l, ProgressiveLayer) for l in direct.layers)
    assert direct.spec.budget_tokens == 8192 and direct.layers[0].bits == 16
    _, trace = feed(tiny_llama, cache, torch.randint(1, 128, (1, 160)))
    budget = cache.layers[0].budget
    widths = [t[0][2] for t in trace]
    assert widths[0] == 16 and widths[-1] == 2
    assert widths == sorted(widths, reverse=True) and set(widths) == {16, 8, 4, 2}
    assert all(b <= budget for t in trace for _, b, _ in t)
    assert [w for _, w in cache.layers[0].shrinks] == [8, 4, 2]


def test_progressive_body_equals_fixed_width_body(tiny_llama):
    # every stored page, whether written at 16 bits and shifted or written later at a lower width,
    # holds what direct 2-bit quantization stores: same codes, same fp16 scale and lo. Layer 0's
    # states depend on the input ids alone, so both caches see the same rows there.
    ids = torch.randint(1, 128, (1, 150))
    prog = make_cache(tiny_llama, CacheSpec(bits=2, start_bits=16, budget_tokens=150, **BASE))
    fixed = make_cache(tiny_llama, CacheSpec(bits=2, **BASE))
    feed(tiny_llama, prog, ids)
    feed(tiny_llama, fixed, ids)
    assert prog.widths() == [2, 2] and prog.layers[0].shrinks[0][0] < 100
    st = fixed.state  # the fixed-width cache is paged: its row's body pages, in order
    pages = torch.as_tensor(st.body_pages[0, :st.body_count[0]])
    for name, parts in zip(("body_k", "body_v"), fixed.layers[0].pools.body):
        for part in ("codes", "scale", "lo"):
            assert torch.equal(getattr(prog.layers[0].rows[0], name)[part], parts[part][pages])


@pytest.mark.parametrize("budgeted", ["progressive", "evicting"])
def test_without_the_read_view_the_layers_read_the_same_and_hold_no_float32_copy(tiny_llama, budgeted):
    # on a GPU the per-row layers keep no float32 read view (it would hold twice a bf16 cache); a read
    # then decodes the stored pages: the same logits, widths and evictions as with the CPU's view
    extra = dict(start_bits=16, budget_tokens=160) if budgeted == "progressive" else dict(budget_tokens=100)
    spec = CacheSpec(bits=2, **extra, **BASE)
    ids = torch.randint(1, 128, (2, 150))
    with_view, without = make_cache(tiny_llama, spec), make_cache(tiny_llama, spec)
    assert all(l.read_view is None for l in without.layers)  # decided at the first write, by the device
    for l in without.layers:
        l.read_view = False
    a, trace_a = feed(tiny_llama, with_view, ids)
    b, trace_b = feed(tiny_llama, without, ids)
    assert all(l.read_view for l in with_view.layers)  # the CPU keeps it
    assert torch.equal(a, b) and trace_a == trace_b
    assert all(r.view_k is None for l in without.layers for r in l.rows)
    assert sum(l.stats()["scratch_bytes"] for l in without.layers) == 0
    assert sum(l.stats()["scratch_bytes"] for l in with_view.layers) > 0


@pytest.mark.parametrize("budgeted", ["progressive", "evicting"])
def test_a_call_of_many_chunks_without_the_view_decodes_each_row_once(tiny_llama, budgeted, monkeypatch):
    # without a kept view (the GPU), a prefill call of several chunks decodes each row's stored pages once into
    # a view of the call's own, which its writes (flushes, shrinks, evictions) keep current and which goes with
    # the call: the same logits as the kept view, one decode per row and call, no float32 copy afterwards
    from rotkv.cache.rowstore import RowStoreLayer

    extra = dict(start_bits=16, budget_tokens=160) if budgeted == "progressive" else dict(budget_tokens=100)
    spec = CacheSpec(bits=2, **extra, **BASE)
    ids = torch.randint(1, 128, (2, 150))
    with_view, without = make_cache(tiny_llama, spec), make_cache(tiny_llama, spec)
    for l in without.layers:
        l.read_view = False
    calls = []
    decode = RowStoreLayer.decode_row
    monkeypatch.setattr(RowStoreLayer, "decode_row", lambda self, row: calls.append(self) or decode(self, row))
    a, trace_a = feed(tiny_llama, with_view, ids, step=75)  # calls of 5 chunks (prefill_chunk 16)
    calls.clear()
    with torch.no_grad():
        tiny_llama(input_ids=ids[:, :75], **{cache_kwarg(tiny_llama): without})
    assert len(calls) == 2 * len(without.layers)  # once per row and layer, not once per chunk
    with torch.no_grad():
        b = tiny_llama(input_ids=ids[:, 75:], **{cache_kwarg(tiny_llama): without}).logits
    assert torch.equal(a[:, 75:], b)
    assert all(r.view_k is None for l in without.layers for r in l.rows)
    assert sum(l.stats()["scratch_bytes"] for l in without.layers) == 0
    if budgeted == "progressive":
        assert [l.bits for l in without.layers] == [l.bits for l in with_view.layers] and trace_a[-1][0][2] < 16
    else:
        assert [l.evicted for l in without.layers] == [l.evicted for l in with_view.layers] > [0] * len(without.layers)


def test_16_bit_body_is_nearly_lossless(tiny_llama):
    ids = torch.randint(1, 128, (1, 64))
    a, trace = feed(tiny_llama, make_cache(tiny_llama, CacheSpec(bits=2, start_bits=16, budget_tokens=4096, **BASE)), ids)
    b, _ = feed(tiny_llama, make_cache(tiny_llama, CacheSpec(bits=None, **BASE)), ids)
    assert trace[-1][0][2] == 16
    assert torch.allclose(a, b, atol=1e-3)


def test_over_budget_at_final_width_raises_with_budget_and_context(tiny_llama):
    cache = make_cache(tiny_llama, CacheSpec(bits=2, start_bits=16, budget_tokens=60, **BASE))
    with pytest.raises(ValueError, match=r"over its budget .*budget_tokens=60.*context length of \d+ tokens"):
        feed(tiny_llama, cache, torch.randint(1, 128, (1, 120)))


def test_final_width_4_never_goes_below(tiny_llama):
    cache = make_cache(tiny_llama, CacheSpec(bits=4, start_bits=8, budget_tokens=200, **BASE))
    feed(tiny_llama, cache, torch.randint(1, 128, (1, 200)))
    assert cache.widths() == [4, 4]


@pytest.mark.parametrize("bits", [None, 4])
def test_eviction_keeps_sink_and_most_recent(tiny_llama, bits):
    spec = CacheSpec(bits=bits, budget_tokens=48, **BASE)
    cache = make_cache(tiny_llama, spec)
    assert all(isinstance(l, EvictingLayer) for l in cache.layers)
    ids = torch.randint(1, 128, (1, 160))
    _, trace = feed(tiny_llama, cache, ids)
    layer = cache.layers[0]
    assert all(b <= layer.budget for t in trace for _, b, _ in t)
    assert layer.evicted > 0 and layer.rows[0].sink_k.shape[1] == 4
    # the window's last key is the last token's: compare with an unbudgeted cache
    ref = make_cache(tiny_llama, CacheSpec(bits=bits, **BASE))
    feed(tiny_llama, ref, ids)
    ref_k = ref.layers[0].read(0)[0]  # the paged reference, decoded: sink first, last token last
    assert torch.equal(layer.rows[0].win_k[:, -1].float(), ref_k[:, -1])
    assert torch.equal(layer.rows[0].sink_k.float(), ref_k[:, :4])


def test_layer_budget_counts_tiers_and_metadata():
    spec = CacheSpec(bits=2, start_bits=16, budget_tokens=1000, group_size=64, sink=16, window=64, page_size=16)
    # sink + fullest window = 16 + 79 tier tokens at 2 * 3 * 64 * 2 bytes; 905 body tokens at
    # 2 * 3 * (16 code bytes + fp16 lo and scale) or, anchored at the start, fp32 lo and scale
    assert layer_budget(spec, 2, 3, 64, 2) == 95 * 768 + 905 * 2 * 3 * (16 + 4)
    assert layer_budget(spec.replace(anchor="start", shift="plain"), 2, 3, 64, 2) == 95 * 768 + 905 * 2 * 3 * (16 + 8)
    assert layer_budget(CacheSpec(bits=None, budget_tokens=10), None, 3, 64, 2) == 10 * 768


def test_presets_and_validation():
    assert get_preset("pmkvq").start_bits == 16 and get_preset("oscar-pmkvq").needs_artifact
    with pytest.raises(ValueError, match="budget_tokens"):
        CacheSpec(bits=2, start_bits=16)
    with pytest.raises(ValueError, match="start_bits"):
        CacheSpec(bits=2, start_bits=4, budget_tokens=10)
    with pytest.raises(ValueError, match="anchor"):
        CacheSpec(bits=2, start_bits=16, budget_tokens=10, shift="plain")
    with pytest.raises(ValueError, match="shift"):
        CacheSpec(bits=2, start_bits=16, budget_tokens=10, shift="nope", anchor="start")


def test_artifact_widths_and_rotations_compose(tiny_llama, tmp_path):
    from rotkv.hf.fingerprint import model_meta
    from rotkv.rotations.artifact import save_artifact
    from rotkv.rotations.identity import random_orthogonal

    t = {}
    for l in range(2):
        t[f"R_K.{l}"] = torch.stack([random_orthogonal(16, 10 * l + i) for i in range(2)])
        t[f"R_V.{l}"] = torch.stack([random_orthogonal(16, 10 * l + i + 5) for i in range(2)])
        t[f"k_mean.{l}"] = torch.randn(2, 16)
    t["bits"] = torch.tensor([4, 2], dtype=torch.int32)
    save_artifact(str(tmp_path / "a.safetensors"), t, model_meta(tiny_llama, "tiny") | {"method": "oscar+pmkvq"})
    spec = get_preset("oscar-pmkvq", budget_tokens=150, **BASE)
    cache = make_cache(tiny_llama, spec, str(tmp_path / "a.safetensors"))
    feed(tiny_llama, cache, torch.randint(1, 128, (1, 150)))
    assert cache.widths() == [4, 2] and [l.final_bits for l in cache.layers] == [4, 2]
    assert cache.layers[0].budget > cache.layers[1].budget
    assert cache.layers[0].rotation.R_K is not None and cache.layers[0].rotation.k_mean is not None
    # a rotation-free preset reads only the widths
    plain = make_cache(tiny_llama, get_preset("pmkvq", budget_tokens=150, **BASE), str(tmp_path / "a.safetensors"))
    assert [l.final_bits for l in plain.layers] == [4, 2] and plain.layers[0].rotation.R_K is None
    # a fixed-width spec ignores the widths: every layer's budget is at `bits`
    fixed = make_cache(tiny_llama, get_preset("oscar-int2", budget_tokens=150, **BASE), str(tmp_path / "a.safetensors"))
    assert all(isinstance(l, EvictingLayer) for l in fixed.layers) and fixed.layers[0].budget == fixed.layers[1].budget


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the per-row layers' GPU choices")
def test_on_a_gpu_the_per_row_layers_keep_no_view_and_attend_bf16_tiers_in_bf16():
    # a bf16 model on the GPU: no float32 read view (decided at the first write) and bf16 attention; its
    # logits against the same cache on the CPU (the float32 reference attention over the same bf16 tiers)
    from rotkv_testing import make_tiny_llama

    spec = CacheSpec(bits=2, start_bits=16, budget_tokens=160, **(BASE | {"tier_dtype": "bfloat16"}))
    ids = torch.randint(1, 128, (2, 150))
    cpu_model = make_tiny_llama().to(torch.bfloat16)
    gpu_model = make_tiny_llama().to(torch.bfloat16).cuda()
    gpu_model.load_state_dict(cpu_model.state_dict())
    on_cpu, on_gpu = make_cache(cpu_model, spec), make_cache(gpu_model, spec)
    a, trace_a = feed(cpu_model, on_cpu, ids)
    b, trace_b = feed(gpu_model, on_gpu, ids.cuda())
    assert all(l.read_view is False for l in on_gpu.layers) and all(l.read_view for l in on_cpu.layers)
    assert sum(l.stats()["scratch_bytes"] for l in on_gpu.layers) == 0
    assert [[w for *_, w in t] for t in trace_a] == [[w for *_, w in t] for t in trace_b]  # the same shrinks
    a, b = a.float(), b.float().cpu()
    # bf16 attention and the GPU's matmuls move the logits by rounding (and the 2-bit codes that rounding flips):
    # a bf16 model against a float32 one on the CPU stays well inside this bound; a wrong mask or order is O(1)
    assert (a - b).norm() <= 0.05 * a.norm()
