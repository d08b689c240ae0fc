#!/bin/bash
# One device call (decode second round, after device_decode2.sh): CUDA decode tests of the
# changed paths, bench_decode.py at the Qwen3-8B shape (all configs) and at the SmolLM2 shape
# (9/3 heads, D 64), then decode_breakdown.py. Run from the tree's root; $OUT collects.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
nvidia-smi -L
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_backend.py \
  -k "(cuda_kernel or fused or refuses or layer_kernel_path or cuda_graph) and not quant_write" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -25
timeout 150 python3 benchmarks/bench_decode.py --out $OUT/decode.json > $OUT/decode.log 2>&1; echo "decode rc=$?"
grep -v '^{' $OUT/decode.log | grep -E "rotkv_int2|triton_bf16.*t64|sdpa" | tail -40
timeout 60 python3 benchmarks/bench_decode.py --batch 1 8 --context 4096 8192 --q-heads 9 --kv-heads 3 --head-dim 64 \
  --configs default cuda-t2-none cuda-pf-t1-none v2-n128-w4 --out $OUT/decode-d64.json > $OUT/decode-d64.log 2>&1
echo "d64 rc=$?"; grep -v '^{' $OUT/decode-d64.log | grep -E "rotkv_int2|triton_bf16|sdpa" | tail -20
python3 benchmarks/decode_table.py $OUT/decode.json $OUT/decode-d64.json
timeout 80 python3 studies/decode_breakdown.py --batch 1 8 --context 4096 131072 --out $OUT/breakdown.json \
  > $OUT/breakdown.log 2>&1; echo "breakdown rc=$?"; grep -v '^{' $OUT/breakdown.log | tail -22
