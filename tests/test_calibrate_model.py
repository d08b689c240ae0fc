"""Calibration on the real SmolLM2 (shared session fixture); few tokens, so it stays fast."""

import pytest
import torch

from rotkv.calibrate.corpus import token_chunks
from rotkv.calibrate.error import output_error
from rotkv.calibrate.run import CalibConfig, calibrate, collect
from rotkv.hf.models import attention_modules
from rotkv.contract import validate_artifact
from rotkv.rotations.artifact import load_artifact, save_artifact
from rotkv.rotations.base import LayerRotation


@pytest.mark.slow
def test_oscar_artifact_on_smollm2(smollm2, tmp_path):
    model = smollm2.model
    cfg = CalibConfig(method="oscar", tokens=384, chunk_len=128, n_heldout=1, search_clips=False, progress=False)
    tensors, meta = calibrate(smollm2, cfg)
    path = str(tmp_path / "oscar.safetensors")
    save_artifact(path, tensors, meta)
    art = load_artifact(path)
    validate_artifact(art, model)
    assert art.meta["num_layers"] == "30" and art.meta["kv_heads"] == "3" and art.meta["head_dim"] == "64"
    assert art.meta["group_size"] == "64" and art.meta["calib_tokens"] == "256"
    # held-out (evaluation text): OSCAR + key mean stores INT2 keys and values with less output error
    # than no rotation, averaged over the layers
    ev = collect(model, token_chunks(smollm2.tokenizer, None, 128, 128, kind="eval"), 16, keep={0}, keep_kv=False,
                 progress=False)
    attn = attention_modules(model)
    errs = {"identity": [], "oscar+mean": []}
    for l, st in enumerate(ev.layers):
        w_o, sc = attn[l].o_proj.weight.detach().float(), float(attn[l].scaling)
        r = art.layer_rotation(l)
        errs["identity"].append(output_error(list(st.samples.values()), LayerRotation(), w_o, 2, 64, sink=16, scaling=sc))
        errs["oscar+mean"].append(output_error(list(st.samples.values()), r, w_o, 2, 64, r.clip_k, r.clip_v, 16, sc))
    avg = {k: sum(v) / len(v) for k, v in errs.items()}
    assert avg["oscar+mean"] < 0.7 * avg["identity"], avg
    # the preset runs from the artifact
    from rotkv.cache import RotkvCache
    from rotkv.hf import compat

    ids = token_chunks(smollm2.tokenizer, None, 64, 64, kind="eval")[0]
    with torch.no_grad():
        cache = RotkvCache(model, "oscar-int2", art, sink=4, window=8, prefill_chunk=32)
        logits = model(ids, **{compat.cache_kwarg(model): cache}).logits
    assert torch.isfinite(logits).all() and cache.bits_per_element() > 2
