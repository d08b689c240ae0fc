"""Gemma GGUF tokenizers: what transformers 5.17 gets wrong, and the tokenizer rebuilt from the file.

A Gemma (1-3) GGUF stores a sentencepiece vocabulary (tokenizer.ggml.model "llama") whose tokens,
in file order, are the merge order of Gemma's BPE; the file has no merges. transformers 5.17 turns it
into a Unigram model scored by tokenizer.ggml.scores (integrations/ggml.py, GGUFGemmaConverter), which
cuts words into short pieces and adds no <bos>; saved and loaded again (rotkv's converted copy),
GemmaTokenizer rebuilds that as a BPE model with no merges, which cuts text into characters. The
model's weights are right either way, but its perplexity is 5-200x too high. Later versions (5.25)
derive the merges from the token order (integrations/gguf/gguf_tokenizer_mapping.py, gemma_tokenizer);
rotkv does the same when the tokenizer it was given is not such a BPE model
(:func:`repair_gemma_tokenizer`, called by ``rotkv.hf.models.load_model`` for every GGUF file).
"""

from __future__ import annotations

import os
import warnings

from rotkv.hf.geometry import text_config

_GEMMA_SPM_ARCHS = ("gemma", "gemma2", "gemma3")
_GEMMA_MODEL_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text")


def gguf_gemma_tokenizer_fields(gguf_path: str) -> dict | None:
    """The tokenizer metadata of a Gemma (1-3) GGUF file with a sentencepiece vocabulary, None for any
    other file: tokens, token_type, merges (None when absent), add_bos/add_eos, the special token ids,
    chat_template. Reading a large vocabulary takes seconds."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf_path).fields

    def get(key, default=None):
        f = fields.get(key)
        return default if f is None else f.contents()

    if get("general.architecture") not in _GEMMA_SPM_ARCHS or get("tokenizer.ggml.model") != "llama":
        return None
    return {
        "tokens": list(get("tokenizer.ggml.tokens")),
        "token_type": list(get("tokenizer.ggml.token_type", [])),
        "merges": get("tokenizer.ggml.merges"),
        # llama.cpp adds <bos> to a sentencepiece vocabulary that does not say otherwise
        "add_bos": bool(get("tokenizer.ggml.add_bos_token", True)),
        "add_eos": bool(get("tokenizer.ggml.add_eos_token", False)),
        "bos_id": get("tokenizer.ggml.bos_token_id"),
        "eos_id": get("tokenizer.ggml.eos_token_id"),
        "unk_id": get("tokenizer.ggml.unknown_token_id"),
        "pad_id": get("tokenizer.ggml.padding_token_id"),
        "chat_template": get("tokenizer.chat_template"),
    }


def _merges_by_position(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary whose order is the merge order: every split of a token into
    two tokens, earlier tokens first (transformers' generate_merges with -position as the score)."""
    merges = []
    for token, index in vocab.items():
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((index, left, right) for left, right in local)
    merges.sort(key=lambda m: (-m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in merges]


def build_gemma_tokenizer(fields: dict):
    """A GemmaTokenizer (BPE) for a Gemma GGUF's tokenizer fields, the way transformers 5.25 builds it."""
    from tokenizers import AddedToken
    from transformers import GemmaTokenizer

    tokens = fields["tokens"]
    # a token of two or more spaces is stored as spaces; GemmaTokenizer looks it up as "\u2581"s
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {t: i for i, t in enumerate(spelled)}
    if fields.get("merges"):
        merges = [tuple(m.split(" ")) for m in fields["merges"]]
    else:
        merges = _merges_by_position(vocab)

    def name(key, default):
        i = fields.get(key)
        return tokens[i] if i is not None else default

    tok = GemmaTokenizer(vocab=vocab, merges=merges, unk_token=name("unk_id", "<unk>"),
                         bos_token=name("bos_id", "<bos>"), eos_token=name("eos_id", "<eos>"),
                         pad_token=name("pad_id", "<pad>"), add_bos_token=fields["add_bos"],
                         add_eos_token=fields["add_eos"])
    types = fields.get("token_type") or ()
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == 3]  # CONTROL
    if control:
        tok.add_tokens(control, special_tokens=True)
    known = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)  # USER_DEFINED, e.g. "\n\n": matched whole
            for t, k in zip(tokens, types) if k == 4 and t in known]
    if user:
        tok.add_tokens(user)
    if fields.get("chat_template"):
        tok.chat_template = fields["chat_template"]
    return tok


def gemma_tokenizer_problem(tok, add_bos: bool = True) -> str | None:
    """What is wrong with a tokenizer built from a Gemma GGUF file, or None: it must be a BPE model
    with merges that adds <bos> when add_bos."""
    import json

    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        return f"a {type(tok).__name__} without a tokenizers backend"
    model = json.loads(backend.model.__getstate__())
    if model.get("type") != "BPE":
        return f"a {model.get('type')} model instead of BPE"
    if not model.get("merges"):
        return "a BPE model without merges"
    ids = tok("a").input_ids
    if add_bos and (not ids or ids[0] != tok.bos_token_id):
        return "no <bos> at the start of a text"
    return None


def repair_gemma_tokenizer(tok, model, gguf_path: str, save_to: str | None):
    """The tokenizer itself when it is right for this Gemma GGUF model, else one rebuilt from the file
    (written to save_to, a converted copy, when given)."""
    import transformers

    if getattr(text_config(model.config), "model_type", None) not in _GEMMA_MODEL_TYPES:
        return tok
    problem = gemma_tokenizer_problem(tok)
    if problem is None:
        return tok
    fields = gguf_gemma_tokenizer_fields(gguf_path)
    if fields is None or gemma_tokenizer_problem(tok, fields["add_bos"]) is None:
        return tok
    warnings.warn(f"rotkv: transformers {transformers.__version__} built a wrong tokenizer for "
                  f"{os.path.basename(gguf_path)} ({problem}); rotkv rebuilds it from the file", stacklevel=3)
    fixed = build_gemma_tokenizer(fields)
    if save_to is not None:
        try:
            fixed.save_pretrained(save_to)
        except (OSError, ValueError, RuntimeError) as e:
            warnings.warn(f"rotkv: could not write the rebuilt tokenizer to {save_to} ({e})", stacklevel=3)
    return fixed
