"""The cache inside a model: exactness of rotation + mean-centering, padding, presets, bad input."""

import os

import pytest
import torch

from rotkv.cache import RotkvCache
from rotkv.config import CacheSpec, get_preset
from rotkv.hf.compat import cache_kwarg
from rotkv.hf.fingerprint import model_meta
from rotkv.rotations.artifact import ArtifactMismatch, save_artifact
from rotkv.rotations.identity import random_orthogonal

from rotkv_testing import make_tiny_llama


def write_random_artifact(model, path, seed=0):
    """Different R_K, R_V per KV head and random key means."""
    layers, h, d = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    t = {}
    for l in range(layers):
        t[f"R_K.{l}"] = torch.stack([random_orthogonal(d, seed + 10 * l + i) for i in range(h)])
        t[f"R_V.{l}"] = torch.stack([random_orthogonal(d, seed + 10 * l + i + 5) for i in range(h)])
        t[f"k_mean.{l}"] = torch.randn(h, d)
    meta = model_meta(model, "tiny") | {"method": "test", "bits": 2, "group_size": d}
    save_artifact(str(path), t, meta)


def logits_through(model, ids, cache, mask=None):
    return model(input_ids=ids, attention_mask=mask, **{cache_kwarg(model): cache}).logits


def test_rotation_and_mean_centering_are_exact_in_fp32(tiny_llama, tmp_path):
    write_random_artifact(tiny_llama, tmp_path / "a.safetensors")
    ids = torch.randint(1, 128, (1, 40))
    with torch.no_grad():
        ref = tiny_llama(input_ids=ids).logits
        spec = CacheSpec(bits=None, rotation="artifact", key_mean=True, tier_dtype="float32", prefill_chunk=16)
        cache = RotkvCache(tiny_llama, spec, str(tmp_path / "a.safetensors"))
        out = logits_through(tiny_llama, ids[:, :30], cache)
        step = logits_through(tiny_llama, ids[:, 30:], cache)  # decode-style continuation
    assert torch.allclose(out, ref[:, :30], atol=1e-4, rtol=1e-4)
    assert torch.allclose(step, ref[:, 30:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("preset", ["quarot-int2", "kivi-2", "int4"])
def test_left_padded_batch_equals_each_request_alone(tiny_llama, preset):
    torch.manual_seed(3)
    a, b = torch.randint(1, 128, (37,)), torch.randint(1, 128, (22,))
    ids = torch.zeros(2, 37, dtype=torch.long)
    mask = torch.zeros(2, 37, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 15:], mask[1, 15:] = b, 1
    kw = dict(sink=4, window=8, page_size=4, prefill_chunk=16)
    gen = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        batch = tiny_llama.generate(input_ids=ids, attention_mask=mask, output_scores=True, return_dict_in_generate=True,
                                    **{cache_kwarg(tiny_llama): RotkvCache(tiny_llama, preset, **kw)}, **gen)
        for row, x in ((0, a), (1, b)):
            alone = tiny_llama.generate(input_ids=x[None], attention_mask=torch.ones(1, len(x), dtype=torch.long),
                                        output_scores=True, return_dict_in_generate=True,
                                        **{cache_kwarg(tiny_llama): RotkvCache(tiny_llama, preset, **kw)}, **gen)
            assert torch.equal(batch.sequences[row, 37:], alone.sequences[0, len(x):])
            for s_b, s_a in zip(batch.scores, alone.scores):
                assert torch.allclose(s_b[row], s_a[0], atol=1e-4)


def test_sampled_generation_is_reproducible(tiny_llama):
    ids = torch.randint(1, 128, (1, 20))
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        outs.append(tiny_llama.generate(input_ids=ids, do_sample=True, top_k=20, max_new_tokens=10, pad_token_id=0,
                                        **{cache_kwarg(tiny_llama): RotkvCache(tiny_llama, "quarot-int2", sink=2, window=4, page_size=2)}))
    assert torch.equal(outs[0], outs[1]) and outs[0].shape[1] == 30


def test_plain_model_still_works_after_switching(tiny_llama):
    ids = torch.randint(1, 128, (1, 12))
    with torch.no_grad():
        ref = tiny_llama(input_ids=ids).logits
        RotkvCache(tiny_llama, "quarot-int2")
        again = tiny_llama(input_ids=ids).logits  # DynamicCache through the rotkv attention fallback
    assert tiny_llama.config._attn_implementation == "rotkv"
    assert torch.allclose(ref, again, atol=1e-5)


def test_stats_report_measured_bits(tiny_llama):
    cache = RotkvCache(tiny_llama, "naive-int2", sink=4, window=8, page_size=4, group_size=16)
    with torch.no_grad():
        logits_through(tiny_llama, torch.randint(1, 128, (1, 100)), cache)
    st = cache.stats()
    assert st["body_bits_per_element"] == pytest.approx(2 + 32 / 16)
    tokens, tier = 100, 4 + 8 + (100 - 12) % 4
    expect = (tier * 16 + (tokens - tier) * 4) / tokens
    assert st["bits_per_element"] == pytest.approx(expect)
    assert st["kv_bytes_bf16"] == 2 * 2 * tokens * 2 * 16 * 2


# ---- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,value,match", [
    ("bits", 3, "bits"), ("sink", -1, "sink"), ("window", -5, "window"), ("clip_k", 1.5, "clip_k"),
    ("rotation", "fancy", "rotation"), ("page_size", 0, "page_size"),
])
def test_bad_spec_values_name_the_field(field, value, match):
    with pytest.raises(ValueError, match=match):
        get_preset("quarot-int2", **{field: value})


