#!/bin/bash
# One device call (write kernel round 3): the CUDA write kernel's tests and the cache paths
# that flush through it, then its variants timed beside the Triton kernel.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_backend.py \
  -k "quant_write_cuda_kernel or (matches_reference_cuda and cuda-) or backend_choices or layer_kernel_path or cuda_graph" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error |assert" $OUT/tests.log | tail -12
timeout 150 python3 benchmarks/bench_write.py --bits 2 --block-t 32 --num-warps 4 --cuda-warps 4 8 16 \
  --cuda-precision bf16x2 bf16 --out $OUT/write.json > $OUT/write.log 2>&1; echo "write rc=$?"
grep -v '^{' $OUT/write.log | tail -26
