"""Generation through a rotkv cache, with the prompt prefilled first and decode timed apart."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from rotkv.cache import RotkvCache
from rotkv.hf.compat import cache_kwarg


class _StepClock(LogitsProcessor):
    """Records the time of every decoding step (it sees the scores and returns them unchanged)."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        if scores.is_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return scores


@dataclass
class Generated:
    text: str
    new_tokens: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_tokens_per_s: float


def encode_prompt(tokenizer, text: str, chat: bool = True) -> torch.Tensor:
    """Token ids ``[1, n]``; with chat=True and a chat template, the text is one user message."""
    if chat and getattr(tokenizer, "chat_template", None):
        out = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        return out["input_ids"]
    return tokenizer(text, return_tensors="pt").input_ids


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache) -> None:
    """Run ``ids [1, n]`` through the model into the cache (chunked inside the cache)."""
    model(input_ids=ids.to(model.device), use_cache=True, **{cache_kwarg(model): cache})


@torch.no_grad()
def generate(model, tokenizer, ids: torch.Tensor, cache: RotkvCache, max_new_tokens: int = 64,
             do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
             context: torch.Tensor | None = None) -> Generated:
    """Generate after ``ids``. If ``context`` (a prefix of ids) is given, it is prefilled first, so the
    rest of the prompt (the question) is its own chunk and reads the stored, quantized context."""
    ids = ids.to(model.device)
    t0 = time.perf_counter()
    if context is not None:
        if not torch.equal(ids[:, : context.shape[1]].cpu(), context.cpu()):
            raise ValueError("`context` must be a prefix of the prompt ids")
        prefill(model, context, cache)
    clock = _StepClock()
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if do_sample else dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         logits_processor=LogitsProcessorList([clock]), pad_token_id=tokenizer.pad_token_id,
                         **sampling, **{cache_kwarg(model): cache})
    new = out[0, ids.shape[1]:].tolist()
    prefill_s = clock.times[0] - t0 if clock.times else time.perf_counter() - t0
    steps = len(clock.times) - 1
    rate = steps / (clock.times[-1] - clock.times[0]) if steps > 0 else 0.0
    text = tokenizer.decode(new, skip_special_tokens=True)
    return Generated(text, new, ids.shape[1], prefill_s, rate)
