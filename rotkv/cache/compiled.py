"""The model's own layers compiled (``torch.compile``) for the captured decode step; rotkv's cache stays eager.

Why: at a small model's decode shape the step is mostly short kernels of the model itself, not of
the cache: RMSNorm's casts, powers, means and rsqrts, RoPE's multiplies, negations and
concatenations, the MLP's activation and the residual adds, a few microseconds each
(``benchmarks/profile_step.py`` counts them; docs/kernel-notes.md). Compiled, each norm, each RoPE and
each activation is one fused kernel.

How: :meth:`rotkv.cache.RotkvCache.update` and the registered attention function
(:func:`rotkv.hf.attention.rotkv_attention`) are ``torch.compiler.disable``-d, so dynamo breaks the
graph at exactly those two calls and runs them as they are (their kernels, page tables and host
planning are untouched). What lies between them (norms, projections, RoPE, MLP, residuals) is
compiled, once per layer and batch size: the attention module's ``layer_idx`` is a constant in its
frame, so the recompile limit is raised to 8 per layer for the compile, and hitting it is an error
(never a quiet fall back to the uncompiled layers). Only inside
:func:`compiled_layers` do the layers run compiled; :class:`rotkv.cache.graph.GraphDecoder` enters
it for its warm-up step and its capture, so the replays run the compiled kernels and nothing else
(the prefill and eager decode never compile).
"""

from __future__ import annotations

import contextlib

import torch

_COMPILED = "_rotkv_compiled_layers"  # ((backend, the layers' own forwards), [compiled forward per layer])


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's decoder layers (``model.model.layers`` for the transformers decoder models)."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(f"{type(model).__name__} has no decoder layers at .model.layers to compile; "
                         "run the CUDA graph without compile_layers")
    return list(layers)


def _limits(layers: int) -> dict:
    """dynamo settings for the block: a recompile limit of 8 per layer (each layer's attention frame is
    one entry per batch size, ``dynamic=False``), the same in all, and a limit hit is an error, not a
    quiet fall back to the uncompiled layers. Named as this torch names them."""
    cfg, want = torch._dynamo.config, {}
    for names, value in ((("recompile_limit", "cache_size_limit"), 8 * layers),
                         (("accumulated_recompile_limit", "accumulated_cache_size_limit"), 16 * layers),
                         (("fail_on_recompile_limit_hit", "fail_on_cache_limit_hit"), True)):
        name = next((n for n in names if hasattr(cfg, n)), None)
        if name is not None:
            old = getattr(cfg, name)
            want[name] = value if isinstance(value, bool) else max(old, value)
    return want


@contextlib.contextmanager
def compiled_layers(model, backend: str = "inductor"):
    """Within this block the model's decoder layers run compiled (the compiled functions are made
    once per model and backend and kept); on exit their own ``forward`` is back."""
    layers = decoder_layers(model)
    saved = [layer.__dict__.get("forward") for layer in layers]  # an accelerate hook may have set one
    key = (backend, tuple(id(f) for f in saved))  # compiled over the forwards the layers have now
    kept = getattr(model, _COMPILED, None)
    if kept is None or kept[0] != key:
        kept = (key, [torch.compile(layer.forward, backend=backend, dynamic=False) for layer in layers])
        object.__setattr__(model, _COMPILED, kept)  # a plain attribute, not a submodule
    for layer, fn in zip(layers, kept[1]):
        layer.forward = fn
    try:
        with torch._dynamo.config.patch(**_limits(len(layers))):
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
