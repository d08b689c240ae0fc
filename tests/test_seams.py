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


# ---- the tier seam ---------------------------------------------------------------------------------------
TIER_MODULE = RK / "cache" / "refine.py"  # the refine tier's one module on the cache side
# the salient pages ride on the refine tier's grid and size rule: a tier module of the same family
TIER_MODULES = (TIER_MODULE, RK / "cache" / "salient.py")
TIER_NAME = r"(?i)refine|(^|_)rings?($|_)|newest_pages"  # an identifier of the refine tier's storage


def tier_names(source: str) -> list[str]:
    """``name:line`` of every identifier in ``source`` (names, attributes, arguments, keywords, imports)
    that names the refine tier's storage; docstrings and comments are not read."""
    import re

    found = []
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.keyword) and node.arg:
            names = [node.arg]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] + ([node.module] if getattr(node, "module", None) else [])
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names = [node.name]
        found += [f"{n}:{getattr(node, 'lineno', 0)}" for n in names if re.search(TIER_NAME, n.split(".")[-1])]
    return found


def test_the_tier_check_finds_the_refine_fields():
    old = """
from rotkv.cache.refine import newest_pages
def f(self, pools, spec):
    if pools.refine_rings:
        pools.grow_refine(counts, nb)
    return LayerPools(refine_pages=-(-spec.refine_tokens // 16), refine_every=spec.refine_every), self._rings(None)
"""
    assert sorted(n.split(":")[0] for n in tier_names(old)) == sorted(
        ["newest_pages", "rotkv.cache.refine", "refine_rings", "grow_refine", "refine_pages", "refine_tokens",
         "refine_every", "refine_every", "_rings"])
    assert tier_names("def g(pools, step):\n    pools.read_tiers(k, v, nb, c, p, memo=step.cached)\n") == []


def test_the_cache_composes_tiers_without_naming_the_refine_tier():
    """Outside the refine tier's module, the cache's modules name none of its storage: the pools, the layer,
    the cache, its plan and its CUDA graph call the tier hooks (rotkv.cache.tiers), which registers the kind."""
    named = {}
    for path in sorted((RK / "cache").glob("*.py")):
        if path in TIER_MODULES:
            continue
        found = tier_names(path.read_text())
        if found:
            named[path.name] = sorted({n.split(":")[0] for n in found})
    assert named == {"tiers.py": ["RefineRings", "rotkv.cache.refine"]}  # the one registration: its import, KINDS


class CountingTier:
    """A second tier kind for the test: it counts what the cache asks of it (and stores nothing)."""

    label = "the counting tier"
    PUBLISHED = {"counting": ("self", None)}

    def __init__(self):
        self.calls, self.rows = [], 0
        self.self = self

    @classmethod
    def build(cls, spec, codecs, kv_heads, page, head_dim, device):
        return cls()

    @staticmethod
    def graph_flags(spec):
        return {}

    def fit(self, rows):
        self.rows = rows

    def nbytes(self):
        return 1000

    def stored_bytes(self, counts):
        return 7 * int(counts.sum())

    def grow(self, counts, upto):
        self.calls.append("grow")

    def select(self, index):
        self.calls.append("select")

    def adopt(self, src, row, src_row, counts, body_pages):
        self.calls.append("adopt")

    def observe(self, query, keys, real, scaling, rotation):
        self.calls.append("observe")

    def flush_target(self, pages, device):
        return len(pages.flush)

    def write(self, side, x, dst, stored, parts, codec, target):
        assert target == len(dst) == x.shape[0]
        self.calls.append(f"write{side}")

    def read(self, k, v, nb, counts, pages, r0, body, start=0, memo=None):
        self.calls.append("read")

    def plan_args(self):
        return {}

    def kernel_args(self):
        return {}


def test_a_new_tier_kind_is_composed_by_the_hooks_alone(monkeypatch):
    """A tier kind added to rotkv.cache.tiers.KINDS is built, written, read, counted and edited with the
    batch through its hooks alone, beside the refine tier."""
    from rotkv.cache import tiers
    from rotkv.cache.codecs import make_codecs
    from rotkv.cache.layer import HybridLayer
    from rotkv.config import CacheSpec
    from rotkv.rotations.registry import build_rotations

    monkeypatch.setattr(tiers, "KINDS", (*tiers.KINDS, CountingTier))
    h, d = 2, 16
    spec = CacheSpec(bits=2, group_size=16, sink=2, window=4, page_size=4, tier_dtype="float32", refine_tokens=8)
    layer = HybridLayer(spec, build_rotations("hadamard", 1, h, d)[0], d, h, 0, make_codecs("token", 2, 16, 0.9, 1.0))
    g = torch.Generator().manual_seed(0)
    for n in (30, 1, 1, 1, 1):  # a prefill, then decode steps: pages flushed and read
        k = torch.randn(2, h, n, d, generator=g)
        layer.update(k, k)
        layer.attend(torch.randn(2, 4, n, d, generator=g), None, 0.3)
    pools = layer.pools
    counting = pools.counting
    assert [type(t) for t in pools.tiers] == [tiers.RefineRings, CountingTier] and pools.refine is not None
    assert {"observe", "write0", "write1", "read"} <= set(counting.calls) and counting.rows == 2
    stats = layer.stats()
    assert stats["body_bytes"] == (int(layer.state.body_count.sum()) * (pools.body_page_bytes + 7)
                                   + pools.refine_rings[0].stored_bytes(layer.state.body_count))
    assert stats["pool_bytes"] >= 1000
    pools.select_tiers(torch.tensor([1, 0]))
    assert counting.calls[-1] == "select"
