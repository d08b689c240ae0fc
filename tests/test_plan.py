"""The kernel plans (rotkv.kernels.plan): one decision per shape and config, cached; the plans
the cache layer, the CUDA graph and `rotkv build-kernels` use. Pure Python: no GPU, no triton."""

import pytest
import torch

from rotkv.kernels import plan as P
from rotkv.kernels.body import BodyLayout, PagedBody, TokenPart

CUDA_DEV = ("cuda", 0, (9, 0), False)  # an H200, as a plan's device key (nothing runs on it here)


def _layout(d=128, g=64, bits=(2, 2), page=16, heads=2, meta=torch.float16, aligned=True):
    return BodyLayout(d, heads, page, 8, bits, (g, g), (meta, meta), ("token", "token"), aligned, "cuda")


def test_plans_are_cached_per_layout_heads_device_and_config():
    body = PagedBody.zeros(4, 2, 16, 64, (2, 2), 32)
    q = torch.zeros(1, 6, 64)
    a = P.plan_decode(q, body, P.DecodeConfig(score="bf16"))
    same = PagedBody.zeros(4, 2, 16, 64, (2, 2), 32)  # another body of the same layout, an equal config
    assert P.plan_decode(torch.ones(3, 6, 64), same, P.DecodeConfig(score="bf16")) is a
    assert P.plan_decode(q, body, P.DecodeConfig(score="int8")) is not a
    assert P.plan_decode(torch.zeros(1, 4, 64), body, P.DecodeConfig(score="bf16")) is not a
    # a grown pool is a new layout (its row count matters to the CUDA kernel)
    assert P.plan_decode(q, PagedBody.zeros(5, 2, 16, 64, (2, 2), 32), P.DecodeConfig(score="bf16")) is not a


def test_cpu_plans():
    q = torch.zeros(2, 8, 128)
    for bits in ((2, 2), (4, 2), (2, 4), (4, 4)):
        plan = P.plan_decode(q, PagedBody.zeros(4, 2, 16, 128, bits, 64), P.DecodeConfig())
        assert plan.covered and plan.small is None and plan.launch(10**6).kernel == "triton"
        assert plan.launch(10**6).v2 is False  # DecodeConfig().v2 is off; v2 reads INT2 only anyway
    tier_only = P.plan_decode(q, None, P.DecodeConfig())
    assert tier_only.covered and tier_only.launch(0).kernel == "triton"
    # bodies no decode kernel reads: the caller runs its reference, and decode_attention says why
    int8_k = PagedBody(TokenPart.zeros(4, 2, 16, 128, 8, 64, torch.float32), TokenPart.zeros(4, 2, 16, 128, 2, 64))
    for body, why in ((int8_k, "K: the kernels read widths [2, 4], got 8"),
                      (PagedBody.zeros(4, 2, 16, 128, (2, 2), 16), "group_size >= head_dim / 4 (32), got 16"),
                      (PagedBody(TokenPart.zeros(4, 2, 16, 128, 2, 64), TokenPart.zeros(4, 2, 16, 128, 2, 32)),
                       "share the group size")):
        plan = P.plan_decode(q, body, P.DecodeConfig())
        assert not plan.covered and why in plan.why and plan.describe().startswith("reference")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        P.plan_decode(q, PagedBody.zeros(4, 2, 16, 128, (2, 2), 64), P.DecodeConfig(backend="cuda"))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        P.plan_decode(torch.zeros(1, 3, 128), PagedBody.zeros(4, 2, 16, 128, (2, 2), 64), P.DecodeConfig())


