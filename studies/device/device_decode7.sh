#!/bin/bash
# One device call (third decode session): the offset flush moved to the loop's back edge.
# Parallel builds, the CUDA decode tests, bench_decode.py at the Qwen3-8B shape against the bf16-value
# build and the unflushed fp16 one, and the error check. Run from the tree's root; $OUT collects.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 90 python3 scripts/prebuild_decode.py --configs cuda-bf16v cuda-vf16 --shapes 128/2; echo "prebuild rc=$?"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_backend.py \
  -k "(cuda_kernel or fused or refuses or layer_kernel_path or cuda_graph) and not quant_write" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -12
timeout 150 python3 benchmarks/bench_decode.py --configs default cuda-bf16v cuda-vf16 v2-n128-w4 \
  --out $OUT/decode.json > $OUT/decode.log 2>&1; echo "decode rc=$?"
python3 benchmarks/decode_table.py $OUT/decode.json
timeout 30 python3 studies/decode_error.py --batch 8 --context 32768 --configs default cuda-bf16v \
  --out $OUT/error.json > $OUT/error.log 2>&1; echo "error rc=$?"; tail -4 $OUT/error.log
