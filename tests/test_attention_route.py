"""The attention function finds its cache layer by the module's layer_idx (rotkv.hf.attention.route),
not through an attribute on the key tensor; the key-width search routes through the same public hook."""

from pathlib import Path
from types import SimpleNamespace

import torch

from rotkv.cache import RotkvCache
from rotkv.hf import attention
from rotkv.hf.compat import cache_kwarg

ROOT = Path(__file__).resolve().parents[1]


def test_no_tensor_attribute_channel():
    hits = [str(p.relative_to(ROOT)) for p in (ROOT / "rotkv").rglob("*.py") if "_rotkv_layer" in p.read_text()]
    assert hits == []
    assert "route(" in (ROOT / "rotkv" / "calibrate" / "keybits.py").read_text()


class _Layer:
    pass


def test_route_is_by_layer_index_and_key():
    layer, other = _Layer(), _Layer()
    k, k2 = torch.zeros(1), torch.zeros(1)
    attention.route(3, layer, k)
    assert attention.routed(SimpleNamespace(layer_idx=2), k) is None  # another layer's call
    assert attention.routed(SimpleNamespace(layer_idx=3), k) is layer
    assert attention.routed(SimpleNamespace(layer_idx=3), k) is None  # taken once
    attention.route(3, layer, k)
    attention.route(3, other, k2)  # the next update of the index replaces the entry
    assert attention.routed(SimpleNamespace(layer_idx=3), k) is None  # not the key that update returned
    attention.route(4, layer, k)
    del layer
    assert attention.routed(SimpleNamespace(layer_idx=4), k) is None  # the layer is gone (weakly held)


@torch.no_grad()
def test_two_caches_used_in_turn_each_attend_their_own(tiny_llama):
    """Two caches of one model, called alternately: each call reads its own cache's tokens (as two
    separate runs do)."""
    ids = torch.randint(1, 100, (1, 24), generator=torch.Generator().manual_seed(0))
    kw = cache_kwarg(tiny_llama)

    def run(steps, caches):
        outs = []
        for t in steps:
            for c in caches:
                outs.append(tiny_llama(input_ids=ids[:, t:t + 1], use_cache=True, **{kw: c}).logits[0, -1])
        return outs

    a, b = RotkvCache(tiny_llama, "int4"), RotkvCache(tiny_llama, "int4")
    tiny_llama(input_ids=ids[:, :16], use_cache=True, **{kw: a})  # a holds 16 tokens, b none
    alone = RotkvCache(tiny_llama, "int4")
    tiny_llama(input_ids=ids[:, :16], use_cache=True, **{kw: alone})
    turns = run(range(16, 20), [a, b])
    assert all(torch.equal(x, y) for x, y in zip(turns[0::2], run(range(16, 20), [alone])))
    assert a.get_seq_length() == 20 and b.get_seq_length() == 4
