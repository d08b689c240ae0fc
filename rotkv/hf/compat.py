"""Everything that depends on the transformers version lives here (5.17 and newer 5.x).

- 5.24 renamed the model/generate keyword ``past_key_values`` to ``cache`` (the old name
  still works there with a deprecation warning; 5.17 only knows the old one).
- Outputs carry the cache as ``.past_key_values`` (5.17) or ``.cache`` (newer).
- ``Cache.update`` is called as ``update(k, v, layer_idx)`` (5.17) or with ``kwargs=`` (5.24).
"""

from __future__ import annotations

import inspect

import transformers
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

TRANSFORMERS_VERSION = transformers.__version__


def cache_kwarg(model) -> str:
    """The keyword under which this transformers version's models take a cache."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(outputs):
    """The cache object of a model output."""
    return getattr(outputs, "cache", None) or getattr(outputs, "past_key_values", None)


def sliding_layer(window: int):
    """transformers' own bf16 sliding-window cache layer."""
    return DynamicSlidingWindowLayer(sliding_window=window)


def full_layer():
    return DynamicLayer()