def test_cuda_plan_names_its_launches():
    # the small-work launch is the plan's, stated in the config (no silent rewrite of the caller's config)
    cfg = P.DecodeConfig()
    plan = P.DecodePlan(_layout(), 8, 128, CUDA_DEV, cfg)
    assert plan.covered and plan.cuda_why in (None, "nvcc not found")
    small = plan.launch(cfg.small_work - 1)
    assert (small.kernel, small.v2, small.cfg.block_n, small.cfg.num_warps) == ("triton", True, 128, 4)
    assert small.qk_int8 and plan.small_below == cfg.small_work
    assert cfg.block_n == 64 and plan.cfg is cfg  # the caller's config is untouched
    assert "below 65536 token-heads" in plan.describe()
    # INT4 K: the small launch is Triton v1; no small launch where Triton cannot read the body
    assert P.DecodePlan(_layout(bits=(4, 2)), 8, 128, CUDA_DEV, cfg).launch(10).v2 is False
    int2_small_groups = P.DecodePlan(_layout(d=256, g=32), 8, 256, CUDA_DEV, cfg)
    assert int2_small_groups.small is None and int2_small_groups.triton_why is not None
    assert int2_small_groups.covered == (int2_small_groups.cuda_why is None)
    # what the CUDA body kernel does not take, and why
    for layout, rep, why in ((_layout(page=8), 4, "page size 8"), (_layout(), 12, "GQA group 12"),
                             (_layout(d=96, g=32), 4, "head_dim 96"), (_layout(aligned=False), 4, "aligned"),
                             (_layout(bits=(4, 4)), 4, "INT2 K and V")):
        assert why in P.cuda_decode_reason(layout, rep, "int8")
    assert P.cuda_decode_reason(_layout(bits=(4, 2)), 4, "int8") is None  # the INT4-key build (cuda_key4)
    assert "compute capability" in P.cuda_decode_reason(_layout(), 4, "int8", (7, 5))
    assert P.cuda_decode_reason(_layout(), 4, "bf16") is None  # the fp16-query build
    assert P.cuda_decode_reason(_layout(), 4, "fp8").startswith("the CUDA decode kernel reads")
    assert P.cuda_variant(P.DecodeConfig(), 64, 1)[7] == 1 and P.cuda_variant(P.DecodeConfig(), 128, 2)[7] == 0
    assert P.cuda_variant(P.DecodeConfig(score="int8"), 64, 1)[7] == 0
    assert P.cuda_variant(P.DecodeConfig(cuda_score_f16=2), 128, 2, "bf16")[7] == 2
    # the values' e4m3 metadata is the last element (ROTKV_VMETA8)
    assert P.cuda_variant(P.DecodeConfig(), 64, 1)[8] == 0
    assert P.cuda_variant(P.DecodeConfig(), 64, 1, value_meta=torch.float8_e4m3fn)[8] == 1
    with pytest.raises(ValueError, match="cuda_score_f16"):
        P.DecodeConfig(cuda_score_f16=3)
    # partial merging: unfused at head_dim 64, block merges above, as asked otherwise
    assert (P.resolve_fuse(P.DecodeConfig(), 64), P.resolve_fuse(P.DecodeConfig(), 128)) == ("none", "block")
    assert P.resolve_fuse(P.DecodeConfig(cuda_fuse="all"), 64) == "all"
    with pytest.raises(ValueError, match="cuda_fuse"):
        P.DecodeConfig(cuda_fuse="some")
    with pytest.raises(ValueError, match="page size 8"):
        P.DecodePlan(_layout(page=8), 8, 128, CUDA_DEV, P.DecodeConfig(backend="cuda"))
    triton_only = P.DecodePlan(_layout(), 8, 128, CUDA_DEV, P.DecodeConfig(backend="triton"))
    assert triton_only.small is None and triton_only.launch(10**7).kernel == "triton"


def test_write_plans():
    x = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    part = TokenPart.zeros(2, 2, 16, 64, 2, 64)
    assert P.plan_write(x, part, rotate=True, clip=0.9) == P.WritePlan("triton", "tf32x3", 4)
    wp = P.plan_write(x, part, rotate=False, clip=1.0, backend="triton", num_warps=2)
    assert wp == P.WritePlan("triton", "tf32x3", 2)
    with pytest.raises(ValueError, match="not on CUDA"):
        P.plan_write(x, part, rotate=False, clip=1.0, backend="cuda")
    with pytest.raises(ValueError, match="write backend"):
        P.plan_write(x, part, rotate=False, clip=1.0, backend="tpu")
    assert P.part_reason(2, torch.float16) is None and "fp16" in P.part_reason(4, torch.float32)
    assert "widths" in P.part_reason(3, torch.float16)


def test_build_lists_follow_the_plans():
    assert P.decode_builds_for(128, 64) == (P.cuda_variant(P.DecodeConfig(), 128, 2), None)
    assert P.decode_builds_for(128, 64, bits=4)[1] == "decode: INT4 pages run the Triton kernel"
    assert P.decode_builds_for(64, 64) == (P.cuda_variant(P.DecodeConfig(), 64, 1), None)
    assert P.decode_builds_for(64, 64)[0][7] == 1  # fp16 query at head_dim 64
    assert "head_dim 96" in P.decode_builds_for(96, 32)[1]
    writes, note = P.write_builds_for(128, 64)
    assert note is None and [w[0] for w in writes] == [True, False]
    assert P.write_builds_for(128, 16) == ([], "write: group_size 16 is not a multiple of 32 (Triton runs)")


