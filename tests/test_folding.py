"""Weight folding: R_V into v_proj / o_proj, pairwise SO(2) into q_proj / k_proj (exact in fp32)."""

import copy
import math

import pytest
import torch

from rotkv.calibrate.capture import capturing
from rotkv.hf.models import attention_modules
from rotkv.hf.folding import fold_pairwise, fold_values, foldable_pairs
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
    from rotkv.hf.folding import _rotate_rows

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


# ---- a built cache's R_V folded into the model (RotkvCache.fold_values) and the bench's +fold ----------
KW = dict(sink=4, window=8, page_size=4, prefill_chunk=16)  # 40 tokens: sink, a 28-token INT2 body, window
IDS2 = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(1))


def _run(model, cache):
    """Prefill IDS2 then one decode step through ``cache``: (logits of both, the value body's tensors)."""
    from rotkv.hf.compat import cache_kwarg

    arg = cache_kwarg(model)
    with torch.no_grad():
        logits = torch.cat([model(IDS2, **{arg: cache}).logits, model(IDS2[:, :1], **{arg: cache}).logits], 1)
    return logits, [dict(layer.pools.body[1]) for layer in cache.layers]


def _attn_weights(model):
    return [p.detach().clone() for a in attention_modules(model) for p in (*a.v_proj.parameters(), *a.o_proj.parameters())]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("rotation", ["hadamard", "random"])
def test_fold_cache_values_same_codes_and_logits(kind, rotation):
    from rotkv.cache import RotkvCache

    m = _tiny(kind)  # with random v_proj / o_proj biases
    ref, ref_body = _run(m, RotkvCache(m, "quarot-int2", rotation=rotation, **KW))
    f = copy.deepcopy(m)
    cache = RotkvCache(f, "quarot-int2", rotation=rotation, **KW)
    for layer in cache.layers:  # the split bf16 matrices LayerRotation.to(cuda) makes, made here on the CPU
        layer.rotation = layer.rotation_cpu.to("cpu")
        for which in ("keys", "values", "queries", "outputs"):
            layer.rotation._bf16x2(which)
    cache.fold_values(f)
    assert f.config.rotkv_values_folded
    for layer, lp in zip(cache.layers, cache.plan.layers):
        assert layer.rotation_cpu.R_V is None and layer.rotation.R_V is None and lp.rotation.R_V is None
        assert layer.rotation.R_K is not None and set(layer.rotation._split) == {"keys", "queries"}
    got, body = _run(f, cache)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert (ref[:, :40] - m(IDS2).logits).abs().max() > 1e-3  # the INT2 body matters: a wrong fold would show
    for a, b in zip(ref_body, body):  # the quantizer saw the same rotated values
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_fold_cache_values_checks_o_proj():
    """A check that can fail: with o_proj left unfolded the folded cache's outputs are wrong."""
    from rotkv.cache import RotkvCache

    m = _tiny("llama")
    ref, _ = _run(m, RotkvCache(m, "quarot-int2", rotation="random", **KW))
    f = copy.deepcopy(m)
    cache = RotkvCache(f, "quarot-int2", rotation="random", **KW)
    cache.fold_values(f)
    with torch.no_grad():
        for a, b in zip(attention_modules(f), attention_modules(m)):
            a.o_proj.weight.copy_(b.o_proj.weight)
    got, _ = _run(f, cache)
    assert (got - ref).abs().max() > 1e-2


def test_fold_cache_values_once():
    from rotkv.cache import RotkvCache

    m = _tiny("llama")
    cache = RotkvCache(m, "quarot-int2", rotation="random", **KW)
    cache.fold_values(m)
    folded = _attn_weights(m)
    cache.fold_values(m)  # its R_V are gone: nothing to fold
    again = RotkvCache(m, "quarot-int2", rotation="random", **KW)  # the same matrices: left out of the cache
    assert all(layer.rotation_cpu.R_V is None for layer in again.layers)
    again.fold_values(m)
    RotkvCache(m, "naive-int2", **KW).fold_values(m)  # no R_V
    assert all(torch.equal(a, b) for a, b in zip(folded, _attn_weights(m)))
    with pytest.raises(ValueError, match="other value rotations folded"):
        RotkvCache(m, "quarot-int2", rotation="random", seed=1, **KW)  # a model folded with other matrices


def test_fold_cache_values_leaves_layers_without_r_v():
    from rotkv.cache import RotkvCache
    from rotkv.hf.folding import without_values

    m = _tiny("llama")
    before = [_attn_weights(m)[:4], _attn_weights(m)[4:]]  # layer 0's v/o weights and biases, layer 1's
    cache = RotkvCache(m, "quarot-int2", rotate_values=False, **KW)
    cache.fold_values(m)
    assert not getattr(m.config, "rotkv_values_folded", False)  # nothing to fold: not marked
    cache = RotkvCache(m, "quarot-int2", **KW)
    cache.layers[1].rotation_cpu = without_values(cache.layers[1].rotation_cpu)
    cache.fold_values(m)
    after = [_attn_weights(m)[:4], _attn_weights(m)[4:]]
    assert not torch.equal(before[0][0], after[0][0])
    assert all(torch.equal(a, b) for a, b in zip(before[1], after[1]))


def test_bench_fold_method_parses_runs_and_restores_the_model(monkeypatch):
    from rotkv.bench import parse_method, run_method, values_restored
    from rotkv.cache import RotkvCache

    assert parse_method("rotkv:quarot-int2+fold") == ("quarot-int2", {"fold"})
    assert parse_method("rotkv:quarot-int2+graph+fold") == ("quarot-int2", {"graph", "fold"})
    assert parse_method("rotkv:quarot-int2") == ("quarot-int2", set())
    for bad in ("rotkv:quarot-int2+fold+fold", "rotkv:quarot-int2+foo", "quarot-int2+fold", "rotkv:+fold"):
        assert parse_method(bad) is None, bad
    m = _tiny("qwen3")
    state = {k: v.clone() for k, v in m.state_dict().items()}
    ids = IDS2[:, :24]
    plain, _ = run_method(m, "rotkv:quarot-int2", ids, 4, overrides=KW)
    fold, seen = RotkvCache.fold_values, []

    def spy(cache, model):  # the run's model is folded, and its cache then holds no R_V
        fold(cache, model)
        seen.append(model.config.rotkv_values_folded and all(l.rotation_cpu.R_V is None for l in cache.layers))

    monkeypatch.setattr(RotkvCache, "fold_values", spy)
    folded, _ = run_method(m, "rotkv:quarot-int2+fold", ids, 4, overrides=KW)
    assert seen == [True] and torch.equal(plain.tokens, folded.tokens)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in state.items())  # bit-exact
    assert not hasattr(m.config, "rotkv_values_folded") and not hasattr(m.config, "rotkv_values_fingerprint")
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="boom"), values_restored(m):  # restored after a failing run too
        RotkvCache(m, "quarot-int2", **KW).fold_values(m)
        assert m.config.rotkv_values_folded
        raise RuntimeError("boom")
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in state.items())
    assert not hasattr(m.config, "rotkv_values_folded")
