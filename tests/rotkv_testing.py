"""Helpers shared by test modules (a uniquely named module: tests/kernels has its own conftest)."""

import torch


def make_tiny_llama(seed: int = 0, layers: int = 2, kv_heads: int = 2, q_heads: int = 4, head_dim: int = 16):
    """A random Llama with GQA (4 query / 2 KV heads, head_dim 16 by default): fast, for exactness tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=q_heads * head_dim, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, intermediate_size=128, num_hidden_layers=layers, vocab_size=128,
                      max_position_embeddings=4096, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()
