"""The prefill attention's shortcuts change no value: an identity rotation skips the float32
round trip (checked against explicit identity matrices, which take the rotation path), the
unpadded case skips the query / own-token gathers, and one row group returns SDPA's own output."""

import pytest
import torch

import rotkv.cache.layer as layer_mod
from rotkv import switches
from rotkv.cache import RotkvCache
from rotkv.generation import prefill, reserve
from rotkv.hf.compat import cache_kwarg
from rotkv.rotations.base import LayerRotation

SMALL = dict(sink=4, window=8, page_size=4, group_size=16)


def _ids(b, n, seed=0):
    return torch.randint(1, 128, (b, n), generator=torch.Generator().manual_seed(seed))


def _run(model, preset, ids, mask=None, eye=False):
    cache = RotkvCache(model, preset, prefill_chunk=16, check_finite=False, **SMALL)
    if eye:  # the same (identity) rotation as matrices: the float32 einsum path
        for layer in cache.layers:
            h, d = layer.kv_heads, layer.head_dim
            old = layer.rotation_cpu
            eye_m = torch.eye(d).expand(h, d, d).clone()
            layer.rotation_cpu = LayerRotation(eye_m if old.R_K is None else old.R_K,
                                               eye_m if old.R_V is None else old.R_V, old.k_mean)
    reserve(cache, ids.shape[0], ids.shape[1])
    logits = prefill(model, ids, cache, mask, chunk=16)
    layer = cache.layers[1]  # its tier holds keys and values made from layer 0's attention outputs
    return logits, layer.pools.tier_k.clone(), layer.pools.tier_v.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padded", [False, True])
def test_identity_rotation_shortcut_is_exact(tiny_llama, dtype, padded):
    model = tiny_llama.to(dtype)
    ids = _ids(3, 45, seed=1)
    mask = None
    if padded:
        mask = torch.ones_like(ids)
        mask[0, :7] = 0
    fast = _run(model, "bf16", ids, mask)
    slow = _run(model, "bf16", ids, mask, eye=True)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


