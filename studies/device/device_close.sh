#!/usr/bin/env bash
# The prefill, capacity and job work at its closing commit, on the H200, as one background run polled across device calls
# (each call is at most 10 minutes; the run is about 20):
#   bash studies/device/device_close.sh start   # starts the run (setsid nohup), returns at once
#   bash studies/device/device_close.sh poll N  # waits up to N seconds, copies what is done to $OUT
#   STAGES="capacity" bash studies/device/device_close.sh start   # only some stages (default: all five)
# Stages, each under its own timeout, results under ~/close (copied to $OUT by every poll):
#   1. the GPU test set (kernels, paged cache, prefill, cache layer, capacity) -> tests-cuda.log
#   2. the job benchmark with real prefill (Qwen3-8B shape, 36 layers, 32 x 32K, 256 new tokens)
#   3. capacity of a 16 GB budget (`rotkv bench --max-batch --memory-gb 16`) at SmolLM2's shape, 8K
#   4. `rotkv bench` rows of the decode-step issue: SmolLM2 64 x 8K, 1 x 4K; Qwen3-8B shape 8 layers 4 x 32K
#   5. bench_decode.py (library default) at B 1/8/32 x 4K/32K/128K, and a D64 row set (9 q / 3 kv heads)
#   (d64: the D64 rows alone, with the fused/unfused and score variants; stepprof: profile_step.py at
#   SmolLM2 64 x 8K; prefillprof: profile_prefill.py at SmolLM2 64 x 8K, default budget and one call;
#   quick: this stop's kernel and prefill tests; prefillsweep: prefill time and peak at 128K/256K/512K
#   tokens per call; fp8: the e4m3-metadata Triton paths compiled; oscarmix: the recommended preset
#   through `rotkv bench` on the real SmolLM2 ($ROTKV_GGUF, artifacts/) with the CUDA and Triton writes,
#   beside quarot-int2, rotkv bf16 and StaticCache; capacity36: the largest batch at Qwen3-8B's 36 layers x 32K for INT2,
#   rotkv bf16 and StaticCache (about 20 minutes: poll across calls; CAP36 picks the tries); oscarprof:
#   profile_step.py and profile_prefill.py on the real SmolLM2 with bf16, quarot-int2 and oscar-mix; cudawrite8:
#   the CUDA write's e4m3 build, tested, then oscar-mix's prefill and step without and with it; none of
#   these in the default list; job1024: the job stage with 1024 new tokens, about 4 minutes;
#   OSCARMIX_TRITON=0 skips oscarmix's Triton-write run; flushgraph: the flush-graph and decode-config
#   tests, then profile_step (graph_ms with the flush graph against graph_ms_eager_flush) for quarot-int2
#   and oscar-mix on the real SmolLM2; smolmix: bench_mixed.py --kinds smolmix (oscar-mix's INT4-key
#   and INT2 layer formats at SmolLM2's shape over config sweeps) and the best configs' overrides written
#   to $R/best-overrides.txt; steprows: `rotkv bench` rows at 64 x 8K on the real SmolLM2: oscar-mix
#   (+graph, +graph+fold, and +graph with $R/best-overrides.txt as ROTKV_DECODE_CONFIG), quarot-int2,
#   rotkv bf16 and StaticCache; compile: the compiled-layers tests, profile_step.py with and without
#   +compile at SmolLM2's shape (random weights) 64 x 8K and 1 x 4K, and `rotkv bench` at 1 x 4K against
#   StaticCache; compilerows: those tests with the layer path's, then +compile rows: profile_step at
#   64 x 8K, `rotkv bench` at SmolLM2 1 x 4K and Qwen3-8B shape 8 layers 4 x 32K (random weights), each
#   beside StaticCache; realrows: `rotkv bench` on the real SmolLM2 at 64 x 8K, +graph+compile for bf16,
#   quarot-int2 and oscar-mix, oscar-mix +graph alone, and StaticCache; tierwrite: the rotation and graph
#   tests, then profile_step with +compile at SmolLM2's shape 64 x 8K and 1 x 4K; refine: the refine tier's
#   kernel and cache tests compiled, then `rotkv bench` of oscar-refine on the real SmolLM2 at 16 x 8K with
#   ROTKV_REFINE_KERNEL=0 and 1, beside oscar-mix-long eager and +graph; niah: NIAH 1-3K on the real SmolLM2, 8
#   haystacks a cell; gemma: Gemma3-270M's KL and NIAH on the GPU (its GGUF in parts under ~/g, artifact ~/g/art);
#   refine2: oscar-refine's tests, its +graph step at 16 and 64 x 8K beside oscar-mix-long and bf16 and with
#   the e4m3-key-metadata lever's flags, and NIAH 1-3K with 8 haystacks a cell)
set -u
R=${RES:-$HOME/close}
if [ "${1:-}" = start ]; then
  mkdir -p "$R"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1  # keeps a --target site (gguf)
  export ROTKV_COMMIT=${ROTKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  setsid nohup bash "$0" run >> "$R/run.log" 2>&1 < /dev/null &
  echo "started $ROTKV_COMMIT"
  exit 0
fi
if [ "${1:-}" = poll ]; then
  end=$(( $(date +%s) + ${2:-500} ))
  while [ "$(date +%s)" -lt "$end" ] && ! grep -q "^all done" "$R/run.log" 2>/dev/null; do sleep 10; done
  mkdir -p "${OUT:-/tmp/out}" && cp -r "$R"/. "${OUT:-/tmp/out}/"
  grep -E "^(stage|capacity|all done)|rc=|passed|failed" "$R/run.log" | tail -40
  exit 0
fi
# run
cd "$(dirname "$0")/.."
STAGES=${STAGES:-tests job capacity generate decode}
stage() { echo "stage $1 start $(date +%T)"; }
want() { case " $STAGES " in *" $1 "*) return 0;; *) return 1;; esac; }
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if want tests; then stage tests
timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_prefill.py tests/test_cache_layer.py \
  tests/test_paged_cache.py tests/test_capacity.py tests/kernels > "$R/tests-cuda.log" 2>&1
