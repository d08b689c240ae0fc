#!/bin/bash
# One device call (decode): the time of the body kernel, the tier kernel and the merge
# apart and together (decode_breakdown.py), then Nsight Compute's stall reasons for the CUDA body
# kernel at B = 8, L = 128K. Run from the tree's root; $OUT collects.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
timeout 200 python3 studies/decode_breakdown.py --batch 1 8 --context 4096 32768 131072 \
  --out $OUT/breakdown.json > $OUT/breakdown.log 2>&1; echo "breakdown rc=$?"; grep -v '^{' $OUT/breakdown.log | tail -45
timeout 150 ncu --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy \
  --section InstructionStats --metrics smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_barrier,smsp__pcsamp_warps_issue_stalled_lg_throttle,smsp__pcsamp_warps_issue_stalled_tex_throttle,smsp__pcsamp_warps_issue_stalled_no_instructions \
  -k regex:int2_decode --launch-skip 2 --launch-count 1 python3 studies/ncu_decode_call.py 8 131072 > $OUT/ncu_decode.txt 2>&1
echo "ncu rc=$?"; grep -v "^==PROF==" $OUT/ncu_decode.txt | grep -E "Duration|Throughput|Issue|Eligible|Warp Cycles|Occupancy|Stall|stalled|Executed Ipc|Active Warps|Registers|ERR|One or More" | head -70
