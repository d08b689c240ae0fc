"""Import check of a carried vLLM (scripts/vllm_device_install.sh runs it on the GPU machine).

Imports every module that offline ``LLM(...).generate``, ``vllm serve`` and the benchmark's backends load,
each on its own, and prints every failure, so that one device call lists all the missing packages at
once (a ModuleNotFoundError names the module to carry: add its wheel to scripts/vllm_wheels.lock). Also
prints the versions of the packages vLLM pins that the image provides, whether FlashAttention 2/3 load,
and the ``vllm.general_plugins`` entry points. Exit status 1 when ``vllm`` or ``vllm.LLM`` fails.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import sys
import traceback

MODULES = [
    "vllm",
    "vllm.entrypoints.llm",
    "vllm.entrypoints.openai.api_server",
    "vllm.entrypoints.cli.main",
    "vllm.entrypoints.cli.serve",
    "vllm.v1.engine.core",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.async_llm",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.sample.sampler",
    "vllm.v1.structured_output",
    "vllm.model_executor.models.qwen3",
    "vllm.model_executor.models.llama",
    "vllm.model_executor.model_loader.dummy_loader",
    "vllm.model_executor.model_loader.default_loader",
    "vllm.v1.attention.backends.registry",
    "vllm.v1.attention.backends.flash_attn",
    "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.flashinfer",
    "vllm.v1.attention.backends.turboquant_attn",
    "vllm.vllm_flash_attn.flash_attn_interface",
    "vllm.compilation.backends",
    "vllm.tokenizers.hf",
    "vllm.entrypoints.openai.chat_completion.serving",
    "vllm.entrypoints.openai.completion.serving",
    "vllm._C_stable_libtorch",
    "flashinfer",
    "gguf",
]
VERSIONS = ["torch", "triton", "transformers", "tokenizers", "numpy", "numba", "protobuf", "setuptools",
            "vllm", "flashinfer-python", "pydantic", "fastapi"]


def main() -> int:
    failed: dict[str, str] = {}
    missing: set[str] = set()
    for name in MODULES:
        try:
            importlib.import_module(name)
            print(f"ok    {name}", flush=True)
        except BaseException as e:  # an extension can raise OSError, a config RuntimeError
            failed[name] = f"{type(e).__name__}: {e}"
            if isinstance(e, ModuleNotFoundError) and e.name:
                missing.add(e.name.split(".")[0])
            print(f"FAIL  {name}: {failed[name]}", flush=True)
            if "-v" in sys.argv:
                traceback.print_exc()
    try:
        from vllm import LLM  # noqa: F401
    except BaseException as e:
        failed["vllm.LLM"] = f"{type(e).__name__}: {e}"
    for pkg in VERSIONS:
        try:
            print(f"version {pkg} {md.version(pkg)}")
        except md.PackageNotFoundError:
            print(f"version {pkg} (not installed)")
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa
        print(f"flash_attn FA2 {fa.FA2_AVAILABLE} FA3 {fa.FA3_AVAILABLE}"
              f" ({fa.FA2_UNAVAILABLE_REASON or ''} {fa.FA3_UNAVAILABLE_REASON or ''})")
    except BaseException as e:
        print(f"flash_attn interface: {type(e).__name__}: {e}")
    eps = md.entry_points(group="vllm.general_plugins")
    print("vllm.general_plugins:", [f"{e.name} = {e.value}" for e in eps] or "none")
    print(f"import check: {len(MODULES) - len(failed)} of {len(MODULES)} modules import;"
          f" missing top-level modules: {sorted(missing) or 'none'}")
    return 1 if ("vllm" in failed or "vllm.LLM" in failed) else 0


if __name__ == "__main__":
    sys.exit(main())
