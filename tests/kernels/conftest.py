"""Kernel tests run compiled on a CUDA GPU and through the Triton interpreter on a CPU machine.

The interpreter is chosen when a kernel is decorated, so TRITON_INTERPRET has to be set before
any ``rotkv.kernels`` module is imported: this conftest is loaded first.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE
