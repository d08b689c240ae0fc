"""Import cycles among rotkv's modules, read from the source with ast (nothing is imported).

An edge A -> B is an ``import`` / ``from ... import`` statement in A that names module B
(``from rotkv.x import y`` names ``rotkv.x.y`` when that is a module, else ``rotkv.x``). It is
module-level when it runs at import time (top level, or in a class body, an ``if`` or a ``try``)
and function-level when it sits inside a function. Parent packages that Python initializes on the
way (``rotkv/cache/__init__.py`` for ``rotkv.cache.layer``) are not counted as edges.

A cycle is an elementary cycle of that graph; it is module-level when all its edges are, else
function-level (it closes only through an import inside a function).

    python scripts/import_cycles.py          # the counts and every cycle
    python scripts/import_cycles.py --json   # the same as JSON
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rotkv")


def modules(root: str = ROOT) -> dict[str, str]:
    """Module name -> file path, for every .py file under ``root``."""
    out = {}
    base = os.path.dirname(root)
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), base)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(d, f)
    return out


def _targets(node: ast.AST, name: str, is_pkg: bool, mods: dict[str, str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in mods]
    if node.level:  # relative import
        parts = name.split(".") if is_pkg else name.split(".")[:-1]
        parts = parts[: len(parts) - node.level + 1]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    out = []
    for a in node.names:
        sub = f"{base}.{a.name}"
        if sub in mods:
            out.append(sub)
        elif base in mods:
            out.append(base)
    return out


def edges(mods: dict[str, str]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> "module" or "function" (module-level wins when both occur)."""
    out: dict[tuple[str, str], str] = {}

    def walk(node: ast.AST, name: str, is_pkg: bool, in_func: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in _targets(child, name, is_pkg, mods):
                    if t != name:
                        kind = "function" if in_func else "module"
                        if out.get((name, t)) != "module":
                            out[(name, t)] = kind
            walk(child, name, is_pkg, in_func or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    for name, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        walk(tree, name, path.endswith("__init__.py"), False)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle, each once, starting at its smallest module name."""
    found = []
    nodes = sorted(graph)
    for start in nodes:
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    found.append(path)
                elif nxt > start and nxt not in path:
                    stack.append((nxt, path + [nxt]))
    return sorted(found, key=lambda c: (len(c), c))


def report(root: str = ROOT) -> dict:
    mods = modules(root)
    e = edges(mods)
    graph: dict[str, set[str]] = {}
    for (a, b) in e:
        graph.setdefault(a, set()).add(b)
    out = {"modules": len(mods), "edges": {"module": sum(k == "module" for k in e.values()),
                                           "function": sum(k == "function" for k in e.values())},
           "cycles": {"module": [], "function": []}}
    for c in cycles(graph):
        pairs = list(zip(c, c[1:] + c[:1]))
        kinds = [e[p] for p in pairs]
        kind = "module" if all(k == "module" for k in kinds) else "function"
        out["cycles"][kind].append([f"{a} -{'m' if k == 'module' else 'f'}-> {b}" for (a, b), k in zip(pairs, kinds)])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    r = report()
    if args.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"{r['modules']} modules; import edges: {r['edges']['module']} module-level, {r['edges']['function']} function-level")
    for kind in ("module", "function"):
        print(f"{kind}-level cycles: {len(r['cycles'][kind])}")
        for c in r["cycles"][kind]:
            print("  " + ", ".join(c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
