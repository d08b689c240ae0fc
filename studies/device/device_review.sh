#!/bin/bash
# One device call (after the review refactor): the CUDA decode tests of the default and
# the unfused path, the fused merge, the cache layer and graph tests; then the job benchmark
# (32 requests x 100K tokens, Qwen3-8B shapes, random weights) through the cache with the new kernel.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 130 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_backend.py \
  -k "(cuda_kernel_matches and (2048-block-True or 2048-none-False)) or fused or layer_kernel_path or cuda_graph" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error " $OUT/tests.log | tail -12
timeout 200 python3 benchmarks/bench_job.py --requests 32 --context 100000 --new-tokens 64 --out $OUT/job.json > $OUT/job.log 2>&1
echo "job rc=$?"; grep -v "fill" $OUT/job.log | tail -8