def test_group_must_divide_head_dim(tiny_llama):
    with pytest.raises(ValueError, match="group_size"):
        RotkvCache(tiny_llama, "naive-int2", group_size=12)


def test_hadamard_needs_power_of_two_head_dim():
    model = make_tiny_llama(head_dim=24)
    with pytest.raises(ValueError, match="power of two"):
        RotkvCache(model, "quarot-int2", group_size=24)


def test_artifact_presets_need_an_artifact(tiny_llama):
    with pytest.raises(ValueError, match="rotkv calibrate --method oscar"):
        RotkvCache(tiny_llama, "oscar-int2")


def test_artifact_for_another_model_is_refused(tiny_llama, tmp_path):
    other = make_tiny_llama(seed=1)  # same shapes, other weights
    write_random_artifact(other, tmp_path / "o.safetensors")
    with pytest.raises(ArtifactMismatch, match="weights_fingerprint"):
        RotkvCache(tiny_llama, "oscar-int2", str(tmp_path / "o.safetensors"))
    deeper = make_tiny_llama(layers=3)
    write_random_artifact(deeper, tmp_path / "d.safetensors")
    with pytest.raises(ArtifactMismatch, match="num_layers"):
        RotkvCache(tiny_llama, "oscar-int2", str(tmp_path / "d.safetensors"))


def test_unsupported_architecture_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    from rotkv.hf.models import UnsupportedModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=64))
    with pytest.raises(UnsupportedModel):
        RotkvCache(model, "quarot-int2")


def test_mean_centering_refused_with_softcapping(tiny_llama, tmp_path):
    write_random_artifact(tiny_llama, tmp_path / "a.safetensors")
    tiny_llama.config.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="soft-capping"):
        RotkvCache(tiny_llama, "oscar-int2", str(tmp_path / "a.safetensors"))


def test_local_hf_directory_loads(tmp_path, smollm2):
    """Any local Hugging Face model directory works (here a tiny random Llama with SmolLM2's tokenizer)."""
    from rotkv.hf.models import load_model, resolve_model_path

    model = make_tiny_llama()
    model.resize_token_embeddings(len(smollm2.tokenizer))
    model.save_pretrained(tmp_path)
    smollm2.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), device="cpu")
    assert loaded.model.config.num_hidden_layers == 2 and loaded.model_id == tmp_path.name
    # a .gguf path: the one the fixture loaded ($ROTKV_GGUF where the package is not installed)
    gguf = os.environ.get("ROTKV_GGUF") or "/".join(resolve_model_path(None)[:2])
    assert resolve_model_path(gguf)[1] == os.path.basename(gguf)
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model_path(str(tmp_path / "missing"))


