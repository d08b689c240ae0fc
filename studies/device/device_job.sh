#!/bin/bash
# One device call: the CUDA write kernel's tests as committed and its timing, then where
# the job benchmark's decode step spends its time and the job benchmark itself (steady steps apart
# from the first step of each wave, which captures the CUDA graph).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_backend.py \
  -k "quant_write_cuda_kernel or (matches_reference_cuda and cuda-) or backend_choices or layer_kernel_path or cuda_graph" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error |assert" $OUT/tests.log | tail -12
timeout 80 python3 benchmarks/bench_write.py --bits 2 --block-t 32 --num-warps 4 --cuda-warps 4 8 \
  --cuda-precision bf16x2 bf16 --out $OUT/write.json > $OUT/write.log 2>&1; echo "write rc=$?"
grep -v '^{' $OUT/write.log | tail -16
timeout 150 python3 studies/profile_job_step.py --requests 32 --context 100000 --out $OUT/jobprof.json > $OUT/jobprof.log 2>&1
echo "jobprof rc=$?"; grep -v "^fill\|Warn\|warn" $OUT/jobprof.log | tail -24
timeout 200 python3 benchmarks/bench_job.py --requests 32 --context 100000 --new-tokens 64 --out $OUT/job.json > $OUT/job.log 2>&1
echo "job rc=$?"; grep -v "fill" $OUT/job.log | tail -6
