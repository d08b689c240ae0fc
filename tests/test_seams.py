"""One seam per storage feature (read from the source with ast): a layer's widths are resolved in
rotkv/cache/widths.py only, and the refine tier's storage lives behind the tier seam (rotkv/cache/tiers.py,
rotkv/cache/refine.py). Each check is shown to find what it looks for first."""

import ast
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
RK = ROOT / "rotkv"

# ---- widths ------------------------------------------------------------------------------------------
WIDTH_HELPERS = {"parse_layer_bits", "final_widths", "artifact_key_bits", "check_width_sources"}
WIDTH_TENSORS = {"k_bits", "bits"}  # the artifact's per-layer widths


def width_reads(source: str) -> list[str]:
    """``what:line`` of every place ``source`` works a layer's width out itself: a width helper called,
    an artifact's width tensor subscripted (``t["k_bits"]``), the ``k_bits`` field read, or
    :func:`resolve_widths` called (the callers are pinned apart)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in WIDTH_HELPERS or name == "resolve_widths":
                found.append(f"{name}:{node.lineno}")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and node.slice.value in WIDTH_TENSORS:
            found.append(f"[{node.slice.value}]:{node.lineno}")
        elif isinstance(node, ast.Attribute) and node.attr == "k_bits" and isinstance(node.ctx, ast.Load):
            found.append(f"k_bits:{node.lineno}")
    return found


def test_the_width_check_finds_each_kind_of_read():
    src = """
def f(spec, art, n):
    w = parse_layer_bits(spec.k_bits)
    b = art.tensors["k_bits"], art.tensors["bits"]
    return final_widths(spec, art, n), resolve_widths(spec, n, art)
"""
    assert sorted(r.split(":")[0] for r in width_reads(src)) == sorted(
        ["parse_layer_bits", "k_bits", "[k_bits]", "[bits]", "final_widths", "resolve_widths"])
    assert width_reads("def g(w):\n    return w.key, w.value, w.final\n") == []


def test_widths_are_resolved_in_one_place():
    """The modules that build a cache's layers (rotkv/cache, the vLLM backend) read no width source
    themselves; plan_cache calls resolve_widths once, and the vLLM backend's layer codecs call it too."""
    made = {}
    for folder in ("cache", "integrations"):
        for path in sorted((RK / folder).rglob("*.py")):
            if path.name == "widths.py":
                continue
            found = width_reads(path.read_text())
            if found:
                made[str(path.relative_to(ROOT))] = sorted(f.split(":")[0] for f in found)
    # plan_cache checks the sources before the artifact is read (a bad `k_bits` fails first), then resolves
    assert made == {"rotkv/cache/assembly.py": ["check_width_sources", "resolve_widths"],
                    "rotkv/integrations/vllm/config.py": ["resolve_widths"]}
    # the CacheSpec no longer resolves a layer's key width itself
    from rotkv.config import CacheSpec

    assert not hasattr(CacheSpec, "key_bits")


def test_resolve_widths_reads_every_source():
    from rotkv.cache.widths import LayerWidth, resolve_widths
    from rotkv.config import CacheSpec

    class Art:
        path = "a.safetensors"

        def __init__(self, **t):
            self.tensors = {k: torch.tensor(v, dtype=torch.int32) for k, v in t.items()}

    assert resolve_widths(CacheSpec(bits=2), 2) == (LayerWidth(2, 2), LayerWidth(2, 2))
    assert resolve_widths(CacheSpec(bits=None), 1) == (LayerWidth(None, None),)
    assert resolve_widths(CacheSpec(bits=2, k_bits="1:4"), 2) == (LayerWidth(2, 2), LayerWidth(4, 2, clip_key=False))
    art = Art(k_bits=[4, 2], bits=[4, 2])
    assert resolve_widths(CacheSpec(bits=2, k_bits="artifact", rotation="artifact"), 2, art) == (
        LayerWidth(4, 2, clip_key=False), LayerWidth(2, 2))
    assert resolve_widths(CacheSpec(bits=2, start_bits=16, budget_tokens=64), 2, art) == (
        LayerWidth(16, 16, 4), LayerWidth(16, 16, 2))
    assert resolve_widths(CacheSpec(bits=2, budget_tokens=64), 2, art) == (LayerWidth(2, 2, 2), LayerWidth(2, 2, 2))
    # layer_bits replaces the widths; the keys' clip follows k_bits
    assert resolve_widths(CacheSpec(bits=2, k_bits="0:4"), 2, None, [(2, 4), (4, 4)]) == (
        LayerWidth(2, 4, clip_key=False), LayerWidth(4, 4))
    with pytest.raises(ValueError, match=r"`k_bits`='artifact' needs an artifact"):
        resolve_widths(CacheSpec(bits=2, k_bits="artifact", rotation="artifact"), 2, Art(bits=[2, 2]))
    with pytest.raises(ValueError, match=r"`k_bits` names layers \[3\]"):
        resolve_widths(CacheSpec(bits=2, k_bits="3:4"), 2)
