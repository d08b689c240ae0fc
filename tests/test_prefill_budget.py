"""The prefill's per-call budget in bytes (rotkv.generation.prefill_tokens_of): tokens per call
from the model's config; an explicit token count still wins."""

import pytest
import torch
from transformers import LlamaConfig

from rotkv.cli.bench import prefill_tokens_arg
from rotkv.generation import DEFAULT_PREFILL_BYTES, prefill, prefill_chunk_of, prefill_tokens_of, reserve


def smollm2_like():
    return LlamaConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                       head_dim=64, num_hidden_layers=30, vocab_size=49152, torch_dtype=torch.bfloat16)


def qwen3_8b_like():
    return LlamaConfig(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, num_hidden_layers=36, vocab_size=151936, torch_dtype="bfloat16")


def test_smollm2_gets_two_calls_at_64_x_8k():
    assert DEFAULT_PREFILL_BYTES == 9 * 2**28  # 2.25 GiB
    assert prefill_tokens_of(smollm2_like()) == 262144  # 3 x 1536 bf16 = 9216 bytes a token
    assert prefill_chunk_of(None, 8192, rows=64, max_tokens="auto", model=smollm2_like()) == 4096  # 2 calls


def test_qwen3_8b_stays_at_or_below_65536():
    n = prefill_tokens_of(qwen3_8b_like())
    assert n == 32768 and n <= 65536  # 3 x 12288 bf16 = 72 KiB a token
    assert prefill_chunk_of(None, 4096, rows=64, max_tokens="auto", model=qwen3_8b_like()) == 512


def test_dtype_logits_and_budget():
    cfg = smollm2_like()
    assert prefill_tokens_of(cfg, dtype=torch.float32) == 131072
    assert prefill_tokens_of(cfg, logits_kept=False) == DEFAULT_PREFILL_BYTES // (49152 * 2)  # every position's logits
    assert prefill_tokens_of(cfg, budget_bytes=1) == 16  # never below 16
    with pytest.raises(ValueError, match="byte budget"):
        prefill_tokens_of(cfg, budget_bytes=0)


def test_model_dtype_from_its_parameters(tiny_llama):
    c = tiny_llama.config
    width = max(3 * c.intermediate_size, (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size)
    assert prefill_tokens_of(tiny_llama) == DEFAULT_PREFILL_BYTES // (width * 4)  # float32 weights
    assert prefill_tokens_of(tiny_llama.to(torch.bfloat16)) == DEFAULT_PREFILL_BYTES // (width * 2)


def test_explicit_tokens_win(tiny_llama):
    assert prefill_chunk_of(None, 4096, rows=64, max_tokens=65536, model=smollm2_like()) == 1024
    assert prefill_chunk_of(None, 4096, rows=64, max_tokens=None, model=smollm2_like()) == 4096
    with pytest.raises(ValueError, match="needs the model"):
        prefill_chunk_of(None, 4096, rows=64, max_tokens="auto")
    from rotkv.cache import RotkvCache

    calls = []
    hook = tiny_llama.model.embed_tokens.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[1]))
    try:
        ids = torch.randint(1, 128, (2, 70), generator=torch.Generator().manual_seed(0))
        for tokens, want in ((64, [32, 32, 6]), ("auto", [48, 22])):
            cache = RotkvCache(tiny_llama, "quarot-int2", prefill_chunk=48, check_finite=False,
                               sink=4, window=8, page_size=4, group_size=16)
            reserve(cache, 2, 70)
            calls.clear()
            prefill(tiny_llama, ids, cache, max_tokens=tokens)
            assert calls == want, tokens
    finally:
        hook.remove()


def test_cli_value():
    assert prefill_tokens_arg("auto") == "auto" and prefill_tokens_arg("4096") == 4096
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="expected a number of tokens .* or 'auto', got 'lots'"):
        prefill_tokens_arg("lots")  # argparse prints it naming --prefill-tokens
