#!/bin/bash
# One device call: CUDA kernel tests for INT4/mixed widths, the score option and the
# write variants, then bench_mixed.py and bench_write.py. Run from the tree's root; $OUT collects.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 230 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_backend.py \
  -k "mixed or int4 or write or layer_kernel_path or cuda_graph or (cuda_kernel_matches and 2-None-4096) or refuses or int64" \
  > $OUT/tests.log 2>&1; echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -25
timeout 170 python3 studies/bench_mixed.py --out $OUT/mixed.json > $OUT/mixed.log 2>&1; echo "mixed rc=$?"
timeout 150 python3 benchmarks/bench_write.py --bits 2 --block-t 32 64 128 --num-warps 4 8 \
  --rot-precision tf32x3 tf32 --out $OUT/write.json > $OUT/write.log 2>&1; echo "write rc=$?"
timeout 40 python3 benchmarks/bench_write.py --bits 4 --block-t 64 --num-warps 4 \
  --out $OUT/write4.json > $OUT/write4.log 2>&1; echo "write4 rc=$?"
grep -v '^{' $OUT/mixed.log | tail -60; grep -v '^{' $OUT/write.log | tail -70; grep -v '^{' $OUT/write4.log | tail -8
