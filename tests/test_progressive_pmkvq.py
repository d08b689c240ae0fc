"""PM-KVQ allocation: gradient capture, sensitivities, the MILP, the artifact round trip."""

import numpy as np
import pytest
import torch

from rotkv.calibrate.pmkvq import (
    WIDTHS,
    allocate,
    kv_with_grads,
    layer_sensitivity,
    pmkvq_artifact,
    sensitivities,
    width_cost,
)
from rotkv.rotations.artifact import load_artifact, save_artifact
from rotkv.rotations.base import LayerRotation
from rotkv.rotations.identity import random_orthogonal
from rotkv.rotations.registry import build_rotations


def test_allocation_gives_wider_bits_to_sensitive_layers():
    rng = np.random.default_rng(0)
    base = rng.uniform(0.5, 1.5, 12)
    base[[3, 7]] = 50.0  # two sensitive layers
    sens = np.stack([base, base / 5, base / 80], 1)  # s[l, 2] > s[l, 4] > s[l, 8]
    cost = width_cost(64)  # 2.5, 4.5, 9.0
    bits = allocate(sens, (10 * cost[0] + 2 * cost[1]) / 12 + 1e-6, 64)
    assert sorted(np.flatnonzero(bits == 4).tolist()) == [3, 7] and (bits[[i for i in range(12) if i not in (3, 7)]] == 2).all()
    assert (allocate(sens, cost[2], 64) == 8).all()
    assert (allocate(sens, cost[0], 64) == 2).all()
    with pytest.raises(ValueError, match="budget_bpe"):
        allocate(sens, 2.0, 64)


def test_allocation_matches_brute_force():
    rng = np.random.default_rng(1)
    sens = np.sort(rng.exponential(1.0, (5, 3)), 1)[:, ::-1]
    cost = width_cost(32)
    budget = 4.2
    best, best_bits = np.inf, None
    for combo in np.stack(np.meshgrid(*[range(3)] * 5, indexing="ij"), -1).reshape(-1, 5):
        if cost[combo].mean() <= budget + 1e-9 and sens[np.arange(5), combo].sum() < best:
            best, best_bits = sens[np.arange(5), combo].sum(), np.array(WIDTHS)[combo]
    assert np.array_equal(allocate(sens, budget, 32), best_bits)


def test_captured_keys_are_post_rope_at_stretched_positions_and_get_gradients(tiny_llama):
    from transformers import DynamicCache

    ids = torch.randint(1, 128, (1, 24))
    pos = torch.arange(0, 4 * 24, 4)[None]
    with torch.no_grad():
        ref = DynamicCache(config=tiny_llama.config)
        tiny_llama(input_ids=ids, position_ids=pos, past_key_values=ref, use_cache=True)
    tiny_llama.requires_grad_(False)
    kv = kv_with_grads(tiny_llama, ids, stretch=4)
    assert sorted(kv) == [0, 1]
    for layer, (k, v) in kv.items():
        assert torch.allclose(k, ref.layers[layer].keys, atol=1e-5) and torch.allclose(v, ref.layers[layer].values, atol=1e-5)
        assert k.grad is not None and k.grad.abs().sum() > 0 and v.grad.abs().sum() > 0
    # the keys of layer 0 feed layer 1: a total derivative, so the last layer's keys get gradient too
    assert tiny_llama.config._attn_implementation != "rotkv_pmkvq_grad"


def test_sensitivity_in_the_rotated_basis():
    g = torch.Generator().manual_seed(0)
    k, v, gk, gv = (torch.randn(2, 40, 16, generator=g) for _ in range(4))
    s = layer_sensitivity(LayerRotation(), k, v, gk, gv, 16, 1.0, 1.0)
    assert s[0] > s[1] > s[2] > 0
    # rotating the stored basis changes what is quantized: the figure changes, the first-order
    # identity G.dK = (G R).(dK R) holds (checked on a fixed perturbation)
    r = torch.stack([random_orthogonal(16, 1), random_orthogonal(16, 2)])
    rot = LayerRotation(R_K=r, R_V=r)
    s_rot = layer_sensitivity(rot, k, v, gk, gv, 16, 1.0, 1.0)
    assert s_rot != s and s_rot[0] > s_rot[2]
    dk = torch.randn(2, 40, 16, generator=g)
    assert torch.allclose((gk * dk).sum(), ((gk @ r) * (dk @ r)).sum(), rtol=1e-4)


def test_sensitivities_and_artifact_round_trip(tiny_llama, tmp_path):
    class Loaded:
        model, model_id = tiny_llama, "tiny"

    chunks = [torch.randint(1, 128, (1, 32)) for _ in range(2)]
    rots = build_rotations("hadamard", 2, 2, 16)
    sens = sensitivities(tiny_llama, chunks, rots, 16, skip=4)
    assert sens.shape == (2, 3) and (sens[:, 0] > sens[:, 1]).all() and (sens[:, 1] > sens[:, 2]).all()
    assert all(not p.requires_grad or p.grad is None for p in tiny_llama.parameters())
    bits = allocate(sens, width_cost(16)[1], 16)
    tensors, meta = pmkvq_artifact(Loaded, bits, sens, None, budget_bpe=4.5)
    save_artifact(str(tmp_path / "p.safetensors"), tensors, meta)
    art = load_artifact(str(tmp_path / "p.safetensors"))
    assert art.meta["method"] == "pmkvq" and art.tensors["bits"].tolist() == bits.tolist()
