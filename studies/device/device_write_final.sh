#!/bin/bash
# One device call: the committed CUDA write kernel's tests (and the cache paths that flush
# through it), then bench_write.py with both backends.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out} ROTKV_COMMIT=${ROTKV_COMMIT:-unknown}
mkdir -p $OUT
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_backend.py \
  -k "quant_write_cuda_kernel or (matches_reference_cuda and cuda-) or backend_choices or layer_kernel_path or cuda_graph or mixed_layer_bits" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error |assert" $OUT/tests.log | tail -12
timeout 90 python3 benchmarks/bench_write.py --bits 2 4 --block-t 32 --num-warps 4 --cuda-warps 4 8 \
  --cuda-precision bf16x2 bf16 --out $OUT/write.json > $OUT/write.log 2>&1; echo "write rc=$?"
grep -v '^{' $OUT/write.log | tail -34