echo "tests rc=$?"; tail -3 "$R/tests-cuda.log"; fi
if want flushgraph; then stage flushgraph
timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_backend.py tests/kernels/test_host_syncs.py \
  tests/test_cache_model.py tests/kernels/test_kernels.py -k "flush_graph or graph_decode or wide or decode_config or fp8_value or mixed_bits or kernel_path or sync or range or model" \
  > "$R/tests-flushgraph.log" 2>&1
echo "flushgraph tests rc=$?"; tail -3 "$R/tests-flushgraph.log"
timeout 200 python3 studies/profile_step.py --model "${ROTKV_GGUF:?the real SmolLM2 GGUF}" --artifact-dir artifacts \
  --presets quarot-int2 oscar-mix --requests 64 --context 8192 --out "$R/stepprof-real-smollm2-64x8k.json" \
  > "$R/stepprof.log" 2>&1
echo "flushgraph stepprof rc=$?"; grep -E "graph_ms|replay_ms" "$R/stepprof.log"; fi
if want compile; then stage compile
timeout 300 python3 -m pytest -q -n 4 -p no:cacheprovider tests/kernels/test_backend.py tests/test_compiled_layers.py \
  -k "compiled or graph_decode or flush_graph" > "$R/tests-compile.log" 2>&1
echo "compile tests rc=$?"; tail -3 "$R/tests-compile.log"
for shape in "64 8192" "1 4096"; do set -- $shape
timeout 300 python3 studies/profile_step.py --shape smollm2 --presets bf16 bf16+compile quarot-int2 quarot-int2+compile \
  --requests $1 --context $2 --out "$R/stepprof-compile-smollm2-$1x$2.json" > "$R/stepprof-compile-$1x$2.log" 2>&1
