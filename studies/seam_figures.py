"""Structure figures of the typed body and the planned dispatch, counted from the source.

    python studies/seam_figures.py [--json]

Run from the repository root (or on another tree: ``--root DIR``, e.g. a ``git archive`` of the
commit before); the same command gives the before and the after figures:
- width_rederived: lines of rotkv/ that turn a byte count back into a width (``* 8 //``);
- group_rederived: lines that turn a metadata width back into a group size or group count
  (``scale.shape[-1]``, ``body[1].shape[-1]``, ``body[4].shape[-1]``);
- width_literals: lines of rotkv/ that spell an allowed-width list out (``(2, 4)``, ``[2, 4, 8]``,
  ``in (2, 4, 8)``, ...) instead of reading the one table (rotkv/quant/widths.py, not counted);
- coverage_deciders: definitions in rotkv/ that decide whether a kernel covers a call, before
  (``kernel_tokens =``, ``can_dequant_kernel =``, ``def _kernel_ok``, ``def _use_cuda_body``,
  ``def supported``, ``def shape_reason``, ``def token_encode``, quant_write's ``wanted =``,
  ``def plan`` in kernels/prebuild.py, the ``small_work`` rewrite of the config) and after
  (rotkv/kernels/plan.py's ``*_reason`` functions, ``class DecodePlan``, the write plan's
  ``wanted =``, ``LayerPools.decode_plan``); coverage_files: the files they are in;
- import_cycles: strongly connected components of more than one module in the graph of rotkv's
  module-level imports (and, apart, counting imports inside functions too);
- lines: ``wc -l`` of rotkv/kernels/*.py, rotkv/cache/pools.py, rotkv/quant/*.py and all of rotkv/.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = (Path(sys.argv[sys.argv.index("--root") + 1]).resolve() if "--root" in sys.argv
        else Path(__file__).resolve().parents[1])
PKG = ROOT / "rotkv"

PATTERNS = {
    "width_rederived": re.compile(r"\*\s*8\s*//"),
    "group_rederived": re.compile(r"(scale\w*|body\[[14]\])\.shape\[-1\]"),
    "width_literals": re.compile(r"[\(\[]2, (3, )?4(, 8)?[\)\]]"),
    "coverage_deciders": re.compile(r"kernel_tokens\s*=|can_dequant_kernel\s*=|def _kernel_ok|def _use_cuda_body|"
                                    r"def supported\(|def token_encode|wanted = \(?backend|def shape_reason|"
                                    r"kernels/prebuild.py:.*def plan\(|replace\(cfg, backend=\"triton\"|"
                                    r"def part_reason|def triton_decode_reason|def cuda_decode_reason|"
                                    r"def cuda_write_reason|class DecodePlan|def decode_plan\("),
}


def _py_files():
    return sorted(p for p in PKG.rglob("*.py"))


def grep(name: str) -> list[str]:
    pat = PATTERNS[name]
    hits = []
    for p in _py_files():
        rel = p.relative_to(ROOT).as_posix()
        if name == "width_literals" and rel == "rotkv/quant/widths.py":
            continue  # the table itself
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            if pat.search(line) or (name == "coverage_deciders" and pat.search(f"{rel}:{line}")):
                hits.append(f"{rel}:{i}: {line.strip()}")
    return hits


def _module(p: Path) -> str:
    parts = list(p.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph(top_level_only: bool) -> dict[str, set[str]]:
    mods = {_module(p): p for p in _py_files()}
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        tree = ast.parse(p.read_text())
        nodes = tree.body if top_level_only else list(ast.walk(tree))
        if top_level_only:  # also imports under module-level if/try (not inside functions or classes)
            stack, nodes = list(tree.body), []
            while stack:
                n = stack.pop()
                nodes.append(n)
                if isinstance(n, (ast.If, ast.Try)):
                    stack.extend(n.body + n.orelse + getattr(n, "finalbody", [])
                                 + [x for h in getattr(n, "handlers", []) for x in h.body])
        for n in nodes:
            names = []
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                if n.level:
                    base = m.split(".")[: len(m.split(".")) - n.level + (p.name == "__init__.py")]
                    mod = ".".join(base + ([n.module] if n.module else []))
                else:
                    mod = n.module or ""
                # ``from pkg import sub``: an edge to the submodule only (not to pkg's __init__)
                subs = [f"{mod}.{a.name}" for a in n.names if f"{mod}.{a.name}" in mods]
                names = subs if len(subs) == len(n.names) else [mod] + subs
            for name in names:
                while name and name not in mods:
                    name = name.rpartition(".")[0]
                if name and name != m and name.startswith("rotkv") and name != "rotkv":
                    graph[m].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def lines(paths) -> int:
    return sum(len(p.read_text().splitlines()) for p in paths)


def figures() -> dict:
    out = {name: grep(name) for name in PATTERNS}
    res = {name: {"count": len(h), "where": h} for name, h in out.items()}
    files = sorted({h.split(":")[0] for h in out["coverage_deciders"]})
    res["coverage_files"] = {"count": len(files), "where": files}
    for scope, top in (("import_cycles", True), ("import_cycles_with_function_imports", False)):
        cyc = cycles(import_graph(top))
        res[scope] = {"count": len(cyc), "where": [" <-> ".join(c) for c in cyc]}
    res["lines"] = {
        "rotkv/kernels/*.py": lines(sorted((PKG / "kernels").glob("*.py"))),
        "rotkv/cache/pools.py": lines([PKG / "cache" / "pools.py"]),
        "rotkv/quant/*.py": lines(sorted((PKG / "quant").glob("*.py"))),
        "rotkv/**/*.py": lines(_py_files()),
    }
    return res


def main() -> None:
    res = figures()
    if "--json" in sys.argv:
        print(json.dumps(res, indent=1))
        return
    for name, v in res.items():
        if name == "lines":
            print("lines: " + ", ".join(f"{k} {n}" for k, n in v.items()))
            continue
        print(f"{name}: {v['count']}")
        for w in v["where"]:
            print(f"    {w}")


if __name__ == "__main__":
    main()
