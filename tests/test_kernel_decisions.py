"""Which kernel runs is decided in rotkv/kernels/plan.py only (read from the source with ast).

Every other module asks plan.py for a plan (plan_decode, plan_write, plan_step, plan_pools,
plan_encode, plan_rotate, rotation_math, check_graph) and runs it: none calls the coverage checks
(``*_reason``, ``kernels_enabled``), reads a switch that picks a kernel, builds a launch, or
overrides a plan. The first test shows the check finds each kind of decision.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "rotkv" / "kernels" / "plan.py"

DECIDERS = {"kernels_enabled", "have_triton", "part_reason", "triton_decode_reason", "cuda_decode_reason",
            "cuda_write_reason", "rotate_reason", "shape_reason", "refine_reason", "device_capability", "Launch",
            "DecodePlan", "v1_launch", "plan_refine_split", "RefineSplit"}
# the switches that pick a kernel (rotkv.switches fields), read by plan.py only
KERNEL_SWITCHES = {"kernels", "decode_backend", "write_backend", "decode_score", "fp8_kernels", "cuda_write_fp8",
                   "refine_kernel", "refine_split", "rotation_math", "decode", "cuda_key4"}


def decisions(source: str) -> list[str]:
    """``name:line`` of every kernel decision made in ``source`` (a module other than plan.py)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in DECIDERS:
                found.append(f"{name}:{node.lineno}")
        elif isinstance(node, ast.Attribute) and node.attr in KERNEL_SWITCHES:
            v = node.value  # switches.get().<field>, or a name bound to switches.get()
            if (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) and v.func.attr == "get"
                    and isinstance(v.func.value, ast.Name) and v.func.value.id == "switches") or \
                    (isinstance(v, ast.Name) and v.id in ("sw", "switch")):
                found.append(f"{node.attr}:{node.lineno}")
    return found


def test_the_check_finds_each_kind_of_decision():
    src = """
from rotkv import switches
from rotkv.kernels import plan
def f(x, layout, p):
    if plan.kernels_enabled(x) and plan.part_reason(2, x.dtype) is None:
        pass
    if switches.get().refine_kernel:
        pass
    sw = switches.get()
    backend = sw.write_backend
    launch = p.v1_launch()
    split = plan_refine_split(launch, switches.get().refine_split, launch)
    return triton_decode_reason(layout), Launch("triton", None), RefineSplit("cuda", launch)
"""
    assert sorted(d.split(":")[0] for d in decisions(src)) == sorted([
        "kernels_enabled", "part_reason", "refine_kernel", "write_backend", "v1_launch", "triton_decode_reason",
        "Launch", "plan_refine_split", "refine_split", "RefineSplit"])
    assert decisions("from rotkv.kernels import plan\nplan.plan_step(q, body, cfg, True)\n"
                     "split = p.refine_split(work)\n") == []  # asking a plan for its split is no decision


def test_kernel_choice_is_made_in_plan_py_only():
    made = {}
    for path in sorted((ROOT / "rotkv").rglob("*.py")):
        if path == PLAN or path.name == "switches.py":
            continue
        found = decisions(path.read_text())
        if found:
            made[str(path.relative_to(ROOT))] = found
    assert made == {}


def test_plan_decode_receives_the_refine_tier():
    """The refine tier reaches plan_decode (no caller swaps the plan's kernel): a refined body's plan runs
    the Triton v1 kernel with body tokens, the plain plan's launches otherwise."""
    import torch

    from rotkv.kernels import plan
    from rotkv.kernels.body import PagedBody

    body = PagedBody.zeros(4, 2, 16, 64, (2, 2), 32)
    q = torch.zeros(1, 4, 64)
    cfg = plan.DecodeConfig(v2=True)
    plain = plan.plan_decode(q, body, cfg)
    refined = plan.plan_decode(q, body, cfg, refine=(True, False))
    assert refined is not plain and refined.refine == (True, False) and plain.refine == (False, False)
    assert plain.launch(100).v2 and not refined.launch(100).v2 and refined.launch(100).kernel == "triton"
    assert refined.launch(0) == plain.launch(0)  # no body tokens: the tier's launch either way
    assert plan.plan_decode(q, body, cfg, refine=(True, False)) is refined  # cached with the refine sides
    assert plan.plan_decode(q, None, cfg, refine=(True, True)).refine == (False, False)  # no body, no tier
