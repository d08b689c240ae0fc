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
    model(input_ids=ids.to(model.device), use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})


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


@dataclass
class BatchRun:
    """Greedy tokens ``[B, new]`` and the timings of a batched run (seconds; steps synchronized)."""

    tokens: torch.Tensor
    prefill_s: float
    step_s: list[float]

    @property
    def step_ms(self) -> float:
        """Median decode step (the first, which warms up or captures, excluded when there are others)."""
        steps = self.step_s[1:] if len(self.step_s) > 1 else self.step_s
        return 1000 * sorted(steps)[len(steps) // 2] if steps else 0.0


def _sync(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def generate_batch(model, ids: torch.Tensor, cache, max_new_tokens: int, attention_mask: torch.Tensor | None = None,
                   cuda_graph: bool = False) -> BatchRun:
    """Prefill ``ids [B, L]`` (left padded where ``attention_mask`` says so) into ``cache`` in one
    call, then decode greedily one token per row per step.

    ``cache`` is any transformers cache (rotkv's or transformers' own). With ``cuda_graph=True``
    (a RotkvCache on CUDA) the decode step is captured once and replayed (``rotkv.cache.graph``).
    """
    dev = model.device
    ids = ids.to(dev)
    kw = cache_kwarg(model)
    mask = attention_mask.to(dev) if attention_mask is not None else None
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0) if mask is not None else None
    t0 = _sync(dev)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **{kw: cache})
    tok = out.logits[:, -1].argmax(-1)  # logits_to_keep: not [B, L, vocab] float32 (4 GB at 20K tokens here)
    prefill_s = _sync(dev) - t0
    lengths = (mask.long().sum(-1) if mask is not None else torch.full((ids.shape[0],), ids.shape[1], device=dev))
    graph = None
    if cuda_graph:
        from rotkv.cache.graph import GraphDecoder

        graph = GraphDecoder(model, cache, int(lengths.max()) + max_new_tokens, kw)
    new, steps = [tok], []
    for _ in range(max_new_tokens - 1):
        t = _sync(dev)
        if graph is not None:
            logits = graph.step(tok, lengths)
        else:
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            logits = model(input_ids=tok[:, None], attention_mask=mask, position_ids=lengths[:, None], use_cache=True,
                           **{kw: cache}).logits[:, -1]
        tok = logits.argmax(-1)
        lengths = lengths + 1
        new.append(tok)
        steps.append(_sync(dev) - t)
    return BatchRun(torch.stack(new, 1), prefill_s, steps)
