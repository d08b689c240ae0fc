#!/bin/bash
# One device call (issue 12, third decode session): Nsight Compute on the CUDA body kernel, bf16 and
# fp16 value products ($NCU_A, $NCU_B: bench_decode config names), at B = 8 and 32 with 128K tokens (executed instructions, issue activity,
# stall samples, DRAM), then bench_decode.py at the SmolLM2 (D 64) and Gemma3 (D 256) attention
# shapes with both. Run from the tree's root; $OUT collects.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
cat > /tmp/ncu_decode4.py <<'PY'
import os, sys
import torch
from benchmarks.bench_decode import make_int2, make_bf16_pages
from benchmarks.bench_decode import CONFIGS
from rotkv.kernels.decode import decode_attention
b, L, cfg = int(sys.argv[1]), int(sys.argv[2]), CONFIGS[sys.argv[3]]
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(b, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
body, table = make_int2(b, 8, L - 320, 128, 64, 16, "cuda", g)
tier, ttab = make_bf16_pages(b, 8, 320, 128, 16, "cuda", g)
for _ in range(4):
    decode_attention(q, body, table, L - 320, tier, ttab, 320, cfg=cfg)
torch.cuda.synchronize()
PY
M=sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__warps_active.avg.per_cycle_active,smsp__warps_eligible.avg.per_cycle_active,smsp__pcsamp_warps_issue_stalled_long_scoreboard,smsp__pcsamp_warps_issue_stalled_wait,smsp__pcsamp_warps_issue_stalled_math_pipe_throttle,smsp__pcsamp_warps_issue_stalled_short_scoreboard,smsp__pcsamp_warps_issue_stalled_not_selected,smsp__pcsamp_warps_issue_stalled_selected,smsp__pcsamp_warps_issue_stalled_dispatch_stall,smsp__pcsamp_warps_issue_stalled_no_instructions,smsp__pcsamp_warps_issue_stalled_mio_throttle,smsp__pcsamp_warps_issue_stalled_lg_throttle
for cfg in "8 131072 ${NCU_A:-cuda-bf16v}" "8 131072 ${NCU_B:-cuda-vf16-f8}" "32 131072 ${NCU_B:-cuda-vf16-f8}"; do
  set -- $cfg
  timeout 100 ncu --metrics $M -k regex:int2_decode --launch-skip 2 --launch-count 1 \
    python3 /tmp/ncu_decode4.py $1 $2 $3 > $OUT/ncu-b$1-$3.txt 2>&1
  echo "== ncu B=$1 L=$2 $3 rc=$?"; grep -E "^\s+(sm__|smsp__|gpu__|dram__)" $OUT/ncu-b$1-$3.txt | awk '{print $1, $NF}'
done
timeout 90 python3 benchmarks/bench_decode.py --batch 1 8 32 --context 8192 --q-heads 9 --kv-heads 3 --head-dim 64 \
  --configs default cuda-bf16v ${NCU_B:-cuda-vf16-f8} --out $OUT/decode-d64.json > $OUT/decode-d64.log 2>&1; echo "d64 rc=$?"
timeout 90 python3 benchmarks/bench_decode.py --batch 1 8 32 --context 32768 --q-heads 4 --kv-heads 1 --head-dim 256 \
  --configs default cuda-bf16v ${NCU_B:-cuda-vf16-f8} --out $OUT/decode-d256.json > $OUT/decode-d256.log 2>&1; echo "d256 rc=$?"
python3 - <<'PY'
import json, os, collections
for f in ("decode-d64.json", "decode-d256.json"):
    rows = json.load(open(os.environ["OUT"] + "/" + f))
    t = collections.defaultdict(dict)
    for r in rows:
        if r["impl"] == "rotkv_int2_cfg":
            t[(r["batch"], r["context"])][r["config"]] = r["ms"]
        if r["impl"] in ("sdpa_bf16", "triton_bf16"):
            k = (r["batch"], r["context"]); t[k]["bf16"] = min(t[k].get("bf16", 1e9), r["ms"])
    names = sorted({k for v in t.values() for k in v})
    print(f, "B L " + " ".join(names))
    for k, v in t.items():
        print(k, " ".join(f"{v.get(n, float('nan')):.4f}" for n in names))
PY