echo "compile stepprof $1x$2 rc=$?"; grep -E "first_step|graph_ms |replay_ms|kernel_ms|compiled|norm" "$R/stepprof-compile-$1x$2.log"; done
timeout 300 python3 -m rotkv.cli bench --random smollm2 --batch 1 --context 4096 --new-tokens 64 \
  --methods hf-static-compile rotkv:bf16+graph rotkv:bf16+graph+compile rotkv:quarot-int2+graph rotkv:quarot-int2+graph+compile \
  --out "$R/generate-compile-smollm2-1x4k.json" > "$R/bench-compile-1x4k.log" 2>&1
echo "compile bench 1x4k rc=$?"; tail -8 "$R/bench-compile-1x4k.log"; fi
if want compilerows; then stage compilerows
timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_backend.py tests/test_compiled_layers.py \
  tests/test_cache_layer.py tests/test_paged_cache.py tests/kernels/test_host_syncs.py > "$R/tests-compilerows.log" 2>&1
echo "compilerows tests rc=$?"; tail -3 "$R/tests-compilerows.log"
timeout 200 python3 studies/profile_step.py --shape smollm2 --presets bf16+compile quarot-int2+compile \
  --requests 64 --context 8192 --out "$R/stepprof-compile-smollm2-64x8192.json" > "$R/stepprof-compilerows.log" 2>&1
echo "compilerows stepprof rc=$?"; grep -E "graph_ms |replay_ms|kernel_ms|GEMM|norm" "$R/stepprof-compilerows.log"
timeout 150 python3 -m rotkv.cli bench --random smollm2 --batch 1 --context 4096 --new-tokens 64 \
  --methods hf-static-compile rotkv:bf16+graph+compile rotkv:quarot-int2+graph+compile \
  --out "$R/generate-compile-smollm2-1x4k.json" > "$R/bench-compilerows-1x4k.log" 2>&1
echo "compilerows 1x4k rc=$?"; grep "^| 1 x" "$R/bench-compilerows-1x4k.log"
timeout 240 python3 -m rotkv.cli bench --random qwen3-8b --layers 8 --batch 4 --context 32768 --new-tokens 64 \
  --methods hf-static-compile rotkv:bf16+graph rotkv:bf16+graph+compile rotkv:quarot-int2+graph rotkv:quarot-int2+graph+compile \
  --out "$R/generate-compile-qwen8L-4x32k.json" > "$R/bench-compilerows-qwen.log" 2>&1
echo "compilerows qwen rc=$?"; grep "^| 4 x" "$R/bench-compilerows-qwen.log"; fi
if want realrows; then stage realrows
timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_backend.py tests/test_compiled_layers.py \
  -k "graph or compiled" > "$R/tests-realrows.log" 2>&1
echo "realrows tests rc=$?"; tail -2 "$R/tests-realrows.log"
timeout 400 python3 -m rotkv.cli bench --model "${ROTKV_GGUF:?the real SmolLM2 GGUF}" --batch 64 --context 8192 --new-tokens 32 \
  --methods hf-static-compile rotkv:bf16+graph+compile rotkv:quarot-int2+graph+compile rotkv:oscar-mix+graph+compile \
  rotkv:oscar-mix+graph+fold+compile rotkv:oscar-mix+graph --artifact artifacts/oscar-mix.safetensors \
  --out "$R/generate-compile-real-smollm2-64x8k.json" > "$R/bench-realrows.log" 2>&1
echo "realrows rc=$?"; grep "^| 64 x" "$R/bench-realrows.log"
timeout 240 python3 studies/profile_step.py --model "$ROTKV_GGUF" --artifact-dir artifacts \
  --presets bf16+compile quarot-int2+compile oscar-mix+compile --requests 64 --context 8192 \
  --out "$R/stepprof-compile-real-smollm2-64x8k.json" > "$R/stepprof-realrows.log" 2>&1
