"""Count the kernel launches of one layer of rotkv's graphed vLLM decode step (``rotkv.integrations.vllm.graph
.static_step``) on the CPU: Triton launches under the interpreter plus the ATen ops outside them that launch a
kernel on CUDA (views and allocations left out), with the GPU's choices forced (kernels on, the bf16x2 rotations
through the rotation kernel, a bf16 side pool, quarot-int2 at sink 16 / window 32). On a GPU the CUDA decode and
write kernels may replace the Triton ones; the profile (job ``qwen-prof``) is the measurement.

    TRITON_INTERPRET=1 .venv/bin/python studies/vllm_graph_launches.py ROWS
"""
import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from types import SimpleNamespace
from rotkv import switches
from rotkv.kernels.plan import rotate_reason
from rotkv.rotations import base
from rotkv.integrations.vllm import attention
from rotkv.integrations.vllm.graph import StaticDecode, static_plan, static_step
from rotkv.config import get_preset
from rotkv.rotations.registry import build_rotations
import test_vllm_plugin as t
import triton.runtime.interpreter as ti

switches.configure(rotation_math="bf16x2")
base.plan_rotate = lambda x, a: rotate_reason(x, a) is None
attention.kernels = SimpleNamespace(enabled=lambda x: True, decode_config=attention.kernels.decode_config)
launches = collections.Counter()
orig = ti.InterpretedFunction.run
INSIDE = [0]
def run(self, *a, **k):
    launches["triton:" + self.fn.__name__] += 1
    INSIDE[0] += 1
    try:
        return orig(self, *a, **k)
    finally:
        INSIDE[0] -= 1
ti.InterpretedFunction.run = run
VIEWS = {"view", "_unsafe_view", "transpose", "slice", "select", "unsqueeze", "as_strided", "expand", "t", "alias",
         "detach", "permute", "reshape", "empty", "empty_strided", "split", "squeeze", "lift_fresh", "_reshape_alias",
         "unbind", "split_with_sizes", "clone_no"}
class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS and not INSIDE[0]:
            launches["aten:" + name] += 1
        return func(*args, **(kwargs or {}))

h, hq, d, b = 2, 4, 64, int(sys.argv[1])
spec = get_preset("quarot-int2", sink=16, window=32)
rot = build_rotations("hadamard", 1, h, d)[0]
sim = t.VllmSim(spec, rot, h, hq, d, nblocks=64, side_dtype=torch.bfloat16)
gen = torch.Generator().manual_seed(0)
names = [f"r{i}" for i in range(b)]
for r in names:
    n = 70
    sim.step([r], [n], *([torch.randn(n, m, d, generator=gen).bfloat16()] for m in (hq, h, h)))
st = StaticDecode(sim.geo, rows=b, scratch=sim.slots.scratch, device="cpu", kv_heads=h, head_dim=d)
lens = np.array([71] * b)
sim.grow(names, lens)
table = sim.table(names)
slots = sim.slots.assign(names, lens - 1)
st.load(static_plan(sim.geo, lens, slots, np.ones(b, dtype=np.int64), sim.slots.scratch, table.shape[1]), table)
q, k, v = (torch.randn(b, m, d, generator=gen).bfloat16() for m in (hq, h, h))
out = torch.zeros(b, hq, d, dtype=torch.bfloat16)
static_step(st, b, q, k, v, sim.body, sim.side_k, sim.side_v, rot, sim.codecs, d ** -0.5, out)  # warm (bf16x2 splits)
launches.clear()
with Count():
    static_step(st, b, q, k, v, sim.body, sim.side_k, sim.side_v, rot, sim.codecs, d ** -0.5, out)
for k_, n_ in sorted(launches.items()):
    print(f"{n_:3d}  {k_}")
print("total", sum(launches.values()))