@torch.no_grad()
@pytest.mark.parametrize("preset", ["bf16", "quarot-int2"])
def test_one_row_group_returns_sdpa_output_unchanged(tiny_llama, preset, monkeypatch):
    """The unpadded prefill (no gathers, SDPA's output returned) equals the same with one row per
    group (the output buffer path); the logits of every prefill call are compared."""
    ids = _ids(3, 40, seed=2)

    def logits():
        cache = RotkvCache(tiny_llama, preset, prefill_chunk=16, check_finite=False, **SMALL)
        outs = []
        for c0 in range(0, 40, 16):
            out = tiny_llama(input_ids=ids[:, c0:c0 + 16], use_cache=True,
                             position_ids=torch.arange(c0, min(c0 + 16, 40))[None].expand(3, -1),
                             **{cache_kwarg(tiny_llama): cache})
            outs.append(out.logits)
        return torch.cat(outs, 1)

    one = logits()
    monkeypatch.setattr(layer_mod, "row_groups", lambda rows, per_row: [(r, r + 1) for r in range(rows)])
    grouped = logits()
    assert torch.allclose(one, grouped, atol=1e-5, rtol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("preset", ["quarot-int2", "bf16"])
def test_first_chunk_attends_in_the_model_basis(tiny_llama, preset, monkeypatch):
    """A prefill step with nothing stored runs causal SDPA on the unrotated queries, keys and values
    (the prefill_own_basis switch; the rotation cancels): the first call's logits are the model's own
    without a cache, the first layer's stored keys and values are bit-identical to the rotated path's,
    and only the first chunk of a row takes it (later chunks read the stored, quantized history)."""
    ids = _ids(2, 40, seed=4)
    calls = []
    real = layer_mod._sdpa_causal
    monkeypatch.setattr(layer_mod, "_sdpa_causal", lambda *a: calls.append(a[0].shape[2]) or real(*a))

    def run(basis):
        switches.configure(prefill_own_basis=basis)
        cache = RotkvCache(tiny_llama, preset, prefill_chunk=16, check_finite=False, **SMALL)
        outs = [tiny_llama(input_ids=ids[:, c0:c0 + 16], use_cache=True,
                           position_ids=torch.arange(c0, min(c0 + 16, 40))[None].expand(2, -1),
                           **{cache_kwarg(tiny_llama): cache}).logits for c0 in range(0, 40, 16)]
        layer = cache.layers[0]  # its keys and values come from the embeddings alone
        return outs[0], layer.pools.tier_k.clone(), [t for r in range(2) for t in layer.read(r)]

    never = run("never")
    assert calls == []
    always = run("always")
    n_layers = len(tiny_llama.model.layers)
    assert calls == [16] * n_layers  # the first of three chunks, every layer
    # the first call: in the model's basis it is the model without a cache (float32 here); the rotated
    # path reads its own keys and values from the tier dtype's rounding (bf16)
    plain = tiny_llama(input_ids=ids[:, :16], use_cache=False).logits
    assert torch.allclose(always[0], plain, atol=1e-5, rtol=1e-5)
    assert torch.allclose(never[0], plain, atol=3e-3, rtol=1e-2)
    assert torch.equal(never[1], always[1])
    assert all(torch.equal(a, b) for a, b in zip(never[2], always[2]))


def test_own_basis_setting_is_checked(tiny_llama, monkeypatch):
    monkeypatch.setenv("ROTKV_TUNING", "prefill_own_basis=sometimes")
    with pytest.raises(ValueError, match="ROTKV_TUNING prefill_own_basis"):
        switches.reload()  # refused when the environment is read, on any device
    with pytest.raises(ValueError, match="ROTKV_TUNING prefill_own_basis"):
        RotkvCache(tiny_llama, "quarot-int2", prefill_chunk=16, check_finite=False, **SMALL)


@pytest.mark.parametrize("hq,h", [(4, 4), (6, 2)])
def test_merged_history_and_own_equal_one_softmax(hq, h):
    """attention_lse over the history (no mask) and over the own tokens (causal), merged by their
    log-sum-exp, is one softmax over both with the queries as the last keys (lower-right causal)."""
    g = torch.Generator().manual_seed(hq)
    b, c, lh, d, scale = 2, 5, 7, 16, 0.3
    q = torch.randn(b, hq, c, d, generator=g)
    hk, hv = torch.randn(b, h, lh, d, generator=g), torch.randn(b, h, lh, d, generator=g)
    ok, ov = torch.randn(b, h, c, d, generator=g), torch.randn(b, h, c, d, generator=g)
    o1, l1 = layer_mod.attention_lse(q, hk, hv, False, scale)
    o2, l2 = layer_mod.attention_lse(q, ok, ov, True, scale)
    got = layer_mod.merge_lse(o1, l1, o2, l2)
    k = torch.cat([hk, ok], 2).repeat_interleave(hq // h, 1)
    v = torch.cat([hv, ov], 2).repeat_interleave(hq // h, 1)
    s = q @ k.transpose(-1, -2) * scale
    s = s.masked_fill(torch.ones(c, lh + c, dtype=torch.bool).triu(lh + 1), float("-inf"))
    want = s.softmax(-1) @ v
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(l2.squeeze(-1), s[..., lh:].masked_fill(
        torch.ones(c, c, dtype=torch.bool).triu(1), float("-inf")).logsumexp(-1), atol=1e-5)


@torch.no_grad()
@pytest.mark.parametrize("preset,mean", [("quarot-int2", False), ("quarot-int2", True), ("bf16", False)])
def test_later_chunks_merge_history_with_own_tokens(tiny_llama, preset, mean, monkeypatch):
    """With float32 tiers (no bf16 rounding of the own tokens on either path) the own-basis prefill
    (own tokens causal in the model's basis, history rotated, merged by log-sum-exp) gives the
    rotated single-softmax path's logits; every later chunk of every layer takes the merge. ``mean``:
    random rotations with a large key mean (OSCAR's presets subtract one), whose ``scale * q.mu`` the
    merge has to give back to the history's log-sum-exp (without it the logits move by 0.03)."""
    ids = _ids(2, 40, seed=5)
    calls = []
    real = layer_mod.attention_lse
    monkeypatch.setattr(layer_mod, "attention_lse", lambda *a: calls.append(a[3]) or real(*a))

    def run(basis):
        switches.configure(prefill_own_basis=basis)
        cache = RotkvCache(tiny_llama, preset, prefill_chunk=16, check_finite=False, tier_dtype="model", **SMALL)
        if mean:
            for i, layer in enumerate(cache.layers):
                h, d = layer.kv_heads, layer.head_dim
                g = torch.Generator().manual_seed(i)
                r = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]
                layer.rotation_cpu = LayerRotation(r, layer.rotation_cpu.R_V, 3 * torch.randn(h, d, generator=g))
        reserve(cache, 2, 40)
        return prefill(tiny_llama, ids, cache, chunk=16)

    never = run("never")
    assert calls == []
    always = run("always")
    n_layers = len(tiny_llama.model.layers)
    assert calls == [False, True] * (2 * n_layers)  # chunks 2 and 3: history, then own
    assert torch.allclose(never, always, atol=1e-4, rtol=1e-4)
