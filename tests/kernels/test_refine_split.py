"""The refine split (rotkv.kernels.refine_split): the refined pages through the Triton v1 kernel, the others
through the plan's body kernel (on the CPU the PyTorch reference stands in for the CUDA kernel), merged by
log-sum-exp, against the PyTorch reference; the size rule; a layer through page flushes and ring growth."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from test_backend import kernel_against_reference  # noqa: E402
from test_kernels import _build  # noqa: E402

from rotkv import switches  # noqa: E402
from rotkv.kernels import plan as kplan  # noqa: E402
from rotkv.kernels import refine_split as rs  # noqa: E402
from rotkv.kernels.body import RefineTier  # noqa: E402
from rotkv.kernels.decode import DecodeConfig, decode_attention  # noqa: E402
from rotkv.kernels.plan import Launch  # noqa: E402
from rotkv.kernels.reference import decode_reference  # noqa: E402

CASES = [  # (body lens, tier lens, kv heads, n_rep, head_dim, group, page, qk_int8, ring pages, every)
    ([37, 70], [5, 20], 2, 3, 64, 64, 16, False, 2, 0),  # SmolLM2's layout, a partial last page
    ([45, 0, 130], [3, 9, 4], 1, 4, 128, 64, 16, True, 4, 3),  # a request without body; the size rule
    ([90, 17], [2, 3], 2, 2, 64, 16, 8, False, 20, 0),  # more ring slots than pages: every page refined
    ([160, 48], [4, 4], 2, 2, 64, 32, 16, False, 3, 2),  # the rule below the cap in one row, at it in the other
]


def _mode(device):
    """The ``refine_split`` switch that splits here: the CUDA kernel as the rest on a GPU, the PyTorch
    reference on the CPU."""
    return "1" if device == "cuda" else "reference"


@pytest.mark.parametrize("sides", ["k", "kv"])
@pytest.mark.parametrize("lens,tier_lens,h,rep,d,g,p,int8,k,every", CASES)
def test_split_matches_the_reference(lens, tier_lens, h, rep, d, g, p, int8, k, every, sides, device):
    body, table, tier, ttable, ml, tml = _build(lens, tier_lens, h, d, g, p, 16, device, seed=k)
    gen = torch.Generator().manual_seed(k + 7)
    q = torch.randn(len(lens), h * rep, d, generator=gen).to(device, torch.bfloat16)
    rings = {s: RefineTier(torch.randint(0, 256, (len(lens), k, h, p, d // 4), generator=gen,
                                         dtype=torch.uint8).to(device), k, every) for s in sides}
    # small_work=0: the plan's main launch (the CUDA kernel on a GPU), the one the split pairs with v1
    cfg = DecodeConfig(qk_int8=int8, block_n=32, block_t=16, target_programs=8, min_split_tokens=32,
                       score="int8" if int8 else "bf16", small_work=0)
    sides_given = ("k" in rings, "v" in rings)
    with switches.override(refine_split=_mode(device)):
        split = kplan.plan_decode(q, body, cfg, sides_given).refine_split(len(lens) * h * ml)
        assert split is not None or device == "cuda"  # a GPU splits where the CUDA kernel covers the body
        out = decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg, refine=rings.get("k"),
                               refine_values=rings.get("v"))
    ref = decode_reference(q.float(), body, table, tier[0], tier[1], ttable, refine=rings.get("k"),
                           refine_values=rings.get("v"))
    plain = decode_reference(q.float(), body, table, tier[0], tier[1], ttable)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert torch.isfinite(out).all()
    assert err < (2e-2 if int8 else 1e-2), err
    assert ((plain - ref).norm() / ref.norm()).item() > 5 * err  # the refinements count: the test can fail
    # the split reads each page once: against the unsplit v1 kernel (every page in one launch) the
    # difference is the kernels' rounding, far below what a page read twice or missed would move
    with switches.override(refine_split="0"):
        assert kplan.plan_decode(q, body, cfg, sides_given).refine_split(len(lens) * h * ml) is None
        whole = decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg, refine=rings.get("k"),
                                 refine_values=rings.get("v"))
    assert ((out.float() - whole.float()).norm() / ref.norm()).item() < 2 * err + 1e-3


@pytest.mark.parametrize("least", [16, 256])
def test_refined_pages_take_their_own_split_size(least, device, monkeypatch):
    """The refined pages' launch splits at ``refine_min_split_tokens`` (not the body's ``min_split_tokens``):
    a ring of 20 pages over rows of 90 and 17 tokens, every page refined, so the longest row's 90 refined tokens
    go in two splits or one, each matching the reference."""
    from rotkv.kernels import decode as kdecode

    lens, tier_lens, h, rep, d, g, p, k = [90, 17], [2, 3], 2, 2, 64, 16, 8, 20
    body, table, tier, ttable, ml, tml = _build(lens, tier_lens, h, d, g, p, 16, device, seed=k)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(len(lens), h * rep, d, generator=gen).to(device, torch.bfloat16)
    ring = RefineTier(torch.randint(0, 256, (len(lens), k, h, p, d // 4), generator=gen, dtype=torch.uint8)
                      .to(device), k, 0)
    cfg = DecodeConfig(block_n=16, block_t=16, target_programs=8, min_split_tokens=128, small_work=0,
                       refine_min_split_tokens=least, score="bf16", qk_int8=False)
    seen = []
    real = kdecode._splits

    def spy(max_len, *args):
        out = real(max_len, *args)
        seen.append((max_len, args[3], out[1]))  # args: (bh, block, target, min_tokens[, cap])
        return out

    monkeypatch.setattr(kdecode, "_splits", spy)
    with switches.override(refine_split=_mode(device)):
        out = decode_attention(q, body, table, ml, tier, ttable, tml, cfg=cfg, refine=ring)
    ref = decode_reference(q.float(), body, table, tier[0], tier[1], ttable, refine=ring)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2
    refined = [n for max_len, m, n in seen if m == least and max_len == min(k * p, ml)]
    assert refined == ([2] if least == 16 else [1])  # the longest row's 90 refined tokens: 2 x 48, or 1 x 256


def test_split_writes_the_rest_table(device, monkeypatch):
    """The refined launch's second table: every request ends where its refined pages start, (n - rn) * P
    tokens (the reference reads that table; a request without body pages keeps 0)."""
    from rotkv.kernels.reference import lengths_from_table
    from rotkv.quant.refine import refined_pages

    lens, k, every, p = [45, 0, 130, 16], 4, 3, 16
    body, table, tier, ttable, ml, tml = _build(lens, [3, 9, 4, 2], 1, 128, 64, p, 16, device, seed=1)
    q = torch.randn(len(lens), 4, 128).to(device, torch.bfloat16)
    ring = RefineTier(torch.zeros(len(lens), k, 1, p, 32, dtype=torch.uint8, device=device), k, every)
    seen = []
    monkeypatch.setattr(rs, "rest_partials_reference", lambda q, body, t, *a: seen.append(t[2].clone())
                        or REST(q, body, t, *a))
    with switches.override(refine_split="reference"):
        decode_attention(q, body, table, ml, tier, ttable, tml, refine=ring)
    n = torch.tensor([-(-x // p) for x in lens])
    rn = torch.as_tensor(refined_pages(n.numpy(), k, every))
    got = lengths_from_table(table[0].cpu(), seen[0].cpu(), p)
    assert got.tolist() == ((n - rn) * p).tolist()


REST = rs.rest_partials_reference


def test_plan_refine_split(setenv):
    """The split is the plan's: plan_refine_split of the launch the body would run without the tier, under
    the ``refine_split`` switch (ROTKV_TUNING)."""
    from rotkv.kernels.body import PagedBody

    v1 = Launch("triton", kplan.DecodeConfig())
    cuda = Launch("cuda", kplan.DecodeConfig(), cuda_variant=(64,))
    triton = Launch("triton", kplan.DecodeConfig(), v2=True)
    assert kplan.plan_refine_split(cuda, "0", v1) is None and kplan.plan_refine_split(triton, "1", v1) is None
    assert kplan.plan_refine_split(cuda, "1", v1) == kplan.RefineSplit("cuda", v1)
    assert kplan.plan_refine_split(triton, "reference", v1) == kplan.RefineSplit("reference", v1)
    with pytest.raises(ValueError, match="rest"):
        kplan.RefineSplit("triton", v1)
    body = PagedBody.zeros(4, 2, 16, 64, (2, 2), 32)
    q = torch.zeros(1, 6, 64)
    refined = kplan.plan_decode(q, body, kplan.DecodeConfig(), (True, True))
    assert refined.refine_split(100) is None and refined.launch(100) == refined.refine_launch  # the default
    setenv("ROTKV_TUNING", "refine_split=reference")
    refined = kplan.plan_decode(q, body, kplan.DecodeConfig(), (True, True))
    split = refined.refine_split(100)
    assert split == kplan.RefineSplit("reference", refined.refine_launch) and not split.refined.v2
    assert refined.launch(100) == refined.main  # the launch of the unrefined pages
    assert refined.refine_split(0) is None and "PyTorch reference" in refined.describe()
    assert kplan.plan_decode(q, body, kplan.DecodeConfig()).refine_split(100) is None  # no refine tier
    setenv("ROTKV_TUNING", "refine_split=1")  # on the CPU the body kernel is Triton: no split
    assert kplan.plan_decode(q, body, kplan.DecodeConfig(), (True, False)).refine_split(100) is None
    with pytest.raises(ValueError, match="ROTKV_TUNING refine_split must be one of"):
        setenv("ROTKV_TUNING", "refine_split=yes")
    with pytest.raises(ValueError, match="ROTKV_REFINE_SPLIT is no longer read: set ROTKV_TUNING=refine_split="):
        switches.from_environ({"ROTKV_REFINE_SPLIT": "1"})


@pytest.mark.parametrize("every", [0, 2])
def test_layer_decodes_through_the_split(every, device, monkeypatch, kernels_on_cpu, setenv):
    """A HybridLayer with a refine tier (keys and values) decodes through the split (the reference standing
    in for the CUDA kernel on the CPU) as its PyTorch path does, through page flushes that grow the rings
    and age pages out of the tier; ``every``: the size rule."""
    from rotkv.cache.codecs import make_codecs
    from rotkv.cache.layer import HybridLayer
    from rotkv.config import CacheSpec
    from rotkv.rotations.registry import build_rotations

    calls = []
    monkeypatch.setattr(rs, "rest_partials_reference", lambda *a: calls.append(1) or REST(*a))
    setenv("ROTKV_TUNING", f"refine_split={_mode(device)}")  # the refine tier's kernel: on by default
    h, d, rep, b = 2, 64, 3, 2
    spec = CacheSpec(bits=2, group_size=64, sink=4, window=16, page_size=16, prefill_chunk=64, rotation="hadamard",
                     clip_k=0.96, clip_v=0.92, refine_tokens=48, refine_values=True, refine_every=every)
    rot = build_rotations("hadamard", 1, h, d)[0]
    layers = [HybridLayer(spec, rot, d, h, 0, make_codecs("token", 2, 64, 0.96, 0.92, None, None, None), torch.bfloat16)
              for _ in range(2)]
    gen = torch.Generator().manual_seed(0)
    n_pre, steps = 81, 9  # a page flushed per row at 84 tokens: the flush's ring write, then reads of it
    ks, vs = (torch.randn(b, h, n_pre + steps, d, generator=gen).bfloat16().to(device) for _ in range(2))
    qs = torch.randn(b, h * rep, n_pre + steps, d, generator=gen).bfloat16().to(device)
    errs = kernel_against_reference(layers, ks, vs, qs, n_pre, setenv)
    pools = layers[1].pools
    assert (calls or device == "cuda") and pools.refine_pages > 1  # the split ran; the rings grew
    assert layers[1].state.body_count.min() > spec.refine_tokens // 16  # pages aged out of the refine tier
    assert max(errs[1:]) < 2e-2, errs
