"""No import cycle among rotkv's modules, and the seams' directions: read from the source with ast
(scripts/import_cycles.py, the command that counts them), so function-level imports count too."""

import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("import_cycles", os.path.join(ROOT, "scripts", "import_cycles.py"))
ic = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ic)

MODS = ic.modules()
EDGES = ic.edges(MODS)


def imports_of(module: str) -> set[str]:
    """Every rotkv module ``module`` imports, at module or function level."""
    return {b for (a, b) in EDGES if a == module}


def test_walker_finds_a_cycle_of_either_kind(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "c.py").write_text("import pkg.d\n")
    (pkg / "d.py").write_text("from pkg import c\n")
    r = ic.report(str(pkg))
    assert r["cycles"]["function"] == [["pkg.a -m-> pkg.b", "pkg.b -f-> pkg.a"]]
    assert r["cycles"]["module"] == [["pkg.c -m-> pkg.d", "pkg.d -m-> pkg.c"]]


def test_no_import_cycles():
    r = ic.report()
    assert r["modules"] > 50 and r["edges"]["module"] > 100  # it did read rotkv
    assert r["cycles"] == {"module": [], "function": []}


def test_model_structure_is_a_leaf_below_rotations():
    # rotkv.hf.geometry reads a model's structure and imports nothing of rotkv; rotations, calibration
    # and artifacts read the model through it, never through the loader (rotkv.hf.models)
    assert imports_of("rotkv.hf.geometry") == set()
    for m in MODS:
        if m.startswith("rotkv.rotations."):
            hf = {t for t in imports_of(m) if t.startswith("rotkv.hf")}
            assert hf <= {"rotkv.hf.geometry"}, (m, hf)
            assert not {t for t in imports_of(m) if t.split(".")[1] in ("cache", "calibrate", "eval", "cli")}, m
    assert "rotkv.rotations.artifact" not in imports_of("rotkv.hf.models")


@pytest.mark.parametrize("module", ["rotkv.cache.base", "rotkv.cache.layer", "rotkv.cache.rowstore",
                                    "rotkv.cache.progressive", "rotkv.cache.codecs"])
def test_layers_do_not_import_the_cache_or_its_assembly(module):
    # the cache is assembled above its layers: cache -> assembly -> layer, progressive, rowstore, codecs
    assert not imports_of(module) & {"rotkv.cache.cache", "rotkv.cache.assembly"}, module


def test_assembly_is_below_the_cache():
    assert "rotkv.cache.assembly" in imports_of("rotkv.cache.cache")
    assert "rotkv.cache.cache" not in imports_of("rotkv.cache.assembly")
    assert {"rotkv.cache.layer", "rotkv.cache.progressive"} <= imports_of("rotkv.cache.assembly")


def test_config_reads_only_the_registry():
    # the presets and the method registry are read by the command line before torch loads
    assert imports_of("rotkv.config") == {"rotkv.rotations.registry", "rotkv.quant.widths"}
    assert imports_of("rotkv.quant.widths") == set()
    assert imports_of("rotkv.rotations.registry") <= {"rotkv.rotations.base"}