echo "realrows stepprof rc=$?"; grep -E "graph_ms |replay_ms|kernel_ms" "$R/stepprof-realrows.log"; fi
if want tierwrite; then stage tierwrite
timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_rotate.py tests/kernels/test_backend.py \
  tests/test_compiled_layers.py tests/test_cache_layer.py tests/test_paged_cache.py > "$R/tests-tierwrite.log" 2>&1
echo "tierwrite tests rc=$?"; tail -3 "$R/tests-tierwrite.log"
for shape in "64 8192" "1 4096"; do set -- $shape
timeout 200 python3 studies/profile_step.py --shape smollm2 --presets bf16+compile quarot-int2+compile \
  --requests $1 --context $2 --out "$R/stepprof-tierwrite-smollm2-$1x$2.json" > "$R/stepprof-tierwrite-$1x$2.log" 2>&1
echo "tierwrite stepprof $1x$2 rc=$?"; grep -E "graph_ms |replay_ms|kernel_ms|write|other" "$R/stepprof-tierwrite-$1x$2.log" | head -8; done; fi
if want smolmix; then stage smolmix
timeout 300 python3 studies/bench_mixed.py --kinds smolmix --out "$R/mixed-smolmix.json" > "$R/smolmix.log" 2>&1
echo "smolmix rc=$?"
python3 - "$R/mixed-smolmix.json" > "$R/best-overrides.txt" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r.get("kind") == "smolmix" and r["batch"] == 64 and "ms" in r and "k_bits" in r]
best = [min(g, key=lambda r: r["ms"]) for bits in ((4, 2), (2, 2))
        if (g := [r for r in rows if (r["k_bits"], r["v_bits"]) == bits])]
print(",".join(filter(None, (r["overrides"] for r in best))))
PY
echo "smolmix best: $(cat "$R/best-overrides.txt")"; fi
if want steprows; then stage steprows
timeout 200 python3 -m rotkv.cli bench --model "${ROTKV_GGUF:?the real SmolLM2 GGUF}" --batch 64 --context 8192 --new-tokens 32 \
  --methods rotkv:oscar-mix+graph rotkv:oscar-mix+graph+fold --artifact artifacts/oscar-mix.safetensors \
  --out "$R/generate-oscar-mix-fold-smollm2-64x8k.json" > "$R/steprows.log" 2>&1
echo "steprows oscar-mix rc=$?"
if [ -s "$R/best-overrides.txt" ]; then
  ROTKV_DECODE_CONFIG=$(cat "$R/best-overrides.txt") timeout 150 python3 -m rotkv.cli bench --model "$ROTKV_GGUF" --batch 64 \
    --context 8192 --new-tokens 32 --methods rotkv:oscar-mix+graph --artifact artifacts/oscar-mix.safetensors \
    --out "$R/generate-oscar-mix-tuned-smollm2-64x8k.json" >> "$R/steprows.log" 2>&1
  echo "steprows tuned rc=$?"
fi
timeout 240 python3 -m rotkv.cli bench --model "$ROTKV_GGUF" --batch 64 --context 8192 --new-tokens 32 \
  --methods rotkv:quarot-int2+graph rotkv:bf16+graph hf-static-compile --out "$R/generate-real-smollm2-64x8k.json" \
  >> "$R/steprows.log" 2>&1
echo "steprows real rc=$?"; fi
if want job1024; then stage job1024  # the job with real prefill and a decode-dominated length (1024 new tokens)
timeout 560 python3 benchmarks/bench_job.py --requests 32 --context 32768 --new-tokens 1024 --layers 36 \
  --out "$R/job-prefill-1024.json" > "$R/job1024.log" 2>&1
echo "job1024 rc=$?"; fi
if want job; then stage job
timeout 420 python3 benchmarks/bench_job.py --requests 32 --context 32768 --new-tokens 256 --layers 36 \
  --out "$R/job-prefill.json" > "$R/job.log" 2>&1