def test_refine_split_kernel_runs_one_cuda_launch():
    """``refine_split=kernel``: a refined body whose plain launch is the CUDA kernel runs that kernel reading the
    tier itself (its ROTKV_REFINE build), no split; where its build cannot (the bf16 value product) the call
    splits as with "1"; where the body kernel is Triton, v1 reads every page; the default "1" still splits."""
    from rotkv import switches

    cfg = P.DecodeConfig(small_work=0)
    variant = P.cuda_variant(cfg, 64, 1)

    def plan(mode, cfg=cfg, main="cuda", refine=(True, True)):
        with switches.override(refine_split=mode):
            p = P.DecodePlan(_layout(d=64), 6, 64, CUDA_DEV, cfg, refine)
        # the plain plan's launch, set here (resolving it would build the CUDA library)
        p._main = P.Launch("cuda", cfg, cuda_variant=P.cuda_variant(cfg, 64, 1)) if main == "cuda" \
            else P.Launch("triton", cfg)
        return p

    own = plan("kernel")
    launch = own.launch(10**6)
    assert launch.kernel == "cuda" and launch.refine and launch.cuda_variant == P.with_refine(variant, cfg)
    assert "+refine" in launch.name
    assert own.refine_split(10**6) is None and own.launch(10**6) is launch  # one launch, cached
    assert own.launch(0) == own._tier and not own.launch(0).refine  # no body tokens: the tier alone
    for sides in ((True, False), (False, True)):
        assert plan("kernel", refine=sides).launch(10**6).refine
    assert not plan("kernel", refine=(False, False)).launch(10**6).refine  # no tier: the plain CUDA launch
    assert "reads the tier itself" in own.describe()
    # the default splits: v1 over the refined pages, the CUDA kernel (not reading the tier) over the others
    split = plan("1")
    assert not split.launch(10**6).refine and split.refine_split(10**6).rest == "cuda"
    # the bf16 value product cannot take the merged codes: the split
    bf16v = dataclasses_replace(cfg, cuda_value_f16=False)
    p = plan("kernel", cfg=bf16v)
    assert P.cuda_refine_reason(P.cuda_variant(bf16v, 64, 1)) is not None
    assert not p.launch(10**6).refine and p.refine_split(10**6).rest == "cuda"
    # a Triton body kernel: v1 reads every page
    tri = plan("kernel", main="triton")
    assert tri.refine_split(10**6) is None and tri.launch(10**6) is tri.refine_launch
    # the pure functions
    cuda = P.Launch("cuda", cfg, cuda_variant=variant)
    assert P.plan_refine_kernel(cuda, "kernel").refine
    assert all(P.plan_refine_kernel(cuda, m) is None for m in ("0", "1", "reference"))
    assert P.plan_refine_kernel(P.Launch("triton", cfg), "kernel") is None
    assert P.plan_refine_split(cuda, "kernel", P.Launch("triton", cfg)) is None
    with pytest.raises(ValueError, match="refine_split"):
        with switches.override(refine_split="split"):
            pass


