#!/usr/bin/env bash
# One device call: CUDA tests, SmolLM2 end to end at B=64 (after the prefill-mask change), the job benchmark.
export PYTHONPATH=/tmp/site:$PWD
python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_backend.py tests/test_paged_cache.py -k "not smollm2" 2>&1 | tail -4
python3 benchmarks/bench_generate.py --model $ROTKV_GGUF --batch 64 --context 4096 8192 --new-tokens 32 \
  --methods hf-dynamic rotkv:quarot-int2+graph rotkv:bf16+graph --out $OUT/generate-b64.json 2>&1 | grep "|"
python3 benchmarks/bench_job.py --requests 32 --context 100000 --new-tokens 256 --out $OUT/job.json 2>&1 | grep -v "fill:"
python3 -m rotkv.cli generate --model $ROTKV_GGUF --prompt "Name three primary colors." --cuda-graph --json --max-new-tokens 24 2>&1 | tail -1