echo "job rc=$?"; fi
if want capacity; then stage capacity
for spec in "rotkv:quarot-int2+graph 256" "rotkv:bf16+graph 64" "hf-static-compile 64"; do
  set -- $spec
  timeout 300 python3 -m rotkv.cli bench --random smollm2 --max-batch --context 8192 --new-tokens 64 \
    --memory-gb 16 --methods "$1" --start "$2" --max-tries ${CAP_TRIES:-5} --out "$R/capacity-16gb-$(echo "$1" | tr ':+' '__').json" \
    >> "$R/capacity.log" 2>&1
  echo "capacity $1 rc=$?"
done; fi
if want generate; then stage generate
timeout 240 python3 -m rotkv.cli bench --random smollm2 --batch 64 --context 8192 --new-tokens 32 \
  --methods rotkv:quarot-int2+graph rotkv:quarot-int2+graph+fold rotkv:bf16+graph hf-static-compile --out "$R/generate-smollm2-64x8k.json" > "$R/generate.log" 2>&1
echo "generate 64x8k rc=$?"
timeout 150 python3 -m rotkv.cli bench --random smollm2 --batch 1 --context 4096 --new-tokens 64 \
  --methods rotkv:quarot-int2+graph rotkv:bf16+graph hf-static-compile --out "$R/generate-smollm2-1x4k.json" >> "$R/generate.log" 2>&1
echo "generate 1x4k rc=$?"
timeout 200 python3 -m rotkv.cli bench --random qwen3-8b --layers 8 --batch 4 --context 32768 --new-tokens 32 \
  --methods rotkv:quarot-int2+graph rotkv:bf16+graph hf-static-compile --out "$R/generate-qwen8l-4x32k.json" >> "$R/generate.log" 2>&1
echo "generate qwen 8L 4x32k rc=$?"; fi
if want decode; then stage decode
timeout 200 python3 benchmarks/bench_decode.py --batch 1 8 32 --context 4096 32768 131072 --out "$R/decode.json" > "$R/decode.log" 2>&1
echo "decode rc=$?"
timeout 120 python3 benchmarks/bench_decode.py --batch 1 8 64 --context 4096 8192 --q-heads 9 --kv-heads 3 --head-dim 64 \
  --out "$R/decode-d64.json" >> "$R/decode.log" 2>&1
echo "decode d64 rc=$?"; fi
if want d64; then stage d64  # the head_dim-64 rows alone: the default against its fused and score variants
timeout 150 python3 benchmarks/bench_decode.py --batch 1 8 64 --context 4096 8192 32768 --q-heads 9 --kv-heads 3 --head-dim 64 \
  --configs default cuda-qf16-block cuda-qf16-none cuda-int8 triton-bf16 --out "$R/decode-d64.json" >> "$R/decode.log" 2>&1
echo "decode d64 rc=$?"; fi
if want stepprof; then stage stepprof  # the graph-captured step per kernel category, bf16 and INT2 side by side
timeout 150 python3 studies/profile_step.py --shape smollm2 --requests 64 --context 8192 --presets bf16 quarot-int2 \
  --out "$R/stepprof-smollm2-64x8k.json" > "$R/stepprof.log" 2>&1
echo "stepprof rc=$?"; fi
if want prefillprof; then stage prefillprof  # the prefill per kernel category at the default budget and in one call
timeout 150 python3 studies/profile_prefill.py --random smollm2 --batch 64 --context 8192 --methods bf16 quarot-int2 hf-static \
  --out "$R/prefill-prof-smollm2.json" > "$R/prefillprof.log" 2>&1
echo "prefillprof rc=$?"
timeout 120 python3 studies/profile_prefill.py --random smollm2 --batch 64 --context 8192 --methods bf16 quarot-int2 \
  --prefill-tokens 524288 --prefill-chunk 8192 --out "$R/prefill-prof-smollm2-onecall.json" >> "$R/prefillprof.log" 2>&1
