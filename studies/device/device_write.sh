#!/bin/bash
# One device call (write kernel): the write tests on CUDA (the CUDA kernel against the CPU
# quantizer, the Triton kernel beside it, the cache paths that flush through it), then bench_write.py
# with both backends and the CUDA build switches in one process. Run from the tree's root; $OUT collects.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; which ncu nsys
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_backend.py \
  -k "write or clip or layer_kernel_path or cuda_graph or mixed_layer_bits" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error|assert" $OUT/tests.log | tail -30
timeout 200 python3 benchmarks/bench_write.py --bits 2 --block-t 32 --num-warps 4 --cuda-warps 4 8 \
  --cuda-switches REDUX=1,FASTDIV=0 REDUX=1,FASTDIV=1 REDUX=0,FASTDIV=1 \
  --out $OUT/write.json > $OUT/write.log 2>&1; echo "write rc=$?"
grep -v '^{' $OUT/write.log | tail -60
