"""rotkv inside vLLM: an attention backend that stores the KV cache as rotkv's INT2 body pages in vLLM's
blocks, with the bf16 sink and window in a backend-owned side pool (``docs/vllm.md``).

``register`` is the ``vllm.general_plugins`` entry point (``pyproject.toml``): vLLM calls it in every process
it starts, and it points ``AttentionBackendEnum.CUSTOM`` at
:class:`~rotkv.integrations.vllm.backend.RotkvAttentionBackend`
and makes the layers on that backend report INT2 pages to vLLM's block accounting. Select it with
``--attention-backend CUSTOM`` (``LLM(..., attention_backend="CUSTOM")``); settings in ``additional_config``
(:mod:`rotkv.integrations.vllm.config`). Importing this package imports neither vLLM nor ``rotkv.hf``.
"""

BACKEND_PATH = "rotkv.integrations.vllm.backend.RotkvAttentionBackend"


def register() -> None:
    """Point vLLM's CUSTOM attention backend at rotkv's (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from rotkv.integrations.vllm import backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_PATH)
    backend.install_spec_hook()


__all__ = ["BACKEND_PATH", "register"]