echo "prefillprof onecall rc=$?"; fi
if want quick; then stage quick  # the tests of this stop's kernels and prefill paths, compiled
timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_rotate.py tests/test_prefill_exact.py \
  tests/test_prefill.py tests/test_rotation_math.py tests/test_folding.py tests/test_cache_layer.py \
  tests/test_cache_model.py tests/kernels/test_kernels.py tests/kernels/test_backend.py tests/kernels/test_host_syncs.py \
  > "$R/tests-quick.log" 2>&1
echo "quick tests rc=$?"; tail -3 "$R/tests-quick.log"; fi
if want prefillsweep; then stage prefillsweep  # prefill time and peak against the per-call token budget
timeout 240 python3 studies/profile_prefill.py --random smollm2 --batch 64 --context 8192 --methods bf16 quarot-int2 hf-static \
  --sweep-prefill-tokens 131072 262144 524288 --out "$R/prefill-sweep-smollm2-64x8k.json" > "$R/prefillsweep.log" 2>&1
echo "prefillsweep rc=$?"; fi
if want fp8; then stage fp8  # the e4m3-metadata Triton paths and the rotation kernel, compiled on the GPU
timeout 240 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_kernels.py tests/kernels/test_rotate.py \
  -k "fp8 or rotate" > "$R/tests-fp8.log" 2>&1
echo "fp8 tests rc=$?"; tail -3 "$R/tests-fp8.log"; fi
if want oscarmix; then stage oscarmix  # the recommended preset end to end: needs the real model ($ROTKV_GGUF)
for p in oscar-mix oscar-mix-long; do
  timeout 200 python3 -m rotkv.cli bench --model "${ROTKV_GGUF:?the real SmolLM2 GGUF}" --batch 64 \
    --context 8192 --new-tokens 32 --methods rotkv:$p+graph --artifact artifacts/$p.safetensors \
    --out "$R/generate-$p-smollm2-64x8k.json" >> "$R/oscarmix.log" 2>&1
  echo "$p rc=$?"
done
# the write kernel: oscar-mix's clipped INT2 keys go to the CUDA write by default ("auto"); Triton for all
[ "${OSCARMIX_TRITON:-1}" = 1 ] && ROTKV_WRITE_BACKEND=triton timeout 200 python3 -m rotkv.cli bench --model "$ROTKV_GGUF" --batch 64 --context 8192 \
  --new-tokens 32 --methods rotkv:oscar-mix+graph --artifact artifacts/oscar-mix.safetensors \
  --out "$R/generate-oscar-mix-tritonwrite-smollm2-64x8k.json" >> "$R/oscarmix.log" 2>&1
echo "oscar-mix triton write rc=$?"
timeout 240 python3 -m rotkv.cli bench --model "$ROTKV_GGUF" --batch 64 --context 8192 --new-tokens 32 \
  --methods rotkv:quarot-int2+graph rotkv:bf16+graph hf-static-compile --out "$R/generate-real-smollm2-64x8k.json" \
  >> "$R/oscarmix.log" 2>&1
echo "real smollm2 rc=$?"; fi
if want capacity36; then stage capacity36  # the capacity: Qwen3-8B shape, all 36 layers, 32K, the whole H200
# CAP36: "method start tries" triples, ';'-separated (a try of INT2 at 128 x 32K prefills 4M tokens: ~5 min)
IFS=';' read -ra specs <<< "${CAP36:-rotkv:quarot-int2+graph+fold 48 3;rotkv:bf16+graph 16 3;hf-static-compile 12 3}"
for spec in "${specs[@]}"; do
  set -- $spec
  timeout ${CAP36_T:-500} python3 -m rotkv.cli bench --random qwen3-8b --max-batch --context 32768 --new-tokens 64 \
    --methods "$1" --start "$2" --max-tries "$3" --out "$R/capacity36-$(echo "$1" | tr ':+' '__').json" \
    >> "$R/capacity36.log" 2>&1
  echo "capacity36 $1 rc=$?"
