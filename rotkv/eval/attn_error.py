"""``attn-error``: per-layer relative error of the attention output after W_O, on held-out text.

Each layer is measured in isolation: the plain model (no cache) runs over ``L + Q`` tokens and every
attention module's input and output (after ``o_proj``) are recorded; then the method's cache is filled
with the first L tokens in chunks and the last Q tokens are fed as one call, while a pre-hook hands every
attention module the *reference* input. So layer l's keys, values and queries are the reference ones and
its error comes from its own cache only, not from the drift of the layers below it. The error of layer l
is ``||O_method - O_ref||_F / ||O_ref||_F`` over the Q query positions.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from rotkv.eval.protocol import forward, prefill
from rotkv.hf.geometry import attention_modules


@contextmanager
def _hooks(model, on_input, on_output):
    handles = []
    for m in attention_modules(model):
        handles.append(m.register_forward_pre_hook(lambda mod, a, kw, i=m.layer_idx: on_input(i, a, kw), with_kwargs=True))
        handles.append(m.register_forward_hook(lambda mod, a, out, i=m.layer_idx: on_output(i, out)))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _hidden(args, kwargs) -> torch.Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def reference(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(inputs, outputs) of every attention module of the plain model over ``ids [1, n]``: ``[1, n, hidden]`` each."""
    n_layers = len(attention_modules(model))
    ins, outs = [None] * n_layers, [None] * n_layers

    def on_in(i, a, kw):
        ins[i] = _hidden(a, kw).detach().clone()

    def on_out(i, out):
        outs[i] = (out[0] if isinstance(out, tuple) else out).detach().float().clone()

    with _hooks(model, on_in, on_out):
        forward(model, ids, None)
    return ins, outs


def layer_errors(model, method, ids: torch.Tensor, length: int, queries: int, chunk: int,
                 ref: tuple[list[torch.Tensor], list[torch.Tensor]]) -> tuple[list[float], dict]:
    """Relative error per layer over the last ``queries`` positions of ``ids[:, :length + queries]``."""
    ref_in, ref_out = ref
    pos = [0, 0]  # the positions of the current call
    got: dict[int, torch.Tensor] = {}

    def on_in(i, a, kw):
        h = ref_in[i][:, pos[0]:pos[1]]
        if "hidden_states" in kw:
            kw["hidden_states"] = h
            return a, kw
        return (h, *a[1:]), kw

    def on_out(i, out):
        if pos[0] == length:
            got[i] = (out[0] if isinstance(out, tuple) else out).detach().float()

    cache = method.build(model, context_length=length)
    with _hooks(model, on_in, on_out):
        for c0 in range(0, length, chunk):
            pos[:] = [c0, min(c0 + chunk, length)]
            prefill(model, cache, ids[:, pos[0]:pos[1]], chunk)
        pos[:] = [length, length + queries]
        forward(model, ids[:, length:length + queries], cache)
    errs = []
    for i in range(len(ref_out)):
        r = ref_out[i][:, length:length + queries]
        errs.append(float((got[i] - r).norm() / r.norm()))
    return errs, method.measure(cache, model)
