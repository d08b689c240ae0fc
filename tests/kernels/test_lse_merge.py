"""The prefill's log-sum-exp merge kernel (rotkv.kernels.lse_merge) against its PyTorch form
(``rotkv.cache.layer.merge_lse`` with the kernels off), on the strided views the attention kernels return, and
through ``merge_lse``'s plan; then the vLLM backend's prefill row, whose merges it runs, against the reference
prefill. On a CPU machine the kernel runs under the Triton interpreter."""

import pytest
import torch

pytest.importorskip("triton")

from rotkv.cache.layer import merge_lse  # noqa: E402
from rotkv.kernels.lse_merge import lse_merge  # noqa: E402
from rotkv.kernels.plan import lse_merge_reason  # noqa: E402


def _pieces(b, hq, c, d, dtype, device, seed=0):
    """Two outputs as the attention kernels give them: ``[B, Hq, C, D]`` views of ``[B, C, Hq, D]`` memory, and
    log-sum-exps that are slices of a wider float32 buffer (not contiguous), with shares from near 0 to near 1."""
    g = torch.Generator().manual_seed(seed)
    o1 = torch.randn(b, c, hq, d, generator=g).to(device, dtype).transpose(1, 2)
    o2 = torch.randn(b, c, hq, d, generator=g).to(device, dtype).transpose(1, 2)
    l1 = (6 * torch.randn(b, hq, c, 3, generator=g)).to(device)[..., 1:2]
    l2 = (6 * torch.randn(b, hq, c, 3, generator=g)).to(device)[..., :1]
    return o1, l1, o2, l2


def _reference(o1, l1, o2, l2, dtype):
    o = o1.float()
    o.sub_(o2).mul_(torch.sigmoid(l1 - l2)).add_(o2)
    return o.to(dtype), torch.logaddexp(l1, l2)


@pytest.mark.parametrize("b,hq,c,d", [(1, 3, 37, 64), (2, 4, 9, 128), (1, 2, 5, 80)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_kernel_equals_the_pytorch_merge(device, b, hq, c, d, out_dtype):
    dt = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    o1, l1, o2, l2 = _pieces(b, hq, c, d, dt, device)
    assert lse_merge_reason(o1, l1, o2, l2) is None
    got, lse = lse_merge(o1, l1, o2, l2, out_dtype, True)
    want, want_lse = _reference(o1, l1, o2, l2, out_dtype)
    assert got.dtype == out_dtype and got.shape == (b, hq, c, d)
    tol = dict(rtol=1e-5, atol=1e-6) if out_dtype == torch.float32 else dict(rtol=8e-3, atol=1e-5)  # one bf16 ulp
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-6)


def test_kernel_writes_into_a_given_layout_and_skips_the_lse_on_request(device):
    o1, l1, o2, l2 = _pieces(1, 4, 21, 64, torch.bfloat16, device, seed=3)
    out = torch.full((1, 21, 4, 64), float("nan"), dtype=torch.bfloat16, device=device).transpose(1, 2)
    got, lse = lse_merge(o1, l1, o2, l2, torch.bfloat16, False, out)
    assert got is out and lse is None and not out.isnan().any()
    torch.testing.assert_close(out, _reference(o1, l1, o2, l2, torch.bfloat16)[0], rtol=8e-3, atol=1e-5)


def test_merge_lse_runs_the_kernel_where_the_plan_says(device, kernels_on_cpu, setenv, monkeypatch):
    """With the kernels on, ``merge_lse`` takes the kernel (and its answer); off, the PyTorch form; both give the
    same figures, the merged log-sum-exp too."""
    import rotkv.kernels.lse_merge as km

    calls = []
    real = km.lse_merge
    monkeypatch.setattr(km, "lse_merge", lambda *a, **k: calls.append(1) or real(*a, **k))
    o1, l1, o2, l2 = _pieces(2, 3, 17, 64, torch.bfloat16, device, seed=5)
    outs = {}
    for use in ("0", "1"):
        setenv("ROTKV_KERNELS", use)
        outs[use] = merge_lse(o1, l1, o2, l2, torch.bfloat16, with_lse=True)
    assert len(calls) == 1  # the kernels-on call only
    torch.testing.assert_close(outs["1"][0], outs["0"][0], rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(outs["1"][1], outs["0"][1], rtol=1e-6, atol=1e-6)


def test_reasons():
    o = torch.zeros(1, 2, 3, 64)
    lse = torch.zeros(1, 2, 3, 1)
    assert lse_merge_reason(o, lse, o, lse) is None
    assert "contiguous" in lse_merge_reason(o.transpose(2, 3).contiguous().transpose(2, 3), lse, o, lse)
    assert "float32" in lse_merge_reason(o, lse.half(), o, lse)
    assert "one shape" in lse_merge_reason(o, lse, o[:, :1], lse)
