"""Peer KV caches from PyPI, called through their own APIs (never reimplemented).

- ``hf-quanto-int4`` / ``hf-quanto-int2``: transformers' ``QuantizedCache`` with the quanto backend
  (``pip install optimum-quanto``); ``hf-hqq-int2``: the same with the hqq backend (``pip install hqq``).
  Defaults of transformers: per-channel groups of 64, a residual of 128 tokens at the model dtype,
  and the whole cache re-quantized whenever the residual fills.
- ``turboquant-int3``: ``turboquant.TurboQuantCache(bits=3)`` (``pip install turboquant``).

On a CUDA model, optimum-quanto is imported so that its CUDA extension is not registered
(:func:`quanto_without_cuda_extension`): that extension is a JIT build of quanto's own kernels (AWQ, Marlin, bit
unpacking) with nvcc and ninja, minutes on first use and a failure where either is missing. CUDA tensors then run
quanto's portable PyTorch implementation of the one op the KV cache uses from it, the bit unpacking, which is exact
either way; the quantization itself is the same code on every device.

turboquant 0.2.0 overrides ``Cache.update(k, v, layer_idx, cache_kwargs=None)``; transformers 5.24
calls ``update(k, v, layer_idx, kwargs=...)`` and the package fails with ``update() got an
unexpected keyword argument 'kwargs'``. :class:`_turboquant_adapter` is a subclass whose ``update``
takes any extra arguments and calls the package's own ``update(k, v, layer_idx)``; nothing else of
the package is changed. turboquant 0.2.0 also calls ``np.trapz``, which numpy 2.4 removed (renamed
``np.trapezoid`` in 2.0); the adapter restores that alias when it is missing. The package stores codes as one uint8 per element, float32 norms, a
128-token residual and, after every update, the dequantized full cache as ``layer.keys/values``:
all of that is resident and is counted by :func:`resident_bytes`.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Peer:
    name: str
    module: str  # what must be importable
    pip: str  # the install hint
    bits: int
    backend: str | None  # QuantizedCache backend, or None for turboquant


PEERS: dict[str, Peer] = {
    "hf-quanto-int4": Peer("hf-quanto-int4", "optimum.quanto", "optimum-quanto", 4, "quanto"),
    "hf-quanto-int2": Peer("hf-quanto-int2", "optimum.quanto", "optimum-quanto", 2, "quanto"),
    "hf-hqq-int2": Peer("hf-hqq-int2", "hqq", "hqq", 2, "hqq"),
    "turboquant-int3": Peer("turboquant-int3", "turboquant", "turboquant", 3, None),
}


def unavailable(name: str) -> str | None:
    """Why the peer cannot run here (with the install hint), or None when it can."""
    peer = PEERS[name]
    root = peer.module.split(".")[0]
    try:
        found = importlib.util.find_spec(root) is not None and importlib.util.find_spec(peer.module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return f"`{peer.module}` is not installed: pip install {peer.pip}  (or: pip install 'rotkv[peers]')"
    return None


def _turboquant_adapter(bits: int):
    import numpy as np

    if not hasattr(np, "trapz"):  # turboquant 0.2.0 builds its codebook with np.trapz, removed in numpy 2.4
        np.trapz = np.trapezoid
    from turboquant import TurboQuantCache

    class TurboQuantAdapter(TurboQuantCache):
        """turboquant's cache, taking the extra arguments transformers >= 5.24 passes to ``update``."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            return super().update(key_states, value_states, layer_idx)

    return TurboQuantAdapter(bits=bits)


def quanto_without_cuda_extension() -> None:
    """Import optimum-quanto without registering its CUDA extension's kernels (see the module's docstring).
    It has to come before anything else imports optimum.quanto; where something did, RuntimeError says so
    if the CUDA kernels are registered by then."""
    if "optimum.quanto" not in sys.modules:
        from unittest import mock

        with mock.patch("torch.cuda.is_available", return_value=False):
            import optimum.quanto  # noqa: F401
    if torch._C._dispatch_has_kernel_for_dispatch_key("quanto::unpack", "CUDA"):
        raise RuntimeError("optimum.quanto was imported before rotkv could keep its CUDA extension out (a JIT build "
                           "with nvcc and ninja): make rotkv build the hf-quanto cache first in this process")


def make_peer(name: str, model):
    """A fresh cache of the peer ``name`` for ``model``; raises ImportError with the install hint."""
    why = unavailable(name)
    if why:
        raise ImportError(why)
    peer = PEERS[name]
    if peer.backend == "quanto" and next(model.parameters()).device.type == "cuda":
        quanto_without_cuda_extension()
    if peer.backend is not None:
        from transformers import QuantizedCache

        return QuantizedCache(backend=peer.backend, config=model.config, nbits=peer.bits)
    return _turboquant_adapter(peer.bits)


# ---- measuring what is resident ---------------------------------------------------------------------
def _tensors(obj, depth: int = 0):
    """Every tensor reachable from ``obj`` through attributes, containers and tensor subclasses."""
    if depth > 6 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "__tensor_flatten__") and type(obj) is not torch.Tensor:  # quanto QTensor, ...
            names, _ = obj.__tensor_flatten__()
            for n in names:
                yield from _tensors(getattr(obj, n), depth + 1)
        else:
            yield obj
        return
    if isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        for x in vars(obj).values():
            yield from _tensors(x, depth + 1)


def resident_bytes(layers) -> dict[str, int]:
    """Bytes of every distinct tensor storage held by the cache layers (views count their whole storage).

    ``bytes_at_bf16`` counts float32 storages at 2 bytes per element: what the same cache would hold on a
    bf16 model (the CPU run keeps the model, and so the peers' residuals and metadata, in float32).
    """
    seen: dict[int, tuple[int, torch.dtype]] = {}
    for layer in layers:
        for t in _tensors(layer):
            st = t.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = (st.nbytes(), t.dtype)
    total = sum(n for n, _ in seen.values())
    at_bf16 = sum(n // 2 if dt == torch.float32 else n for n, dt in seen.values())
    return {"kv_bytes": total, "kv_bytes_at_bf16": at_bf16}
