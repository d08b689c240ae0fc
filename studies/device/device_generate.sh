#!/usr/bin/env bash
# The end-to-end generation benchmark on the GPU machine (see benchmarks/README.md):
# CUDA tests of the paged cache, then `rotkv bench` on SmolLM2 (a GGUF at $ROTKV_GGUF), started in
# the background (setsid nohup) because it outlasts one device call; results land in ~/bench-out.
set -e
export PYTHONPATH=/tmp/site:$PWD
mkdir -p ~/bench-out
[ "${SKIP_TESTS:-0}" = 1 ] || python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_backend.py tests/test_paged_cache.py 2>&1 | tail -15
setsid nohup bash -c "
python3 benchmarks/bench_generate.py --model $ROTKV_GGUF --batch 64 --context 8192 4096 --new-tokens 32 \
  --methods hf-dynamic hf-static-compile rotkv:bf16+graph rotkv:quarot-int2 rotkv:quarot-int2+graph \
  --out ~/bench-out/generate-b64.json > ~/bench-out/b64.log 2>&1
python3 benchmarks/bench_generate.py --model $ROTKV_GGUF --batch 1 16 --context 4096 --new-tokens 32 \
  --methods hf-dynamic rotkv:bf16 rotkv:quarot-int2 rotkv:quarot-int2+graph \
  --out ~/bench-out/generate-small.json > ~/bench-out/small.log 2>&1
" > /dev/null 2>&1 &
echo started
