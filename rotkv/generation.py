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


DEFAULT_PREFILL_CHUNK = 4096  # tokens per row per model call for caches without a spec (transformers' own)
# the activations' bound of one prefill call over the whole batch, in bytes of its largest per-token
# activation (:func:`prefill_tokens_of`): 2.25 GiB, i.e. 262144 tokens per call for SmolLM2-135M
# (3 x 1536 bf16 MLP values a token: 2 calls at 64 x 8K) and 32768 for Qwen3-8B (3 x 12288)
DEFAULT_PREFILL_BYTES = 9 << 28
DEFAULT_PREFILL_TOKENS = "auto"  # tokens per model call over the batch: from the model (prefill_tokens_of)


def prefill_tokens_of(model, budget_bytes: int | None = None, dtype: torch.dtype | None = None,
                      logits_kept: bool = True) -> int:
    """Tokens per prefill call over the whole batch such that the call's largest per-token
    activation fits in ``budget_bytes`` (default :data:`DEFAULT_PREFILL_BYTES`).

    ``model``: a model or its config. The largest per-token activation is ``max(3 * intermediate_size``
    (the gated MLP's gate, up and their product live at once), ``(heads + 2 kv_heads) * head_dim``
    (q, k, v), ``hidden_size``, and ``vocab_size`` when the logits of every position are kept
    (``logits_kept`` False: a model without ``logits_to_keep``)) elements of ``dtype`` (default: the
    model's parameters, else the config's dtype, else float32). At least 16."""
    budget = DEFAULT_PREFILL_BYTES if budget_bytes is None else int(budget_bytes)
    if budget < 1:
        raise ValueError(f"the prefill byte budget has to be >= 1 but got {budget}")
    cfg = getattr(model, "config", model)
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    if dtype is None and isinstance(model, torch.nn.Module):
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is None:
        dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.replace("torch.", ""), torch.float32)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or (hidden // heads if heads else 0))
    width = max(3 * int(getattr(cfg, "intermediate_size", 0) or 0), (heads + 2 * kv) * head_dim, hidden,
                0 if logits_kept else int(getattr(cfg, "vocab_size", 0) or 0), 1)
    return max(16, budget // (width * torch.empty(0, dtype=dtype).element_size()))


def prefill_chunk_of(cache, chunk: int | None = None, rows: int = 1, max_tokens: int | str | None = None,
                     model=None) -> int:
    """The model-level prefill chunk (tokens per row per call): ``chunk`` if given, else the cache's
    own attention chunk (``CacheSpec.prefill_chunk``, so every model call is one attention step of
    the cache and the stored history is dequantized once per layer per call), else
    :data:`DEFAULT_PREFILL_CHUNK`; then at most ``max_tokens // rows`` (not below 16), so that one
    call of a large batch holds at most about ``max_tokens`` tokens of activations (None: no bound;
    ``"auto"``: :func:`prefill_tokens_of` ``model``, the byte budget's tokens)."""
    if max_tokens == "auto":
        if model is None:
            raise ValueError('prefill_tokens="auto" needs the model (its config sets the tokens per call)')
        max_tokens = prefill_tokens_of(model, logits_kept=not hasattr(model, "forward") or _keeps_logits(model))
    if chunk is None:
        spec = getattr(cache, "spec", None)
        chunk = getattr(spec, "prefill_chunk", None) or DEFAULT_PREFILL_CHUNK
    if int(chunk) < 1:
        raise ValueError(f"the prefill chunk has to be >= 1 but got {chunk}")
    if max_tokens is not None:
        if max_tokens < 1:
            raise ValueError(f"the prefill token budget has to be >= 1 but got {max_tokens}")
        chunk = min(int(chunk), max(16, max_tokens // max(rows, 1)))
    return int(chunk)


def _keeps_logits(model) -> bool:
    import inspect

    return "logits_to_keep" in inspect.signature(model.forward).parameters


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None,
            chunk: int | None = None, max_tokens: int | str | None = DEFAULT_PREFILL_TOKENS) -> torch.Tensor:
    """Run ``ids [B, n]`` through the model into ``cache`` in calls of ``chunk`` tokens per row
    (:func:`prefill_chunk_of`: the cache's chunk by default, at most ``max_tokens // B``; ``max_tokens``
    ``"auto"``, the default: the tokens of :data:`DEFAULT_PREFILL_BYTES` for this model,
    :func:`prefill_tokens_of`; None: no bound) and return the logits of the last position ``[B, vocab]``.

    Each call asks for the last position's logits only (``logits_to_keep=1``), so the activations
    are those of one chunk (``B * chunk`` tokens), never of the whole prompt. ``attention_mask``
    (left padding) covers the tokens already in the cache and ``ids``: ``[B, past + n]``. Chunks
    are counted from the start of the call, so a left-padded row's first chunk holds fewer of its
    own tokens (each chunk still attends to the stored, quantized cache of the earlier ones).
    """
    dev = model.device
    ids = ids.to(dev)
    b, n = ids.shape
    if n < 1:
        raise ValueError("prefill needs at least one token")
    chunk = prefill_chunk_of(cache, chunk, b, max_tokens, model)
    past = cache.get_seq_length() if hasattr(cache, "get_seq_length") else 0
    kw = {cache_kwarg(model): cache}
    if _keeps_logits(model):
        kw["logits_to_keep"] = 1
    mask = attention_mask.to(dev) if attention_mask is not None else None
    if mask is not None:
        if mask.shape != (b, past + n):
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, expected [batch, cached + new tokens] = "
                             f"{[b, past + n]}")
        pos = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
    else:
        pos = torch.arange(past, past + n, device=dev)[None].expand(b, -1)
    logits = None
    for c0 in range(0, n, chunk):
        c1 = min(c0 + chunk, n)
        out = model(input_ids=ids[:, c0:c1], attention_mask=mask[:, : past + c1] if mask is not None else None,
                    position_ids=pos[:, c0:c1], use_cache=True, **kw)
        logits = out.logits[:, -1]
        del out
    _check_range(cache)
    return logits


def _check_range(cache) -> None:
    """A rotkv cache's deferred check of the kernel writes' e4m3 metadata (one sync; see
    ``RotkvCache.check_metadata_range``); other caches have none."""
    if hasattr(cache, "check_metadata_range"):
        cache.check_metadata_range()


@torch.no_grad()
def generate(model, tokenizer, ids: torch.Tensor, cache: RotkvCache, max_new_tokens: int = 64,
             do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
             context: torch.Tensor | None = None, prefill_chunk: int | None = None) -> Generated:
    """Generate after ``ids [1, n]``. The prompt is prefilled in chunks of ``prefill_chunk`` tokens
    (default: the cache's ``prefill_chunk``), so the prefill's memory is one chunk's: every whole
    chunk but the last by :func:`prefill`, then ``model.generate`` runs the last (at most one chunk,
    last-position logits only) and decodes; the chunk boundaries are those of one call chunked by
    the cache. If ``context`` (a prefix of ids) is given, it is prefilled on its own first, so the
    rest of the prompt (the question) starts its own chunk and reads the stored, quantized context.
    A fresh rotkv cache first reserves its pages for ``n + max_new_tokens`` tokens (:func:`reserve`)."""
    ids = ids.to(model.device)
    reserve(cache, ids.shape[0], ids.shape[1] + max_new_tokens)
    t0 = time.perf_counter()
    done = 0
    if context is not None:
        if not torch.equal(ids[:, : context.shape[1]].cpu(), context.cpu()):
            raise ValueError("`context` must be a prefix of the prompt ids")
        prefill(model, context, cache, chunk=prefill_chunk)
        done = context.shape[1]
    chunk = prefill_chunk_of(cache, prefill_chunk)
    whole = done + (ids.shape[1] - done - 1) // chunk * chunk  # the last chunk is left to model.generate
    if whole > done:
        prefill(model, ids[:, done:whole], cache, chunk=chunk)
    clock = _StepClock()
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p) if do_sample else dict(do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         logits_processor=LogitsProcessorList([clock]), pad_token_id=tokenizer.pad_token_id,
                         **sampling, **{cache_kwarg(model): cache})
    _check_range(cache)  # the last call's writes (each call checks the ones before it)
    new = out[0, ids.shape[1]:].tolist()
    prefill_s = clock.times[0] - t0 if clock.times else time.perf_counter() - t0
    steps = len(clock.times) - 1
    rate = steps / (clock.times[-1] - clock.times[0]) if steps > 0 else 0.0
    text = tokenizer.decode(new, skip_special_tokens=True)
    return Generated(text, new, ids.shape[1], prefill_s, rate)


def reserve(cache, rows: int, tokens: int) -> None:
    """Grow a fresh rotkv cache's free lists to what ``rows`` rows of ``tokens`` tokens need (body
    pages, and tier pages for sink + the largest window + a page, or every token for an unquantized preset), so
    the pools are allocated once at their size instead of growing by 25% steps (each a copy, and
    up to a quarter of the pool unused). Does nothing for other caches or a cache in use."""
    st = getattr(cache, "state", None)
    if st is None or not hasattr(st, "tier_free") or st.rows or st.seen:
        return
    p = st.page
    if st.quantized:
        tier = st.tier_pages_for(tokens)
        body = -(-tokens // p)
    else:
        tier, body = -(-(st.pad + tokens) // p) + 1, 0
    st.tier_free.grow(rows * tier)
    st.body_free.grow(max(1, rows * body))


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
                   cuda_graph: bool = False, prefill_chunk: int | None = None,
                   prefill_tokens: int | str | None = DEFAULT_PREFILL_TOKENS,
                   compile_layers: bool = False) -> BatchRun:
    """Prefill ``ids [B, L]`` (left padded where ``attention_mask`` says so) into ``cache`` in
    chunks of ``prefill_chunk`` tokens per row, at most ``prefill_tokens`` per call (:func:`prefill`;
    ``"auto"``: from the model's config and :data:`DEFAULT_PREFILL_BYTES`),
    then decode greedily one token per row per step. A fresh rotkv cache first reserves its pages
    for ``L + max_new_tokens`` tokens per row (:func:`reserve`), so its pools are sized once.

    ``cache`` is any transformers cache (rotkv's or transformers' own). With ``cuda_graph=True``
    (a RotkvCache on CUDA) the decode step is captured once and replayed (``rotkv.cache.graph``);
    ``compile_layers=True`` (with ``cuda_graph``) captures the model's own layers compiled
    (``rotkv.cache.compiled``).
    """
    if compile_layers and not cuda_graph:
        raise ValueError("compile_layers compiles the captured decode step: pass cuda_graph=True too")
    dev = model.device
    ids = ids.to(dev)
    kw = cache_kwarg(model)
    mask = attention_mask.to(dev) if attention_mask is not None else None
    reserve(cache, ids.shape[0], ids.shape[1] + max_new_tokens)
    t0 = _sync(dev)
    tok = prefill(model, ids, cache, mask, prefill_chunk, prefill_tokens).argmax(-1)
    prefill_s = _sync(dev) - t0
    lengths = (mask.long().sum(-1) if mask is not None else torch.full((ids.shape[0],), ids.shape[1], device=dev))
    graph = None
    if cuda_graph:
        from rotkv.cache.graph import GraphDecoder

        graph = GraphDecoder(model, cache, int(lengths.max()) + max_new_tokens, kw, compile_layers=compile_layers)
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
    _check_range(cache)  # the graph's eager flushes are checked here, once
    return BatchRun(torch.stack(new, 1), prefill_s, steps)
