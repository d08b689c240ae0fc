"""Which cache layer answers a model layer's attention call.

transformers does not pass the cache to the attention function, so a cache layer's ``update`` records itself
under its layer index with the key states it returns (:func:`route`), and the attention function
(``rotkv.hf.attention``) takes it back by its module's ``layer_idx`` (:func:`routed`), for those key states
only. Entries are held weakly, per thread.
"""

from __future__ import annotations

import threading
import weakref

import torch

_ROUTES = threading.local()  # per thread: layer index -> (the layer, the key states it returned), weakly held


def route(layer_idx: int, layer, key: torch.Tensor) -> None:
    """Send the attention call of model layer ``layer_idx`` whose key states are ``key`` to
    ``layer.attend(query, real, scaling)``. A cache layer's ``update`` calls it with the key states it
    returns; the entry lasts until that attention call takes it (or the next ``update`` of the index)."""
    table = getattr(_ROUTES, "table", None)
    if table is None:
        table = _ROUTES.table = {}
    table[layer_idx] = (weakref.ref(layer), weakref.ref(key))


def routed(module, key: torch.Tensor):
    """The layer routed to the attention call of ``module`` (by its ``layer_idx``) over ``key``, or
    None: a layer rotkv does not manage, or a run without a rotkv cache."""
    table = getattr(_ROUTES, "table", None)
    entry = table.pop(getattr(module, "layer_idx", None), None) if table else None
    if entry is None:
        return None
    layer, routed_key = entry[0](), entry[1]()
    return layer if layer is not None and routed_key is key else None
