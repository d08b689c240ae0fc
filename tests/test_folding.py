"""Weight folding: R_V into v_proj / o_proj, pairwise SO(2) into q_proj / k_proj (exact in fp32)."""

import copy
import math

import pytest
import torch

from rotkv.calibrate.capture import capturing
from rotkv.hf.models import attention_modules
from rotkv.rotations.folding import fold_pairwise, fold_values, foldable_pairs
from rotkv.rotations.identity import random_orthogonal
from rotkv.rotations.pairwise import block_hadamard, pair_matrix


def _tiny(kind: str, bias: bool = True, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
              num_hidden_layers=2, vocab_size=128, max_position_embeddings=512, attention_bias=bias)
    m = (LlamaForCausalLM(LlamaConfig(**kw)) if kind == "llama" else Qwen3ForCausalLM(Qwen3Config(**kw))).eval()
    with torch.no_grad():  # random (non-trivial) biases
        for a in attention_modules(m):
            for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                if p.bias is not None:
                    p.bias.normal_(0, 0.5)
    return m


def _capture_kv(model, ids):
    got = {}
    with torch.no_grad(), capturing(model, lambda l, q, k, v, o, p: got.setdefault(l, (q[0].clone(), k[0].clone(), v[0].clone()))):
        logits = model(ids).logits
    return logits, got


IDS = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(1))


def test_fold_values_per_kv_head_exact():
    m = _tiny("llama")
    ref, kv = _capture_kv(m, IDS)
    r_v = [torch.stack([random_orthogonal(16, 10 * l + g) for g in range(2)]) for l in range(2)]
    assert not torch.allclose(r_v[0][0], r_v[0][1])
    f = copy.deepcopy(m)
    fold_values(f, r_v)
    out, kv_f = _capture_kv(f, IDS)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    for l in range(2):  # the cache now sees v R_V(g), per KV head (GQA mapping g = h // n_rep)
        torch.testing.assert_close(kv_f[l][2], kv[l][2] @ r_v[l], atol=1e-5, rtol=1e-5)


def test_fold_values_wrong_mapping_is_not_exact():
    """A check that can fail: folding o_proj with the transposed rotation breaks the outputs."""
    m = _tiny("llama")
    ref = m(IDS).logits
    r_v = [torch.stack([random_orthogonal(16, 10 * l + g) for g in range(2)]) for l in range(2)]
    f = copy.deepcopy(m)
    fold_values(f, r_v)
    with torch.no_grad():
        for a, r in zip(attention_modules(f), r_v):  # undo v_proj only: v and W_O no longer agree
            for g in range(2):
                a.v_proj.weight[16 * g : 16 * g + 16] = r[g].double().to(torch.float32) @ a.v_proj.weight[16 * g : 16 * g + 16]
    assert (f(IDS).logits - ref).abs().max() > 1e-4  # exact folds stay below 2e-5


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_fold_pairwise_exact_and_commutes_with_rope(kind):
    m = _tiny(kind)
    ref, kv = _capture_kv(m, IDS)
    g = torch.Generator().manual_seed(3)
    angles = [torch.rand(2, 8, generator=g) * 2 * math.pi for _ in range(2)]
    f = copy.deepcopy(m)
    rest = fold_pairwise(f, angles)
    assert all(not r.any() for r in rest)  # no QK-norm weights differ in a fresh model (all ones)
    out, kv_f = _capture_kv(f, IDS)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    for l in range(2):  # folded before RoPE == rotated after RoPE
        torch.testing.assert_close(kv_f[l][1], kv[l][1] @ pair_matrix(angles[l]), atol=1e-5, rtol=1e-5)


def test_block_hadamard_does_not_commute_with_rope():
    """A 2x2 Hadamard (det -1) folded before RoPE changes the model: it must run post-RoPE."""
    m = _tiny("llama")
    ref = m(IDS).logits
    f = copy.deepcopy(m)
    from rotkv.rotations.folding import _rotate_rows

    # block_hadamard on the RoPE pairs (i, i + D/2): permute to pair-adjacent order and back
    perm = torch.arange(16).reshape(2, 8).T.reshape(-1)
    bh = block_hadamard(16, 2)[perm.argsort()][:, perm.argsort()]
    with torch.no_grad():
        for a in attention_modules(f):
            _rotate_rows(a.q_proj, bh.expand(2, 16, 16), lambda b: b // 2)
            _rotate_rows(a.k_proj, bh.expand(2, 16, 16), lambda b: b)
    assert (f(IDS).logits - ref).abs().max() > 1e-4  # exact folds stay below 2e-5


def test_fold_pairwise_qk_norm_partial():
    """With unequal QK-norm weights on some pairs, only the equal pairs fold; the rest applied
    online (post-RoPE) completes the same rotation."""
    m = _tiny("qwen3")
    with torch.no_grad():
        for a in attention_modules(m):
            for norm in (a.q_norm, a.k_norm):
                norm.weight.uniform_(0.5, 1.5)
                norm.weight[8:12] = norm.weight[0:4]  # pairs 0..3 equal, 4..7 differ
            a.q_norm.weight[8:12] = a.q_norm.weight[0:4]
    assert foldable_pairs(attention_modules(m)[0]).tolist() == [True] * 4 + [False] * 4
    _, kv = _capture_kv(m, IDS)
    angles = [torch.full((2, 8), 0.7), torch.full((2, 8), -0.4)]
    f = copy.deepcopy(m)
    rest = fold_pairwise(f, angles)
    assert torch.equal(rest[0][:, :4], torch.zeros(2, 4)) and torch.allclose(rest[0][:, 4:], torch.full((2, 4), 0.7))
    _, kv_f = _capture_kv(f, IDS)
    for l in range(2):
        for i, heads in ((0, [0, 0, 1, 1]), (1, [0, 1])):  # queries (GQA: head h reads g = h // 2), keys
            full = kv[l][i] @ pair_matrix(angles[l])[heads]
            online = kv_f[l][i] @ pair_matrix(rest[l])[heads]
            torch.testing.assert_close(online, full, atol=1e-5, rtol=1e-5)
