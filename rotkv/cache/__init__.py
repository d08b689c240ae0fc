"""The hybrid KV cache: layers, codecs, and the transformers Cache subclass."""

from rotkv.cache.assembly import resolve_spec
from rotkv.cache.cache import RotkvCache, make_cache
from rotkv.cache.layer import HybridLayer

__all__ = ["HybridLayer", "RotkvCache", "make_cache", "resolve_spec"]
