"""The CUDA body kernel reading the refine tier itself (its ROTKV_REFINE build, ``refine_split=kernel``): one
launch over a refined body, no split, against the PyTorch reference with the tier, and against the split
(``refine_split=1``: v1 over the refined pages, the CUDA kernel over the others). GPU only (the plan's CPU
side: tests/test_plan.py)."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_kernels import _build  # noqa: E402

from rotkv import switches  # noqa: E402
from rotkv.kernels import plan as kplan  # noqa: E402
from rotkv.kernels.body import RefineTier  # noqa: E402
from rotkv.kernels.decode import DecodeConfig, decode_attention  # noqa: E402
from rotkv.kernels.reference import decode_reference  # noqa: E402

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

CASES = [  # (body lens, tier lens, kv heads, n_rep, head_dim, group, page, score, ring pages, every)
    # SmolLM2's layout (fp16 query, QF16=1); a request without body (0 refined pages), one with fewer pages than K
    ([300, 70, 0, 16], [5, 20, 3, 0], 3, 3, 64, 64, 16, "bf16", 4, 0),
    # Qwen3-8B's layout (int8 query); the size rule: one refined page per 3 (the 700-token row: 15 of 44 pages)
    ([700, 45], [9, 4], 2, 4, 128, 64, 16, "int8", 8, 3),
    ([700, 45], [9, 4], 2, 4, 128, 64, 16, "int8", 8, 1),  # every = 1: min(K, n) pages
    ([500, 33], [3, 2], 2, 2, 64, 32, 16, "bf16", 3, 1),  # 2 groups at head_dim 64
    ([400, 130], [4, 4], 1, 8, 128, 32, 32, "int8", 5, 2),  # 4 groups, 32-token pages
    ([260, 90], [4, 1], 2, 3, 128, 128, 16, "bf16", 4, 0),  # the fp16 query at head_dim 128, one group
]


def _rings(n, k, h, p, d, every, sides, seed):
    gen = torch.Generator().manual_seed(seed)
    return {s: RefineTier(torch.randint(0, 256, (n, k, h, p, d // 4), generator=gen, dtype=torch.uint8).cuda(), k,
                          every) for s in sides}


def _run(mode, q, body, table, ml, tier, ttable, tml, cfg, rings):
    with switches.override(refine_split=mode):
        plan = kplan.plan_decode(q, body, cfg, ("k" in rings, "v" in rings))
        launch = plan.launch(q.shape[0] * body.kv_heads * ml)
        out = decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg, plan=plan, refine=rings.get("k"),
                               refine_values=rings.get("v"))
    return out, launch, plan


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@cuda_only
@pytest.mark.parametrize("fuse", ["none", "block", "all"])
@pytest.mark.parametrize("v_meta", ["fp16", "e4m3"])
@pytest.mark.parametrize("sides", ["k", "v", "kv"])
@pytest.mark.parametrize("lens,tier_lens,h,rep,d,g,p,score,k,every", CASES)
def test_cuda_kernel_reads_the_refine_tier(lens, tier_lens, h, rep, d, g, p, score, k, every, sides, v_meta, fuse):
    meta = torch.float8_e4m3fn if v_meta == "e4m3" else torch.float16
    if meta == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("e4m3 metadata needs compute capability 8.9+")
    body, table, tier, ttable, ml, tml = _build(lens, tier_lens, h, d, g, p, 16, "cuda", seed=k + d, v_meta=meta)
    q = torch.randn(len(lens), h * rep, d, generator=torch.Generator().manual_seed(k + 7)).to("cuda", torch.bfloat16)
    rings = _rings(len(lens), k, h, p, d, every, sides, seed=k + 11)
    # the fp16 query's second operand maker (QF16=2) rides on the "block" runs
    cfg = DecodeConfig(backend="cuda", score=score, small_work=0, cuda_min_split_tokens=64, cuda_target_warps=64,
                       cuda_fuse=fuse, cuda_score_f16=2 if fuse == "block" else 1)
    out, launch, plan = _run("kernel", q, body, table, ml, tier, ttable, tml, cfg, rings)
    assert launch.kernel == "cuda" and launch.refine and plan.refine_split(len(lens) * h * ml) is None, launch
    split, split_launch, _ = _run("1", q, body, table, ml, tier, ttable, tml, cfg, rings)
    assert not split_launch.refine
    ref = decode_reference(q.float(), body, table, tier[0], tier[1], ttable, refine=rings.get("k"),
                           refine_values=rings.get("v"))
    plain = decode_reference(q.float(), body, table, tier[0], tier[1], ttable)
    tol = 2e-2 if score == "int8" else 1e-2
    err, err_split = _rel(out, ref), _rel(split, ref)
    assert torch.isfinite(out).all()
    assert err < tol, (err, err_split)
    assert err < 1.5 * err_split + 2e-3, (err, err_split)  # as close as the split (v1 + CUDA) gets
    assert _rel(plain, ref) > 3 * err, (_rel(plain, ref), err)  # the refinements count: the test can fail


@cuda_only
@pytest.mark.parametrize("lens,tier_lens,h,rep,d,g,p,score,k,every", [CASES[0], CASES[1]])
def test_cuda_refine_kernel_in_a_cuda_graph(lens, tier_lens, h, rep, d, g, p, score, k, every):
    """Captured and replayed (the refined counts come from the page table: no new per-step data), after the
    rings change too, equal to the eager call."""
    body, table, tier, ttable, ml, tml = _build(lens, tier_lens, h, d, g, p, 16, "cuda", seed=3,
                                                v_meta=torch.float8_e4m3fn)
    q = torch.randn(len(lens), h * rep, d, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    rings = _rings(len(lens), k, h, p, d, every, "kv", seed=5)
    cfg = DecodeConfig(backend="cuda", score=score, small_work=0, cuda_fuse="all")
    out = torch.empty_like(q)
    with switches.override(refine_split="kernel"):
        plan = kplan.plan_decode(q, body, cfg, (True, True))
        assert plan.launch(len(lens) * h * ml).refine
        run = lambda: decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg, plan=plan, out=out,  # noqa: E731
                                       refine=rings["k"], refine_values=rings["v"])
        run()
        torch.cuda.synchronize()
        eager = out.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        for r in rings.values():
            r.ring.copy_(torch.randint(0, 256, r.ring.shape, generator=torch.Generator().manual_seed(9),
                                       dtype=torch.uint8))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out.clone()
        run()
        torch.cuda.synchronize()
    assert torch.equal(replayed, out) and not torch.equal(replayed, eager)
