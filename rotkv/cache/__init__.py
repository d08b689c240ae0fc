"""The hybrid KV cache: layers, codecs, and the transformers Cache subclass.

The names below load on first use, so that ``rotkv.cache.pools`` / ``rotkv.cache.codecs`` (what an
engine integration reads) import without the transformers glue of ``rotkv.hf``."""

import importlib

_LAZY = {"resolve_spec": "rotkv.cache.assembly", "RotkvCache": "rotkv.cache.cache", "make_cache": "rotkv.cache.cache",
         "HybridLayer": "rotkv.cache.layer"}

__all__ = ["HybridLayer", "RotkvCache", "make_cache", "resolve_spec"]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rotkv.cache' has no attribute {name!r}")
