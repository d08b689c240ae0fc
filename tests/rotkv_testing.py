"""Helpers shared by test modules (a uniquely named module: tests/kernels has its own conftest)."""

import importlib.util
import os

import torch
from safetensors.torch import save_file

from rotkv.hf.fingerprint import model_meta
from rotkv.rotations.artifact import save_artifact
from rotkv.rotations.identity import random_orthogonal


def make_tiny_llama(seed: int = 0, layers: int = 2, kv_heads: int = 2, q_heads: int = 4, head_dim: int = 16):
    """A random Llama with GQA (4 query / 2 KV heads, head_dim 16 by default): fast, for exactness tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=q_heads * head_dim, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, intermediate_size=128, num_hidden_layers=layers, vocab_size=128,
                      max_position_embeddings=4096, pad_token_id=0)
    return LlamaForCausalLM(cfg).eval()


def write_artifact(model, path, method="oscar", bits=2, group_size=16, tensors=None, drop=(), **meta_extra):
    """A hand-made artifact for the tiny Llama (2 layers, 2 KV heads, head_dim 16), contract fields given."""
    t = {}
    for l in range(2):
        t[f"R_K.{l}"] = torch.stack([random_orthogonal(16, 10 * l + i) for i in range(2)])
        t[f"R_V.{l}"] = torch.stack([random_orthogonal(16, 10 * l + i + 5) for i in range(2)])
        t[f"k_mean.{l}"] = torch.randn(2, 16)
    t["clip_k"], t["clip_v"] = torch.tensor([0.96, 0.94]), torch.tensor([0.92, 0.9])
    t.update(tensors or {})
    meta = model_meta(model, "tiny") | {"method": method, "bits": bits, "group_size": group_size} | meta_extra
    for k in drop:
        meta.pop(k)
    if "format_version" in drop:  # a file from before versioning: save_artifact would refuse to write it
        save_file(t, str(path), metadata={k: str(v) for k, v in meta.items()})
    else:
        save_artifact(str(path), t, meta)
    return str(path)


def char_tokenizer():
    """A character-level fast tokenizer over printable ASCII (ids = code points, < 128), built in memory:
    tiny models get a real tokenizer without any download."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "\n": 10}
    vocab.update({chr(i): i for i in range(32, 127)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")


def save_tiny_llama_dir(path, seed: int = 0, **kw) -> str:
    """The tiny random Llama (vocab 128) and :func:`char_tokenizer` saved as a local Hugging Face directory."""
    model = make_tiny_llama(seed, **kw)
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    model.save_pretrained(str(path))
    char_tokenizer().save_pretrained(str(path))
    return str(path)


def load_benchmark(name: str, folder: str = "benchmarks"):
    """The script ``<folder>/<name>.py`` as a module (benchmarks/ and studies/ hold scripts, not packages)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, folder, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
