#!/usr/bin/env bash
# The prefill work on the H200, in parts of under 10 minutes each (one device call per part):
#   PART=1 (default, ~5 min): GPU tests of the prefill changes, then peak memory / prefill time at
#          (a) Qwen3-8B shape 8 layers 4 x 32K and (c) SmolLM2 shape 64 x 8K, and the prefill-chunk
#          sweep (1K/2K/4K/8K) at (a);
#   PART=2 (~8 min): (b) all 36 layers 8 x 32K, then capacity at 32K (36 layers, tries capped);
#   PART=3 (~4 min): the job benchmark with real prefill (36 layers, 32 x 32K, 256 new tokens).
# Methods: rotkv:quarot-int2+graph, rotkv:bf16+graph, hf-static-compile (no oscar-mix: it needs a
# calibration artifact of the model, and none exists for random weights). Everything lands in $OUT
# (JSON, logs, summary.md); copy the JSONs to benchmarks/results/ to commit them.
# CPU check of the driver: python3 studies/device_prefill.py --device cpu --tiny --limit 4 --bf16-start 2 \
#   --job-requests 3 --job-context 64 --job-new-tokens 4 --out /tmp/devtest
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
export ROTKV_COMMIT=${ROTKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
mkdir -p "$OUT"
PART=${PART:-1}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if [ "$PART" = 1 ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_prefill.py tests/test_paged_cache.py \
    tests/kernels/test_backend.py tests/kernels/test_prefill_kernels.py "tests/kernels/test_kernels.py::test_dequant_dense_into_a_longer_buffer" \
    "tests/kernels/test_kernels.py::test_dequant_dense_matches_reference" tests/test_capacity.py \
    -k "not smollm2 and not cli_max_batch" > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error |assert" "$OUT/tests.log" | tail -12
  timeout 330 python3 studies/device_prefill.py --sections peak,sweep --cases a,c --out "$OUT" > "$OUT/part1.log" 2>&1
  echo "part1 rc=$?"
elif [ "$PART" = 2 ]; then
  timeout 560 python3 studies/device_prefill.py --sections peak,capacity --cases b --out "$OUT" > "$OUT/part2.log" 2>&1
  echo "part2 rc=$?"
else
  timeout 560 python3 studies/device_prefill.py --sections job --out "$OUT" > "$OUT/part3.log" 2>&1
  echo "part3 rc=$?"
fi
grep -E "^capacity|section|failed|Error" "$OUT"/part*.log | tail -20
cat "$OUT/summary.md"
