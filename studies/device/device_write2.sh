#!/bin/bash
# One device call: the CUDA write kernel's tests, its variants timed, an Nsight Compute
# look at three of its launches, then where the job benchmark's decode step spends its time.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py -k "write or clip" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error |assert" $OUT/tests.log | tail -12
timeout 120 python3 benchmarks/bench_write.py --bits 2 --backend cuda --cuda-warps 4 8 16 --cuda-precision bf16x2 bf16 \
  --out $OUT/write.json > $OUT/write.log 2>&1; echo "write rc=$?"; grep -v '^{' $OUT/write.log | tail -24
cat > /tmp/ncu_write.py <<'PY'
import torch
from rotkv.kernels.write import quant_write
from rotkv.rotations.identity import random_orthogonal
t, h, d, p = 32768, 8, 128, 16
x = torch.randn(t, h, d, device="cuda").to(torch.bfloat16)
rot = torch.stack([random_orthogonal(d, i) for i in range(h)]).cuda()
pool = (torch.empty(t // p, h, p, d // 4, dtype=torch.uint8, device="cuda"),
        torch.empty(t // p, h, p, 2, dtype=torch.float16, device="cuda"), torch.empty(t // p, h, p, 2, dtype=torch.float16, device="cuda"))
sl = torch.arange(t, device="cuda")
for _ in range(2):
    quant_write(x, sl, *pool, clip=0.92, backend="cuda")
    quant_write(x, sl, *pool, clip=1.0, backend="cuda")
    quant_write(x, sl, *pool, rot=rot, clip=0.96, backend="cuda", rot_precision="bf16", num_warps=8)
torch.cuda.synchronize()
PY
timeout 120 ncu --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy \
  -k regex:"write_(plain|rot)" --launch-skip 3 --launch-count 3 python3 /tmp/ncu_write.py > $OUT/ncu_write.txt 2>&1
echo "ncu rc=$?"; grep -E "write_|Duration|Memory Throughput|Compute \(SM\)|Issue Slots Busy|No Eligible|Active Warps Per|Warp Cycles Per Issued|Achieved Occupancy|Theoretical Occ|ERR|Stall" $OUT/ncu_write.txt | head -60
timeout 200 python3 studies/profile_job_step.py --requests 32 --context 100000 --out $OUT/jobprof.json > $OUT/jobprof.log 2>&1
echo "jobprof rc=$?"; grep -v "^fill" $OUT/jobprof.log | tail -40
