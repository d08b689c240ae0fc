"""lm-evaluation-harness model ``rotkv``: a Hugging Face causal LM whose scoring and generation read a
rotkv cache.

    rotkv lm-eval run --model rotkv \
        --model_args pretrained=DIR,preset=quarot-int2,sink=16,window=64 --tasks ...

Importing this module registers the name ``rotkv`` with lm_eval's model registry (lm_eval has no
plugin entry point for models, so the plain ``lm_eval`` command does not see it; the launcher above
is lm_eval's own command line with the module imported). From Python:
``lm_eval.simple_evaluate(model="rotkv", model_args=...)`` after ``import rotkv.integrations.lm_eval``.

What is scored, per request (the protocol of ``rotkv.eval``):

- **loglikelihood**: the context is fed through a fresh :class:`~rotkv.cache.RotkvCache` in calls of
  ``prefill_chunk`` tokens, so every chunk is written to the (quantized) cache and the next chunk reads
  it; the first continuation token is scored from the last context position, the rest of the
  continuation is fed as its own call, reading the stored cache. Requests sharing a context reuse one
  prefilled cache (copied per continuation). A single-call prefill of context + continuation would
  let the continuation attend to the context at full precision, which is what this avoids.
- **loglikelihood_rolling** (perplexity tasks): HFLM's windows go through the same path.
- **generate_until**: the context is prefilled in chunks as above, then tokens are decoded one per
  call through the cache (greedy, or sampled with ``temperature`` when ``do_sample`` is true), until
  ``max_gen_toks``, the end-of-text token or a stop string.

Batches are processed one request at a time (``batch_size`` is accepted and ignored).

model_args: ``pretrained`` (a local Hugging Face directory, a GGUF file, or empty for the default
SmolLM2 GGUF, loaded by :func:`rotkv.hf.models.load_model`), ``preset`` (default: the preset the
``artifact`` was made for, or ``int4`` without one), ``artifact`` (a calibration file, for the calibrated presets), ``sink``, ``window``,
``prefill_chunk``, ``group_size``, ``tier_dtype``, and ``device`` / ``dtype``.
"""

from __future__ import annotations

import copy

import torch

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("rotkv.integrations.lm_eval needs lm-evaluation-harness: pip install 'rotkv[lmeval]'") from e

from rotkv.cache import RotkvCache
from rotkv.eval.protocol import forward

