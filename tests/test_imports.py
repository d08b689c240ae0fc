"""Import directions between rotkv's packages, read from the source (nothing is imported).

Table-driven: a row of ``FORBIDDEN`` says a package imports nothing from the listed ones (at
module level or inside functions); ``KNOWN_CYCLES`` lists the import cycles that remain (each to
be removed by deleting its row once the cycle is gone). A new cycle, or a cycle in the table that
no longer exists, fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "rotkv"

FORBIDDEN = [  # (package, packages it must not import)
    ("rotkv.kernels", ("rotkv.cache", "rotkv.hf", "rotkv.eval", "rotkv.cli")),
    ("rotkv.quant", ("rotkv.cache", "rotkv.kernels", "rotkv.hf", "rotkv.rotations", "rotkv.eval", "rotkv.cli")),
]

KNOWN_CYCLES: list[set[str]] = []  # import cycles through function-level imports still to remove (none left)


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def imports(module: str, top_level_only: bool = False) -> set[str]:
    """The rotkv modules ``module`` imports (``from pkg import sub`` counts as ``pkg.sub`` only)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    if top_level_only:
        nodes, stack = [], list(tree.body)
        while stack:  # module level, including under if / try
            n = stack.pop()
            nodes.append(n)
            if isinstance(n, (ast.If, ast.Try)):
                stack += n.body + n.orelse + getattr(n, "finalbody", []) + [x for h in getattr(n, "handlers", [])
                                                                            for x in h.body]
    else:
        nodes = list(ast.walk(tree))
    found = set()
    for n in nodes:
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = module.split(".")
                base = base[: len(base) - n.level + (path.name == "__init__.py")]
                mod = ".".join(base + ([n.module] if n.module else []))
            else:
                mod = n.module or ""
            subs = [f"{mod}.{a.name}" for a in n.names if f"{mod}.{a.name}" in MODULES]
            names = subs if len(subs) == len(n.names) else [mod, *subs]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name.startswith("rotkv.") and name != module:
                found.add(name)
    return found


def cycles(top_level_only: bool) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: imports(m, top_level_only) for m in MODULES}
    index, low, on, stack, out = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("package,forbidden", FORBIDDEN, ids=[row[0] for row in FORBIDDEN])
def test_import_direction(package, forbidden):
    bad = sorted(f"{m} -> {t}" for m in MODULES if m == package or m.startswith(package + ".")
                 for t in imports(m) if any(t == f or t.startswith(f + ".") for f in forbidden))
    assert not bad, bad


def test_no_module_level_import_cycles():
    assert cycles(top_level_only=True) == []


def test_import_cycles_are_the_known_ones():
    found = cycles(top_level_only=False)
    assert found == [] or KNOWN_CYCLES, found
    assert [c for c in found if c not in KNOWN_CYCLES] == [], "a new import cycle"
    assert [c for c in KNOWN_CYCLES if c not in found] == [], "a cycle is gone: delete its row of KNOWN_CYCLES"


def test_the_checker_sees_imports():
    # the checker itself: it finds imports that exist, at module level and inside functions
    assert "rotkv.kernels.body" in imports("rotkv.cache.pools", top_level_only=True)
    assert "rotkv.kernels.write" in imports("rotkv.cache.pools")
    assert "rotkv.kernels.write" not in imports("rotkv.cache.pools", top_level_only=True)
