"""Cache assembly (rotkv.cache.assembly): every layer resolved once, then built as resolved."""

import pytest
import torch

from rotkv.cache import RotkvCache
from rotkv.cache.assembly import plan_cache
from rotkv.cache.base import RotkvLayer
from rotkv.cache.codecs import ChannelCodec, TokenCodec
from rotkv.cache.layer import HybridLayer
from rotkv.cache.progressive import EvictingLayer, ProgressiveCodec, ProgressiveLayer, layer_budget
from rotkv.cache.rowstore import RowStoreLayer
from rotkv.config import CacheSpec, get_preset
from rotkv_testing import write_artifact

BASE = dict(group_size=16, sink=4, window=16, page_size=8, prefill_chunk=16, tier_dtype="float32")


def test_layers_share_one_base():
    assert issubclass(HybridLayer, RotkvLayer) and issubclass(RowStoreLayer, RotkvLayer)
    assert issubclass(ProgressiveLayer, RowStoreLayer) and issubclass(EvictingLayer, RowStoreLayer)


def test_fixed_width_plan_resolves_widths_and_clips_per_layer(tiny_llama):
    spec = CacheSpec(bits=2, clip_k=0.9, clip_v=0.8, k_bits="1:4", **BASE)
    plan = plan_cache(tiny_llama, spec)
    assert [lp.kind for lp in plan.layers] == ["paged", "paged"]
    assert [lp.widths for lp in plan.layers] == [(2, 2), (4, 2)]
    # keys at a width other than `bits` are not clipped (the clip ratios are fitted for `bits`)
    assert [(lp.codecs[0].clip, lp.codecs[1].clip) for lp in plan.layers] == [(0.9, 0.8), (1.0, 0.8)]
    assert all(lp.codecs[0].group_size == 16 for lp in plan.layers)
    cache = RotkvCache(tiny_llama, spec)
    assert all(isinstance(layer, HybridLayer) for layer in cache.layers)
    assert [(layer.key_codec.bits, layer.value_codec.bits) for layer in cache.layers] == [(2, 2), (4, 2)]
    assert all(layer.state is cache.state for layer in cache.layers)


def test_artifact_clips_and_layer_bits(tiny_llama, tmp_path):
    write_artifact(tiny_llama, tmp_path / "a.safetensors")
    spec = get_preset("oscar-int2", **BASE)
    plan = plan_cache(tiny_llama, spec, str(tmp_path / "a.safetensors"), layer_bits=[(4, 2), (2, 4)])
    assert plan.artifact is not None and plan.artifact.meta["method"] == "oscar"
    # widths from layer_bits; clip ratios and metadata stay what the spec and artifact resolve
    assert [lp.widths for lp in plan.layers] == [(4, 2), (2, 4)]
    assert [lp.codecs[0].clip for lp in plan.layers] == pytest.approx([0.96, 0.94])
    assert [lp.codecs[1].clip for lp in plan.layers] == pytest.approx([0.92, 0.9])
    assert plan.rotation_bytes == sum(lp.rotation.nbytes for lp in plan.layers) > 0


def test_kivi_plan(tiny_llama):
    plan = plan_cache(tiny_llama, get_preset("kivi-2"))
    kc, vc = plan.layers[0].codecs
    assert isinstance(kc, ChannelCodec) and isinstance(vc, TokenCodec) and vc.clip == 1.0


def test_budgeted_plans_are_built_directly(tiny_llama, tmp_path):
    prog = plan_cache(tiny_llama, CacheSpec(bits=2, start_bits=16, budget_tokens=160, **BASE))
    assert [lp.kind for lp in prog.layers] == ["progressive", "progressive"]
    lp = prog.layers[0]
    assert isinstance(lp.codecs[0], ProgressiveCodec) and lp.widths == (16, 16) and lp.final_bits == 2
    assert lp.budget == layer_budget(prog.spec, 2, 2, 16, 4)
    evict = plan_cache(tiny_llama, CacheSpec(bits=4, budget_tokens=48, **BASE))
    assert [lp.kind for lp in evict.layers] == ["evicting"] * 2 and evict.layers[0].widths == (4, 4)
    # a rotation-free budgeted preset reads only the artifact's final widths
    write_artifact(tiny_llama, tmp_path / "w.safetensors", method="pmkvq",
                   tensors={"bits": torch.tensor([4, 2], dtype=torch.int32)})
    cache = RotkvCache(tiny_llama, "pmkvq", str(tmp_path / "w.safetensors"), **BASE)
    assert [lp.final_bits for lp in cache.plan.layers] == [4, 2] and cache.artifact is not None
    assert all(isinstance(layer, ProgressiveLayer) for layer in cache.layers) and cache.widths() == [16, 16]


def test_bad_inputs_fail_before_any_layer(tiny_llama):
    with pytest.raises(ValueError, match="layer_bits needs one .* without a budget"):
        RotkvCache(tiny_llama, "pmkvq", layer_bits=[(2, 2), (2, 2)], **BASE)
    with pytest.raises(ValueError, match="layer_bits entries must be in"):
        RotkvCache(tiny_llama, "quarot-int2", layer_bits=[(2, 3), (2, 2)], **BASE)
    with pytest.raises(ValueError, match="decode_score .* `budget_tokens`"):
        RotkvCache(tiny_llama, "pmkvq", decode_score="bf16", **BASE)
    with pytest.raises(ValueError, match=r"`k_bits` names layers \[5\]"):
        plan_cache(tiny_llama, CacheSpec(bits=2, k_bits="5:4", **BASE))
    with pytest.raises(ValueError, match="needs a calibration artifact.*--method oscar-mix --out oscar-mix.safetensors"):
        plan_cache(tiny_llama, get_preset("oscar-mix", **BASE))
