"""The prefill attention's shortcuts change no value: an identity rotation skips the float32
round trip (checked against explicit identity matrices, which take the rotation path), the
unpadded case skips the query / own-token gathers, and one row group returns SDPA's own output."""

import pytest
import torch

import rotkv.cache.layer as layer_mod
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