done; fi
if want oscarprof; then stage oscarprof  # the recommended preset's step and prefill per kernel, real SmolLM2 ($ROTKV_GGUF)
timeout 200 python3 studies/profile_step.py --model "${ROTKV_GGUF:?the real SmolLM2 GGUF}" --artifact-dir artifacts \
  --presets bf16 quarot-int2 oscar-mix --requests 64 --context 8192 --out "$R/stepprof-real-smollm2-64x8k.json" \
  > "$R/oscarprof.log" 2>&1
echo "oscarprof step rc=$?"
timeout 200 python3 studies/profile_prefill.py --model "$ROTKV_GGUF" --artifact-dir artifacts --batch 64 --context 8192 \
  --methods bf16 quarot-int2 oscar-mix hf-static --out "$R/prefill-prof-real-smollm2.json" >> "$R/oscarprof.log" 2>&1
echo "oscarprof prefill rc=$?"; fi
if want cudawrite8; then stage cudawrite8  # the CUDA write's e4m3 build: its test, then oscar-mix's prefill without and with it
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py -k "cuda_fp8_metadata" \
  > "$R/tests-cudawrite8.log" 2>&1
echo "cudawrite8 tests rc=$?"; tail -1 "$R/tests-cudawrite8.log"
for on in 0 1; do
  ROTKV_CUDA_WRITE_FP8=$on timeout 200 python3 -m rotkv.cli bench --model "${ROTKV_GGUF:?the real SmolLM2 GGUF}" --batch 64 \
    --context 8192 --new-tokens 32 --methods rotkv:oscar-mix+graph --artifact artifacts/oscar-mix.safetensors \
    --out "$R/generate-cudawrite8-$on.json" >> "$R/cudawrite8.log" 2>&1
  echo "cudawrite8 $on rc=$?"
done; fi
if want refine; then stage refine  # the refine tier (oscar-refine): its kernel compiled and tested, then the step
timeout 300 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_refine_kernel.py tests/test_refine.py \
  > "$R/tests-refine.log" 2>&1
echo "refine tests rc=$?"; tail -3 "$R/tests-refine.log"
# real SmolLM2 ($ROTKV_GGUF), 16 x 8K: oscar-refine eager through the PyTorch path and through the kernel,
# beside oscar-mix-long eager and +graph (same artifact)
for k in 0 1; do
  ROTKV_REFINE_KERNEL=$k timeout 200 python3 -m rotkv.cli bench --model "${ROTKV_GGUF:?the real SmolLM2 GGUF}" --batch 16 \
    --context 8192 --new-tokens 32 --methods rotkv:oscar-refine --artifact artifacts/oscar-mix-long.safetensors \
    --out "$R/generate-refine-kernel$k-smollm2-16x8k.json" >> "$R/refine.log" 2>&1
  echo "refine kernel=$k rc=$?"
done
ROTKV_REFINE_KERNEL=1 timeout 200 python3 -m rotkv.cli bench --model "$ROTKV_GGUF" --batch 16 --context 8192 --new-tokens 32 \
  --methods rotkv:oscar-refine+graph --artifact artifacts/oscar-mix-long.safetensors \
  --out "$R/generate-refine-graph-smollm2-16x8k.json" >> "$R/refine.log" 2>&1
echo "refine graph rc=$?"
timeout 200 python3 -m rotkv.cli bench --model "$ROTKV_GGUF" --batch 16 --context 8192 --new-tokens 32 \
  --methods rotkv:oscar-mix-long rotkv:oscar-mix-long+graph --artifact artifacts/oscar-mix-long.safetensors \
  --out "$R/generate-refine-base-smollm2-16x8k.json" >> "$R/refine.log" 2>&1