def test_per_layer_key_bits_and_float8_metadata_are_what_is_stored(tiny_llama):
    ids = torch.randint(1, 128, (1, 100))
    base = dict(sink=4, window=8, page_size=4, group_size=16)
    measured = {}
    for name, extra in {"int2": {}, "k4": {"k_bits": "1:4"}, "fp8": {"meta_k": "float8", "meta_v": "float8"}}.items():
        cache = RotkvCache(tiny_llama, "naive-int2", **base, **extra)
        with torch.no_grad():
            logits_through(tiny_llama, ids, cache)
        measured[name] = cache.stats()["body_bits_per_element"]
        if name == "k4":
            assert [layer.key_codec.bits for layer in cache.layers] == [2, 4]
            assert [layer.value_codec.bits for layer in cache.layers] == [2, 2]
            assert cache.layers[1].key_codec.clip == 1.0  # fitted clips are for `bits`: not used at 4 bits
    layers = len(tiny_llama.model.layers)
    assert measured["int2"] == pytest.approx(2 + 32 / 16)
    # one layer's keys (a quarter of the body at 2 layers) move from 2 + 2 to 4 + 2 bits per element
    assert measured["k4"] == pytest.approx(2 + 32 / 16 + 2 / (2 * layers))
    assert measured["fp8"] == pytest.approx(2 + 16 / 16)


@pytest.mark.parametrize("extra,match", [({"k_bits": "0-9:4"}, "has 2 layers"), ({"k_bits": "1"}, "k_bits"),
                                         ({"meta_v": "e4m3"}, "meta_v")])
def test_bad_key_bits_and_meta_name_the_field(tiny_llama, extra, match):
    with pytest.raises(ValueError, match=match):
        RotkvCache(tiny_llama, "naive-int2", **extra)


def test_key_widths_from_the_artifact(tiny_llama, tmp_path):
    from rotkv.calibrate.keybits import with_key_bits
    from rotkv.rotations.artifact import load_artifact

    import numpy as np

    path = tmp_path / "a.safetensors"
    write_random_artifact(tiny_llama, path)
    art = load_artifact(str(path))
    tensors, meta = with_key_bits(art, np.array([0.01, 0.05]), 1)
    assert tensors["k_bits"].tolist() == [2, 4]  # the larger gain gets 4 bits
    save_artifact(str(tmp_path / "b.safetensors"), tensors, meta)
    cache = RotkvCache(tiny_llama, get_preset("quarot-int2", rotation="artifact", k_bits="artifact", meta_v="float8"),
                       str(tmp_path / "b.safetensors"), sink=4, window=8, page_size=4, group_size=16)
    assert [layer.key_codec.bits for layer in cache.layers] == [2, 4]
    assert [layer.value_codec.meta for layer in cache.layers] == ["float8", "float8"]
    with pytest.raises(ValueError, match="k_bits"):  # an artifact without widths
        RotkvCache(tiny_llama, get_preset("quarot-int2", rotation="artifact", k_bits="artifact"), str(path))
    with pytest.raises(ValueError, match="rotation"):
        get_preset("quarot-int2", k_bits="artifact")


def test_out_of_range_e4m3_metadata_raises_at_the_next_call_and_at_the_end_of_prefill(tiny_llama):
    """The GPU write marks e4m3 groups out of range in a device flag without a sync; the cache reads
    the flags once per model call (at layer 0) and at the end of rotkv's prefill. Here the flag is
    set by hand (the CPU encoder raises at once), as the kernel would set it."""
    from rotkv.generation import prefill

    ids = torch.randint(1, 128, (2, 40))
    cache = RotkvCache(tiny_llama, "naive-int2", sink=4, window=8, page_size=4, group_size=16, meta_v="float8")
    with torch.no_grad():
        prefill(tiny_llama, ids, cache, chunk=20)
    cache.check_metadata_range()  # no flag set: nothing raised (and no flags at all on the CPU path)
    assert all(f is None for layer in cache.layers for f in layer.pools.range_flags)
    layer = cache.layers[1]
    layer.pools.range_flags = [torch.tensor(False), torch.tensor(False)]
    cache.check_metadata_range()  # flags present, none set
    layer.pools.range_flags[1] = torch.tensor(True)
    with pytest.raises(ValueError, match="layer 1 values"):
        cache.check_metadata_range()
    with torch.no_grad(), pytest.raises(ValueError, match=r"range of the float8_e4m3fn.*layer 1 values"):
        tiny_llama(input_ids=ids[:, :1], past_key_values=cache, use_cache=True)  # raised at layer 0's update
    with torch.no_grad(), pytest.raises(ValueError, match="meta_k / meta_v"):
        prefill(tiny_llama, ids[:, :4], cache)
