#!/bin/bash
# One device call (the typed PagedBody and the planned dispatch, commit under
# test = HEAD). Checks the CUDA paths whose Python wrappers changed (cuda_decode.body_partials,
# cuda_write.launch, the decode and write plans, nvcc.load's per-call lookup), in < 8 minutes:
#   1. prebuild the decode kernel grid's nvcc builds in parallel (the tests then load them);
#   2. tests/kernels/test_kernels.py on CUDA (the CUDA kernel grid at its default variant and the
#      unfused one, every Triton and write case, fused merge + graph replay, refusals, int64 offsets);
#   3. the cache on CUDA: kernel path == reference path, CUDA-graph decode == eager, mixed widths,
#      SmolLM2 teacher-forced through the CUDA / Triton / auto plans; prebuild loaders; the plans;
#   4. one CUDA-graph generate of SmolLM2 (the plan captured in the graph).
# Run: OUT=/tmp/out bash studies/device/device_seam.sh   (ROTKV_GGUF: the SmolLM2 .gguf, as before)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT benchmarks/results
t0=$(date +%s)
timeout 90 python3 scripts/prebuild_decode.py --shapes 128/2 64/1 256/4 > $OUT/prebuild.log 2>&1
r1=$?; echo "prebuild rc=$r1"; tail -2 $OUT/prebuild.log
timeout 190 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_kernels.py \
  -k "not cuda_kernel_matches or 2048-block-True or 2048-none-False" > $OUT/kernels.log 2>&1
r2=$?; echo "kernels rc=$r2"; grep -E "passed|failed|FAILED|Error" $OUT/kernels.log | tail -12
timeout 170 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_backend.py tests/kernels/test_prebuild.py tests/test_device.py tests/test_assembly.py \
  tests/test_plan.py tests/test_paged_body.py tests/test_imports.py tests/test_paged_cache.py -s > $OUT/cache.log 2>&1
r3=$?; echo "cache rc=$r3"; grep -E "passed|failed|FAILED|Error|smollm2 kernel" $OUT/cache.log | tail -12
timeout 50 python3 -m rotkv.cli generate --model $ROTKV_GGUF --prompt "Name three primary colors." --cuda-graph \
  --json --max-new-tokens 24 > $OUT/generate.log 2>&1
r4=$?; echo "generate rc=$r4"; tail -1 $OUT/generate.log
python3 - "$r1" "$r2" "$r3" "$r4" "${ROTKV_COMMIT:-$(git rev-parse --short HEAD)}" "$(( $(date +%s) - t0 ))" <<'PY'
import json, sys
r = dict(zip(["prebuild", "kernels", "cache", "generate"], map(int, sys.argv[1:5])))
out = {"commit": sys.argv[5], "seconds": int(sys.argv[6]), "rc": r, "ok": not any(r.values())}
json.dump(out, open("benchmarks/results/device_seam.json", "w"), indent=1)
print(json.dumps(out))
PY
cp benchmarks/results/device_seam.json $OUT/ 2>/dev/null