def test_refine_split_auto_reads_the_tier_in_the_cuda_kernel_at_head_dim_64_only():
    """The default, ``refine_split=auto``: the CUDA kernel reads the refine tier itself at the head dims of
    ``AUTO_REFINE_HEAD_DIMS`` (64), and the call splits at head_dim 128 (whose refine build spills registers)."""
    from rotkv import switches

    assert switches.Switches().refine_split == "auto" and P.AUTO_REFINE_HEAD_DIMS == (64,)
    cfg = P.DecodeConfig(small_work=0)
    for d, reads in ((64, True), (128, False)):
        variant = P.cuda_variant(cfg, d, d // 64)  # _layout's group size is 64
        with switches.override(refine_split="auto"):
            p = P.DecodePlan(_layout(d=d), 6, d, CUDA_DEV, cfg, (True, True))
        p._main = P.Launch("cuda", cfg, cuda_variant=variant)  # set here: resolving it would build the library
        launch = p.launch(10**6)
        assert launch.kernel == "cuda" and launch.refine is reads, (d, launch)
        split = p.refine_split(10**6)
        assert (split is None) if reads else (split.rest == "cuda"), (d, split)
        assert ("at head_dim 64" in p.describe()) and ("reads the tier itself" in p.describe())
        # "kernel" reads it at every head dim, "1" at none
        assert P.plan_refine_kernel(P.Launch("cuda", cfg, cuda_variant=variant), "kernel").refine
        assert P.plan_refine_kernel(P.Launch("cuda", cfg, cuda_variant=variant), "1") is None


def dataclasses_replace(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def test_int4_keys_run_the_cuda_kernel_with_the_cuda_key4_switch(monkeypatch):
    """A layer with INT4 keys and INT2 values (oscar-mix's 4-bit-key layers): Triton v1 as before with the
    ``cuda_key4`` switch off; with it on (the default), the CUDA kernel's ROTKV_K4 build."""
    from rotkv import switches
    from rotkv.kernels import cuda_decode

    assert switches.Switches().cuda_key4 is True
    assert switches.from_environ({"ROTKV_TUNING": "cuda_key4=0"}).cuda_key4 is False
    assert "cuda_key4" in switches.TUNING_FIELDS
    cfg = P.DecodeConfig(small_work=0)
    with switches.override(cuda_key4=False):
        off = P.DecodePlan(_layout(d=64, bits=(4, 2)), 6, 64, CUDA_DEV, cfg)
    assert "cuda_key4=1" in off.cuda_why and off.cuda_expected  # an expected reason: no warning
    assert off.launch(10**6).kernel == "triton" and not off.launch(10**6).v2
    built = []
    monkeypatch.setattr(cuda_decode, "build", lambda device, variant: built.append(variant))
    monkeypatch.setattr(P, "_nvcc_path", lambda: "/usr/bin/nvcc")
    for d, ng, score in ((64, 1, "bf16"), (128, 2, "int8"), (256, 4, "int8")):
        with switches.override(cuda_key4=True):
            on = P.DecodePlan(_layout(d=d, g=d // ng, bits=(4, 2)), 6, d, CUDA_DEV, cfg)
            launch = on.launch(10**6)
        want = P.cuda_variant(cfg, d, ng, score, key_bits=4)
        assert on.cuda_why is None and launch.kernel == "cuda" and launch.cuda_variant == want == built[-1]
        assert len(want) == 11 and want[P.VARIANT_K4] == 1 and want[P.VARIANT_REFINE] == 0
        assert P.variant_key_bits(want) == 4 and P.variant_key_bits(P.cuda_variant(cfg, d, ng, score)) == 2
        assert cuda_decode._macros(want)["ROTKV_K4"] == 1 and cuda_decode._macros(want[:9])["ROTKV_K4"] == 0
    # the INT4-key build's min blocks per SM: where 4 would spill (nvcc -Xptxas -v)
    assert [P.min_blocks(P.DecodeConfig(), d, ng, 4) for d, ng in ((64, 1), (64, 2), (128, 1), (128, 2), (128, 4),
                                                                    (256, 4))] == [4, 4, 4, 3, 2, 2]
    with switches.override(cuda_key4=True):
        # INT4 values, INT8 keys, INT2 keys with INT4 values: still Triton (or none)
        for bits in ((4, 4), (2, 4), (8, 2)):
            assert "INT2 K and V" in P.cuda_decode_reason(_layout(bits=bits), 4, "int8")
        assert P.cuda_decode_reason(_layout(bits=(4, 2)), 4, "int8") is None
        # the values' refine ring (4-bit keys have none): read by the K4 build at head_dim 64 with one group
        k4 = P.cuda_variant(cfg, 64, 1, key_bits=4)
        assert P.cuda_reads_refine(k4, "auto") and P.with_refine(k4)[P.VARIANT_REFINE] == 1
        assert P.with_refine(k4)[P.VARIANT_K4] == 1 and P.with_refine(k4[:9]) == (*k4[:9], 1)
        assert not P.cuda_reads_refine(P.cuda_variant(cfg, 64, 2, key_bits=4), "auto")  # its build spills
        # at head_dim 128 the refine build takes fewer blocks per SM than the plain one, unless the config pins it
        assert [P.with_refine(P.cuda_variant(cfg, 128, ng, key_bits=kb), cfg)[3]
                for ng, kb in ((1, 2), (2, 2), (4, 2), (1, 4), (2, 4))] == [3, 3, 2, 3, 3]
        assert P.with_refine(k4, cfg)[3] == k4[3] == 4
        pinned = P.DecodeConfig(cuda_min_blocks=4)
        assert P.with_refine(P.cuda_variant(pinned, 128, 2), pinned)[3] == 4
        assert P.cuda_reads_refine(P.cuda_variant(cfg, 64, 2, key_bits=4), "kernel")
        p = P.DecodePlan(_layout(d=64, bits=(4, 2)), 6, 64, CUDA_DEV, cfg, (False, True))
        launch = p.launch(10**6)
        assert launch.kernel == "cuda" and launch.refine and P.variant_key_bits(launch.cuda_variant) == 4


def test_build_lists_name_the_int4_key_build():
    from rotkv import switches

    e4m3 = torch.float8_e4m3fn
    with switches.override(cuda_key4=False):
        variant, note = P.decode_builds_for(64, 64, value_meta=e4m3, refine=True, key_bits=4)
    assert variant is None and "cuda_key4=1" in note
    with switches.override(cuda_key4=True):
        variant, note = P.decode_builds_for(64, 64, value_meta=e4m3, refine=True, key_bits=4)
        assert note is None and variant == P.with_refine(P.cuda_variant(P.DecodeConfig(), 64, 1, "bf16", e4m3, 4))
        assert P.decode_builds_for(128, 64, key_bits=4) == (P.cuda_variant(P.DecodeConfig(), 128, 2, key_bits=4),
                                                             None)
        assert P.decode_builds_for(128, 64, bits=4)[1] == "decode: INT4 pages run the Triton kernel"
        assert P.decode_builds_for(128, 64, key_bits=8)[1] == "decode: INT8 keys with INT2 values run the Triton kernel"
