#!/bin/bash
# One device call (third decode session): the CUDA kernel grid with the fp16 value product
# (cuda_value_f16) beside the bf16 one, its error against the float32 reference, and bench_decode.py
# at the Qwen3-8B shape with both. Run from the tree's root; $OUT collects.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
nvidia-smi -L
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py \
  -k "cuda_kernel or fused" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -25
timeout 60 python3 studies/decode_error.py --batch 8 --context 32768 --configs cuda-bf16v cuda-vf16 \
  --out $OUT/error.json > $OUT/error.log 2>&1; echo "error rc=$?"; cat $OUT/error.log | tail -8
timeout 40 python3 studies/decode_error.py --batch 8 --context 8192 --q-heads 9 --kv-heads 3 --head-dim 64 \
  --configs cuda-bf16v cuda-vf16 --out $OUT/error-d64.json > $OUT/error-d64.log 2>&1; echo "error d64 rc=$?"; tail -4 $OUT/error-d64.log
timeout 200 python3 benchmarks/bench_decode.py --configs default cuda-bf16v cuda-vf16 v2-n128-w4 \
  --out $OUT/decode.json > $OUT/decode.log 2>&1; echo "decode rc=$?"
python3 benchmarks/decode_table.py $OUT/decode.json
