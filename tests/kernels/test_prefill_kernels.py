"""The prefill's kernel path (the Triton dequantizer into the front of the K/V buffer, the write
kernel over pages assembled from the stored tier and the call) against the PyTorch reference path,
through HybridLayer on chunked, left-padded prefills. On a CPU machine the kernels run under the
Triton interpreter (the ``kernels_on_cpu`` fixture)."""


import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from rotkv.cache.codecs import make_codecs  # noqa: E402
from rotkv.cache.layer import HybridLayer  # noqa: E402
from rotkv.config import CacheSpec  # noqa: E402
from rotkv.rotations.registry import build_rotations  # noqa: E402


@pytest.mark.parametrize("padded", [False, True])
def test_prefill_kernel_path_matches_reference(padded, device, kernels_on_cpu, setenv):
    h, b, d, g, rep = 2, 2, 64, 32, 2
    spec = CacheSpec(bits=2, group_size=g, sink=8, window=16, page_size=16, prefill_chunk=48, rotation="hadamard")
    rot = build_rotations("hadamard", 1, h, d)[0]
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(1)
    n = 130
    ks, vs = torch.randn(b, h, n, d, generator=gen), torch.randn(b, h, n, d, generator=gen)
    qs = torch.randn(b, h * rep, n, d, generator=gen)
    real = None
    if padded:
        real = torch.ones(b, n, dtype=torch.bool)
        real[1, :21] = False
    outs, layers = [], []
    for use in ("0", "1"):
        setenv("ROTKV_KERNELS", use)
        layer = HybridLayer(spec, rot, d, h, 0, make_codecs("token", 2, g, 1.0, 1.0), dt)
        o = []
        for c0 in range(0, n, 48):  # calls of one chunk: the later ones dequantize the body
            sl = slice(c0, min(c0 + 48, n))
            layer.update(ks[:, :, sl].to(device, dt), vs[:, :, sl].to(device, dt))
            o.append(layer.attend(qs[:, :, sl].to(device, dt), real[:, sl].to(device) if real is not None else None,
                                  d ** -0.5).float().cpu())
        outs.append(torch.cat(o, 1))
        layers.append(layer)
    assert layers[1].pools.dequant_kernel and not layers[0].pools.dequant_kernel
    ref, got = outs
    if padded:
        ref, got = ref[real], got[real]
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < (2e-2 if device == "cuda" else 1e-4), err
    st = layers[0].state
    assert np.array_equal(st.body_count, layers[1].state.body_count) and st.body_count.min() >= 5
    (rk, rv), (gk, gv) = layers[0].pools.body, layers[1].pools.body
    for row in range(b):
        pages = torch.as_tensor(st.body_pages[row, :st.body_count[row]], device=device)
        assert (rk["codes"][pages] != gk["codes"][pages]).float().mean().item() < 1e-3
        assert torch.equal(rv["scale"][pages], gv["scale"][pages]) or device == "cuda"


@pytest.mark.parametrize("bits", [2, 4])
def test_channel_dequant_kernel_matches_the_codec(bits, device):
    """KIVI's per-channel keys (``ChannelPart``): the dequant kernel gives the codec's decoding exactly, page by
    page in each request's order, a short last page cut, and leaves the buffer past a request's tokens alone."""
    from rotkv.cache.codecs import ChannelCodec
    from rotkv.kernels.body import ChannelPart
    from rotkv.kernels.dequant import dequant_dense

    pages, h, p, d = 6, 2, 32, 64
    codec = ChannelCodec(bits)
    parts = codec.encode(3 * torch.randn(pages, h, p, d, generator=torch.Generator().manual_seed(0)))
    ref = codec.decode(parts).to(device)
    part = ChannelPart(*(parts[n].to(device) for n in ("codes", "scale", "lo")), bits, d)
    order = [[3, 0, 5], [1, 4]]
    i32 = dict(dtype=torch.int32, device=device)
    table = (torch.tensor([0, 3, 5], **i32), torch.tensor(order[0] + order[1], **i32), torch.tensor([p, 20], **i32))
    out = torch.full((2, h, 3 * p + 5, d), float("nan"), device=device)
    dequant_dense(part, *table, 3 * p, out)
    for b, (idx, n) in enumerate(zip(order, (3 * p, p + 20))):
        want = ref[idx].permute(1, 0, 2, 3).reshape(h, -1, d)[:, :n]
        assert torch.equal(out[b, :, :n], want)
        assert torch.isnan(out[b, :, n:]).all()
    with pytest.raises(ValueError, match="contiguous"):
        dequant_dense(ChannelPart(part.codes.transpose(0, 1).contiguous().transpose(0, 1), part.scale, part.lo,
                                  bits, d), *table, 3 * p, out)