CACHE_FIELDS = ("sink", "window", "prefill_chunk", "group_size", "page_size", "tier_dtype", "clip_k", "clip_v")
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@register_model("rotkv")
class RotkvLM(HFLM):
    """HFLM whose loglikelihood and generation paths prefill in chunks into a rotkv cache and read it."""

    def __init__(self, pretrained=None, preset: str | None = None, artifact: str | None = None,
                 device: str | None = None, dtype: str | None = None, batch_size=1, max_length: int | None = None,
                 **kwargs):
        overrides = {k: kwargs.pop(k) for k in CACHE_FIELDS if k in kwargs and kwargs[k] is not None}
        if isinstance(pretrained, str) or pretrained is None:
            from rotkv.hf.models import load_model

            if dtype is not None and str(dtype) not in DTYPES and dtype != "auto":
                raise ValueError(f"`dtype` has to be one of {sorted(DTYPES)} but got {dtype!r}")
            loaded = load_model(pretrained or None, device=device,
                                dtype=DTYPES.get(str(dtype)) if dtype not in (None, "auto") else None)
            model, tokenizer = loaded.model, loaded.tokenizer
        else:  # a model instance (then pass tokenizer=...)
            model, tokenizer = pretrained, kwargs.pop("tokenizer", None)
            if tokenizer is None:
                raise ValueError("pass tokenizer=... with a model instance")
        kwargs.pop("tokenizer", None)
        # fail now, naming the field, rather than at the first request; the preset taken when none is named
        preset = RotkvCache(model, preset, artifact, **overrides).spec.name
        self.preset, self.artifact_path, self.overrides = preset, artifact, overrides
        super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", batch_size=1,
                         max_length=max_length, **kwargs)
        self.last_stats: dict | None = None

    # ---- the cache ----------------------------------------------------------------------------
    def make_cache(self, context_length: int | None = None) -> RotkvCache:
        """A fresh cache for one request of ``context_length`` tokens in all (an artifact with several
        key fits serves the one nearest it)."""
        return RotkvCache(self.model, self.preset, self.artifact_path, context_length=context_length, **self.overrides)

    @property
    def chunk(self) -> int:
        return int(self.overrides.get("prefill_chunk", 512))

    def _prefill(self, cache, ids: list[int]) -> torch.Tensor:
        """Feed ``ids`` into ``cache`` in calls of ``prefill_chunk`` tokens; log-probs [vocab] after the last."""
        t = torch.tensor([ids], dtype=torch.long)
        logp = None
        for c0 in range(0, len(ids), self.chunk):
            logp = forward(self.model, t[:, c0:c0 + self.chunk], cache)[-1]
        return logp

    # ---- loglikelihood ------------------------------------------------------------------------
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
        from tqdm import tqdm

        out: list[tuple[float, bool] | None] = [None] * len(requests)
        groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = {}
        for i, (_, ctx, cont) in enumerate(requests):
            if not cont:
                raise ValueError("a loglikelihood request has an empty continuation")
            full = (list(ctx) + list(cont))[-(self.max_length + 1):]  # HFLM's left truncation
            ctx_t = full[: len(full) - len(cont)]
            if not ctx_t:  # no context left: HFLM scores from the prefix token
                ctx_t = [self.prefix_token_id]
            groups.setdefault(tuple(ctx_t), []).append((i, list(cont)))
        bar = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="rotkv loglikelihood")
        for ctx, items in groups.items():
            base = self.make_cache(len(ctx) + max(len(c) for _, c in items))
            first = self._prefill(base, list(ctx))
            for n, (i, cont) in enumerate(items):
                cache = base if n == len(items) - 1 else copy.deepcopy(base)
                lps = [first]
                if len(cont) > 1:
                    keep = len(cont) - 1
                    lps += list(forward(self.model, torch.tensor([cont[:-1]]), cache, keep=keep))
                lp = torch.stack(lps)  # [len(cont), vocab]
                target = torch.tensor(cont, device=lp.device)
                score = float(lp.gather(-1, target[:, None]).sum())
                greedy = bool((lp.argmax(-1) == target).all())
                out[i] = (score, greedy)
                self.last_stats = cache.stats()
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
                bar.update(1)
        bar.close()
        return out

    # ---- generation ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs) -> torch.Tensor:
        mask = generation_kwargs.pop("attention_mask", None)
        do_sample = bool(generation_kwargs.get("do_sample") or False)
        temperature = float(generation_kwargs.get("temperature") or 0.0)
        max_new = max(0, max_length - context.shape[1])
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        rows = []
        for r in range(context.shape[0]):
            ids = context[r].tolist()
            if mask is not None:
                ids = [t for t, m in zip(ids, mask[r].tolist()) if m]
            cache = self.make_cache(len(ids) + max_new)
            logp = self._prefill(cache, ids)
            new: list[int] = []
            while len(new) < max_new:
                if do_sample and temperature > 0:
                    tok = int(torch.multinomial(torch.softmax(logp / temperature, -1), 1))
                else:
                    tok = int(logp.argmax())
                new.append(tok)
                if tok == self.eot_token_id:
                    break
                if stop and any(s in self.tok_decode(new) for s in stop):
                    break
                if len(new) < max_new:
                    logp = forward(self.model, torch.tensor([[tok]]), cache)[-1]
            self.last_stats = cache.stats()
            rows.append(context[r].tolist() + new + [pad] * (max_new - len(new)))
        return torch.tensor(rows, dtype=torch.long, device=context.device)


def main(argv: list[str] | None = None) -> int:
    """``rotkv lm-eval ARGS``: lm_eval's command line with ``rotkv`` registered."""
    from lm_eval.__main__ import cli_evaluate

    import sys

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0