echo "refine base rc=$?"; fi
if want niah; then stage niah  # NIAH 1-3K on the real SmolLM2 ($ROTKV_GGUF), 8 haystacks a cell, bf16 beside the refine preset
ROTKV_REFINE_KERNEL=1 timeout 400 python3 -m rotkv.cli eval --device cuda --model "${ROTKV_GGUF:?the real SmolLM2 GGUF}" \
  --artifact-dir artifacts --methods bf16,oscar-refine,oscar-mix-long --sink preset --window preset --tasks niah \
  --lengths niah=1024,2048,3072 --samples 8 --out "$R/niah-smollm2" > "$R/niah.log" 2>&1
echo "niah rc=$?"; grep -E "^\| (bf16|oscar)" "$R/niah-smollm2/report.md" | head -12; fi
if want gemma; then stage gemma  # Gemma3-270M on the GPU: KL at 2K/8K and NIAH 1-4K; the GGUF arrives in parts (~/g)
G=${ROTKV_GEMMA:-$HOME/g/gemma3.gguf}
for _ in $(seq 60); do [ -s "$G" ] && [ -s "${ROTKV_GEMMA_ART:-$HOME/g/art}/oscar-mix-long.safetensors" ] && break; sleep 5; done
for at in "preset oscar-refine" "16 bf16,int4,oscar-mix-long"; do set -- $at
  ROTKV_REFINE_KERNEL=1 timeout 420 python3 -m rotkv.cli eval --device cuda --model "$G" --artifact-dir "${ROTKV_GEMMA_ART:-$HOME/g/art}" \
    --methods $2 --sink $1 --window 32 --tasks nll,niah --lengths nll=2048,8192 niah=1024,2048,4096 --windows 8 \
    --new-tokens 128 --variants essay,multikey --depths 0.1,0.5,0.9 --samples 4 --out "$R/gemma-sink$1" > "$R/gemma-$1.log" 2>&1
  echo "gemma sink $1 rc=$?"; tail -4 "$R/gemma-$1.log"
done; fi
if want refine2; then stage refine2  # oscar-refine on the GPU again, and its e4m3-key-metadata lever
timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_refine_kernel.py tests/test_refine.py \
  > "$R/tests-refine2.log" 2>&1
echo "refine2 tests rc=$?"; tail -1 "$R/tests-refine2.log"
for shape in "16 8192" "64 8192"; do set -- $shape
  timeout 300 python3 -m rotkv.cli bench --model "${ROTKV_GGUF:?the real SmolLM2 GGUF}" --batch $1 --context $2 --new-tokens 32 \
    --methods rotkv:oscar-refine+graph rotkv:oscar-mix-long+graph rotkv:bf16+graph --artifact artifacts/oscar-mix-long.safetensors \
    --out "$R/generate-refine2-smollm2-$1x$2.json" >> "$R/refine2.log" 2>&1
  echo "refine2 bench $1x$2 rc=$?"; grep "^| $1 x" "$R/refine2.log" | tail -3
  # the e4m3-key-metadata lever (levers_length.md, "e4m3 key metadata"): up to 48 refined pages a row at 8K
  timeout 200 python3 -m rotkv.cli bench --model "$ROTKV_GGUF" --batch $1 --context $2 --new-tokens 32 \
    --methods rotkv:oscar-refine+graph --meta-k float8 --refine-every 9 --refine-tokens 768 \
    --artifact artifacts/oscar-mix-long.safetensors --out "$R/generate-refine2-mk8-smollm2-$1x$2.json" >> "$R/refine2.log" 2>&1
  echo "refine2 mk8 bench $1x$2 rc=$?"; grep "^| $1 x" "$R/refine2.log" | tail -1
done
timeout 400 python3 -m rotkv.cli eval --device cuda --model "$ROTKV_GGUF" --artifact-dir artifacts --methods bf16,oscar-refine \
  --sink preset --window preset --tasks niah --lengths niah=1024,2048,3072 --variants noise,essay,multikey --samples 8 \
  --out "$R/niah2-smollm2" > "$R/niah2.log" 2>&1
echo "refine2 niah rc=$?"; fi
echo "all done $(date +%T)"