def test_kivi_layer_reads_its_body_with_the_dequant_kernel(device, kernels_on_cpu, setenv):
    """kivi-2 (per-channel keys, per-token values): chunked prefill then decode steps, with the kernels (the
    dequant kernel reads both parts, the write kernel stores the values) and without; the same outputs, and
    the same stored bytes."""
    from rotkv.config import PRESETS

    h, b, d, rep = 2, 2, 64, 2
    spec = PRESETS["kivi-2"].replace(window=32, prefill_chunk=48)
    rot = build_rotations("identity", 1, h, d)[0]
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator().manual_seed(2)
    n, steps = 150, 20
    ks, vs = torch.randn(b, h, n + steps, d, generator=gen), torch.randn(b, h, n + steps, d, generator=gen)
    qs = torch.randn(b, h * rep, n + steps, d, generator=gen)
    outs, layers = [], []
    for use in ("0", "1"):
        setenv("ROTKV_KERNELS", use)
        layer = HybridLayer(spec, rot, d, h, 0, make_codecs("kivi", 2, spec.group_size, 1.0, 1.0), dt)
        o = []
        calls = [slice(c0, min(c0 + 48, n)) for c0 in range(0, n, 48)] + [slice(t, t + 1) for t in range(n, n + steps)]
        for sl in calls:
            layer.update(ks[:, :, sl].to(device, dt), vs[:, :, sl].to(device, dt))
            o.append(layer.attend(qs[:, :, sl].to(device, dt), None, d ** -0.5).float().cpu())
        outs.append(torch.cat(o, 1))
        layers.append(layer)
    assert layers[1].pools.dequant_kernel and layers[1].pools.part_kernels == (False, True)
    assert not layers[0].pools.dequant_kernel
    assert layers[0].state.body_count.min() >= 3  # pages reached the body, during prefill and decode
    ref, got = outs
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < (2e-2 if device == "cuda" else 1e-5), err
    (rk, _), (gk, _) = layers[0].pools.body, layers[1].pools.body
    assert torch.equal(rk["codes"], gk["codes"]) and torch.equal(rk["scale"], gk["scale"])


def test_channel_part_is_checked_and_only_keys_take_it():
    from rotkv.kernels.body import ChannelPart, PagedBody, TokenPart

    codes = torch.zeros(3, 2, 64, 8, dtype=torch.uint8)  # 32-token pages at 2 bits
    meta = torch.zeros(3, 2, 64, 1, dtype=torch.float16)
    part = ChannelPart(codes, meta, meta, 2, 64)
    assert part.page_size == part.group_size == 32
    with pytest.raises(ValueError, match="one group per channel"):
        ChannelPart(codes, meta[..., :0], meta, 2, 64)
    with pytest.raises(ValueError, match="head_dim=128"):
        ChannelPart(codes, meta, meta, 2, 128)
    with pytest.raises(ValueError, match="one float dtype"):
        ChannelPart(codes, meta, meta.float(), 2, 64)
    values = TokenPart.zeros(3, 2, 32, 64, 2, 32)
    body = PagedBody(part, values)
    assert (body.page_size, body.layout.formats) == (32, ("channel", "token"))
    with pytest.raises(TypeError, match="`v` must be a body part"):
        PagedBody(values, part)
    with pytest.raises(ValueError, match="page size"):
        PagedBody(part, TokenPart.zeros(3, 2, 16, 64, 2, 32))
