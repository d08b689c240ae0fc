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
