#!/bin/bash
# One device call (third decode session, final): fp16 value product with the offset flush
# every 8 steps as the default. Builds in parallel, the CUDA decode tests (kernel grid, fused merge,
# cache layer and CUDA-graph paths), bench_decode.py at the Qwen3-8B shape against the previous
# default (cuda-bf16v), the error check, and Nsight Compute at B = 32, 128K. Run from the tree's root.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 120 python3 scripts/prebuild_decode.py --configs cuda-bf16v cuda-vf16-f4 --shapes 128/2; echo "prebuild rc=$?"
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_backend.py \
  -k "(cuda_kernel or fused or refuses or layer_kernel_path or cuda_graph) and not quant_write" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -12
timeout 150 python3 benchmarks/bench_decode.py --configs default cuda-bf16v cuda-vf16-f4 v2-n128-w4 \
  --out $OUT/decode.json > $OUT/decode.log 2>&1; echo "decode rc=$?"
python3 benchmarks/decode_table.py $OUT/decode.json
timeout 30 python3 studies/decode_error.py --batch 8 --context 32768 --configs default cuda-bf16v \
  --out $OUT/error.json > $OUT/error.log 2>&1; echo "error rc=$?"; tail -4 $OUT/error.log
timeout 60 ncu --metrics sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_mio_throttle \
  -k regex:int2_decode --launch-skip 2 --launch-count 1 python3 studies/ncu_decode_call.py 32 131072 > $OUT/ncu.txt 2>&1
echo "ncu rc=$?"; grep -E "^\s+(sm__|smsp__|gpu__|dram__)" $OUT/ncu.txt | awk '{print $1, $(NF-1), $NF}'
