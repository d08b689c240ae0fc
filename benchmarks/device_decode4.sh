#!/bin/bash
# One device call (issue 12, decode second round, after device_decode3.sh): the tier on a second
# stream. CUDA decode tests, then bench_decode.py (default, the tier first, the kernel before this
# round, prefetch without pre-merge, 4096 target warps). Run from the tree's root; $OUT collects.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
nvidia-smi -L
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_backend.py \
  -k "(cuda_kernel_matches or fused or second_stream or layer_kernel_path or cuda_graph) and not quant_write" > $OUT/tests.log 2>&1
echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -25
timeout 200 python3 benchmarks/bench_decode.py --configs default cuda-tier-first cuda-t2-none cuda-pf-t1-none cuda-pf-t1-w4k \
  --out $OUT/decode.json > $OUT/decode.log 2>&1; echo "decode rc=$?"
grep -v '^{' $OUT/decode.log | grep -E "rotkv_int2|triton_bf16.*t64|sdpa" | tail -40
python3 - <<'PY'
import json, os, collections
rows = json.load(open(os.environ["OUT"] + "/decode.json"))
t = collections.defaultdict(dict)
for r in rows:
    if r["impl"] == "rotkv_int2_cfg":
        t[(r["batch"], r["context"])][r["config"]] = r["ms"]
names = sorted({k for v in t.values() for k in v})
print("B L " + " ".join(names))
for k, v in t.items():
    print(k, " ".join(f"{v.get(n, float('nan')):.4f}" for n in names))
PY
