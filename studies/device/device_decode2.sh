#!/bin/bash
# One device call (decode second round): the CUDA decode tests (fused merge, prefetch
# variants, graph replays), then bench_decode.py (all configs) and decode_breakdown.py.
# Run from the tree's root; $OUT collects.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_backend.py \
  -k "cuda_kernel or fused or refuses or int64 or layer_kernel_path or cuda_graph" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -25
timeout 260 python3 benchmarks/bench_decode.py --out $OUT/decode.json > $OUT/decode.log 2>&1; echo "decode rc=$?"
grep -v '^{' $OUT/decode.log | tail -40
python3 benchmarks/decode_table.py $OUT/decode.json
timeout 100 python3 studies/decode_breakdown.py --batch 1 8 --context 4096 131072 --out $OUT/breakdown.json \
  > $OUT/breakdown.log 2>&1; echo "breakdown rc=$?"; grep -v '^{' $OUT/breakdown.log | tail -20
