"""GPU = CPU on the real model: for every preset that has a kernel path, the next-token distributions of the
GPU kernel path against the PyTorch path, per teacher-forced token, with the same artifact and tokens.

Three runs of each preset over the same windows (rotkv eval's nll protocol: a context prefilled in chunks
through the cache, then one teacher-forced token per call reading it):
- ``cpu``: the model (float32) and the cache on the CPU, the PyTorch path (the CPU eval's numbers);
- ``gpu-torch``: on the GPU with ``ROTKV_KERNELS=0`` and ``ROTKV_REFINE_KERNEL=0``, the same PyTorch path;
- ``gpu-kernel``: on the GPU with the kernels (write, decode, refine tier), as generate/bench/eval run there.

The bound, per preset: the mean over scored tokens of KL(path A || path B) is at most a tenth of the preset's
own error, the mean KL(plain model || cpu path); and no token's KL(cpu || gpu-kernel) exceeds 0.05 nats. So
a kernel may differ from the reference by rounding (bf16 scores, fp16 metadata) but not by a share of
the error that the presets are compared on. The CUDA-graph decode is compared with the eager kernel path in
test_refine_kernel.py and test_backend.py; progressive presets (pmkvq, oscar-pmkvq) keep per-row layers,
which run no kernel. The artifacts are calibrated here, small (a few thousand tokens): the comparison does
not need good rotations, only the same ones on both paths.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONTEXT, NEW, CHUNK, WINDOWS = 2048, 64, 512, 2
MEAN_SHARE = 0.1  # mean KL between two paths <= this share of the preset's own mean KL
TOKEN_CAP = 0.05  # no token's KL(cpu || gpu-kernel) above this (nats)
PRESETS = ["int4", "naive-int2", "quarot-int2", "kivi-2", "oscar-int2", "optr-int2", "oscar-mix", "oscar-mix-long",
           "oscar-refine"]


def windows(tokenizer) -> torch.Tensor:
    """``WINDOWS`` rows of ``CONTEXT + NEW`` tokens from the suite's dev texts (prose and code)."""
    from rotkv.eval.suite import suite_texts

    texts = suite_texts("mixed", "dev")
    rows = []
    for d in ("prose", "code")[:WINDOWS]:
        ids = tokenizer(open(texts[d], encoding="utf-8").read(), add_special_tokens=False).input_ids
        rows.append(torch.tensor(ids[: CONTEXT + NEW]))
    return torch.stack(rows)


def path_logps(loaded, preset: str, artifact: str | None, ids: torch.Tensor) -> torch.Tensor:
    """Log-probs ``[W, NEW, V]`` (float32, CPU) of each window's NEW tokens through a fresh cache of ``preset``."""
    from rotkv.cache import RotkvCache
    from rotkv.eval.protocol import forward, prefill

    out = []
    for row in ids:
        row = row[None].to(loaded.model.device)
        cache = RotkvCache(loaded.model, preset, artifact, check_finite=False, context_length=CONTEXT + NEW)
        lps = [prefill(loaded.model, cache, row[:, :CONTEXT], CHUNK)]
        for t in range(NEW - 1):
            lps.append(forward(loaded.model, row[:, CONTEXT + t: CONTEXT + t + 1], cache)[-1])
        out.append(torch.stack(lps).float().cpu())
    return torch.stack(out)


def plain_logps(loaded, ids: torch.Tensor) -> torch.Tensor:
    from rotkv.eval.protocol import forward

    return torch.stack([forward(loaded.model, row[None, : CONTEXT + NEW - 1].to(loaded.model.device), None,
                                keep=NEW).float().cpu() for row in ids])


def kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-token KL(p || q) of log-prob tensors ``[..., V]``."""
    return (p.exp() * (p - q)).sum(-1).clamp_min(0)


@pytest.fixture(scope="module")
def models():
    from rotkv.hf.models import load_model

    return {"cpu": load_model(device="cpu", dtype=torch.float32), "cuda": load_model(device="cuda", dtype=torch.float32)}


@pytest.fixture(scope="module")
def artifact_dir(models, tmp_path_factory):
    """Small real artifacts for every calibrated preset, fitted on the GPU model with the default corpus."""
    from rotkv.calibrate.keybits import calibrate_mix
    from rotkv.calibrate.longfit import calibrate_mix_long
    from rotkv.calibrate.run import CalibConfig, calibrate
    from rotkv.rotations.artifact import save_artifact

    d = tmp_path_factory.mktemp("artifacts")
    gpu = models["cuda"]
    for method, cfg in (("oscar", CalibConfig(method="oscar", tokens=4096, progress=False)),
                        ("optr", CalibConfig(method="optr", tokens=2048, steps=20, progress=False))):
        save_artifact(str(d / f"{method}.safetensors"), *calibrate(gpu, cfg))
    save_artifact(str(d / "oscar-mix.safetensors"),
                  *calibrate_mix(gpu, str(d / "oscar.safetensors"), length=512, new=16, windows=1, progress=False,
                                 log=lambda m: None))
    save_artifact(str(d / "oscar-mix-long.safetensors"),
                  *calibrate_mix_long(gpu, str(d / "oscar-mix.safetensors"), seq_len=1024, sequences=1,
                                      log=lambda m: None))
    return str(d)


@pytest.fixture(scope="module")
def reference(models):
    ids = windows(models["cpu"].tokenizer)
    return ids, plain_logps(models["cpu"], ids)


@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_kernel_path_gives_the_cpu_pytorch_paths_distributions(preset, models, artifact_dir, reference,
                                                                    monkeypatch):
    from rotkv.config import PRESETS as ALL, artifact_file

    ids, plain = reference
    art = os.path.join(artifact_dir, artifact_file(preset)) if ALL[preset].needs_artifact else None
    cpu = path_logps(models["cpu"], preset, art, ids)
    monkeypatch.setenv("ROTKV_KERNELS", "0")
    monkeypatch.setenv("ROTKV_REFINE_KERNEL", "0")
    gpu_torch = path_logps(models["cuda"], preset, art, ids)
    monkeypatch.setenv("ROTKV_KERNELS", "1")
    monkeypatch.setenv("ROTKV_REFINE_KERNEL", "1")
    gpu_kernel = path_logps(models["cuda"], preset, art, ids)
    own = kl(plain, cpu).mean().item()  # the preset's own error on these tokens
    d_torch = kl(cpu, gpu_torch)
    d_kernel = kl(cpu, gpu_kernel)
    d_paths = kl(gpu_torch, gpu_kernel)
    worst = divmod(int(d_kernel.argmax()), NEW)
    msg = (f"{preset}: own KL {own:.4g}; mean KL cpu||gpu-torch {d_torch.mean():.3g}, cpu||gpu-kernel "
           f"{d_kernel.mean():.3g}, gpu-torch||gpu-kernel {d_paths.mean():.3g}; worst token (window, step) {worst} "
           f"at {d_kernel.max():.3g}")
    print(msg)
    assert own > 1e-4, msg  # the preset quantizes something: the bound below is not vacuous
    assert d_torch.mean() <= MEAN_SHARE * own, msg
    assert d_kernel.mean() <= MEAN_SHARE * own, msg
    assert d_paths.mean() <= MEAN_SHARE * own, msg
    assert d_kernel.max() <= TOKEN_CAP, msg
