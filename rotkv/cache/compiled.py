"""The model's own layers compiled (``torch.compile``) for the captured decode step; rotkv's cache stays eager.

Why: at a small model's decode shape the step is mostly short kernels of the model itself, not of
the cache. At SmolLM2 64 x 8K (H200, ``benchmarks/profile_step.py``) about 1,000 of a step's kernels
are RMSNorm's casts, powers, means and rsqrts, RoPE's multiplies, negations and concatenations, the
MLP's activation and the residual adds, 2-3 us each: 1.8 ms of the 6.0 ms bf16 step and of the 5.2
ms INT2 one. Compiled, each norm, each RoPE and each activation is one fused kernel.

How: :meth:`rotkv.cache.RotkvCache.update` and the registered attention function
(:func:`rotkv.hf.attention.rotkv_attention`) are ``torch.compiler.disable``-d, so dynamo breaks the
graph at exactly those two calls and runs them as they are (their kernels, page tables and host
planning are untouched). What lies between them (norms, projections, RoPE, MLP, residuals) is
compiled, once per layer: the attention module's ``layer_idx`` is a constant in its frame, so the
recompile limit is raised to the number of layers for the compile. Only inside
:func:`compiled_layers` do the layers run compiled; :class:`rotkv.cache.graph.GraphDecoder` enters
it for its warm-up step and its capture, so the replays run the compiled kernels and nothing else
(the prefill and eager decode never compile).
"""

from __future__ import annotations

import contextlib

import torch

_COMPILED = "_rotkv_compiled_layers"  # (backend, [compiled forward per layer]) kept on the model


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers (``model.model.layers`` for the transformers decoder models)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers to compile; "
                         "run the CUDA graph without compile_layers")
    return list(layers)


def _limit_name() -> str:
    cfg = torch._dynamo.config
    return "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"


@contextlib.contextmanager
def compiled_layers(model, backend: str = "inductor"):
    """Within this block the model's decoder layers run compiled (the compiled functions are made
    once per model and backend and kept); on exit their own ``forward`` is back."""
    layers = decoder_layers(model)
    kept = getattr(model, _COMPILED, None)
    if kept is None or kept[0] != backend:
        kept = (backend, [torch.compile(layer.forward, backend=backend, dynamic=False) for layer in layers])
        object.__setattr__(model, _COMPILED, kept)  # a plain attribute, not a submodule
    saved = [layer.__dict__.get("forward") for layer in layers]  # an accelerate hook may have set one
    name = _limit_name()
    limit = max(getattr(torch._dynamo.config, name), 2 * len(layers) + 8)
    for layer, fn in zip(layers, kept[1]):
        layer.forward = fn
    try:
        with torch._dynamo.config.patch(**{name: limit}):
            yield
    except torch._dynamo.exc.TorchDynamoException as e:  # the compile itself failed: say what to do
        inner = getattr(e, "inner_exception", None) or e.__cause__ or e
        why = (str(inner).strip().splitlines() or [""])[0]
        raise RuntimeError(f"compiling {type(model).__name__}'s decoder layers ({getattr(backend, '__name__', backend)}) "
                           f"failed: {type(inner).__name__}: {why}. Run without compile_layers (--compile-layers); "
                           "the cache holds a partly written step: reset it") from e
    finally:
        for layer, old in zip(layers, saved):
            if old is None:
                del layer.forward
            else:
                layer.forward = old
