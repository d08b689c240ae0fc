"""The prefill's host syncs, counted where the code asks a tensor for a Python value (``.item()``,
``bool()``, ``.tolist()``) under ``rotkv/cache``, with the kernels forced on for CPU tensors (the
Triton interpreter runs them as the GPU would). On a GPU each such read of a device tensor drains the
queue; the H200 profile of oscar-mix at 6037f1e had 699 of them in one 64 x 8K prefill (one per
layer and call from the e4m3 range check, five per layer from a probe encode).
"""

import collections
import os
import traceback

import torch

from rotkv_testing import make_tiny_llama

CACHE_DIR = os.sep + os.path.join("rotkv", "cache") + os.sep


def _count_reads(monkeypatch) -> collections.Counter:
    """Patch the Python-value reads of tensors; count those made from rotkv/cache by file:line."""
    counts = collections.Counter()
    for name in ("item", "__bool__", "tolist"):
        orig = getattr(torch.Tensor, name)

        def read(self, *a, _orig=orig, **k):
            for fr in traceback.extract_stack(limit=6)[:-1]:
                if CACHE_DIR in fr.filename:
                    counts[f"{os.path.basename(fr.filename)}:{fr.lineno}"] += 1
                    break
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, read)
    return counts


@torch.no_grad()
def test_an_e4m3_prefill_reads_the_range_flags_once_per_call(monkeypatch, device, kernels_on_cpu):
    from rotkv.cache import RotkvCache
    from rotkv.generation import prefill

    model = make_tiny_llama(layers=3, head_dim=64).to(device)
    cache = RotkvCache(model, "naive-int2", sink=4, window=8, page_size=16, group_size=32, meta_v="float8",
                       check_finite=False)
    ids = torch.randint(1, 128, (2, 96), generator=torch.Generator().manual_seed(0))
    counts = _count_reads(monkeypatch)
    prefill(model, ids, cache, chunk=32)  # 3 calls, each flushing pages in every layer
    flags = [layer.pools.range_flags[1] for layer in cache.layers]
    assert all(f is not None for f in flags), "the kernel writes set no range flag: the test ran the reference"
    # the range check: at layer 0 of calls 2 and 3 (call 1 finds no flag yet) and once at the end
    assert counts["cache.py:" + str(_check_line())] <= 3, counts
    per_layer = {site: n for site, n in counts.items() if n >= 3 * len(cache.layers)}
    assert not per_layer, f"reads made once per layer and call: {per_layer}"


def _check_line() -> int:
    """The line of check_metadata_range's read in rotkv/cache/cache.py."""
    import inspect

    from rotkv.cache.cache import RotkvCache

    src, first = inspect.getsourcelines(RotkvCache.check_metadata_range)
    return first + next(i for i, line in enumerate(src) if "torch.stack" in line)
