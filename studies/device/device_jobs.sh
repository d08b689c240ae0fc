#!/usr/bin/env bash
# The long-generation job, the refine split and the decode-time flush on a GPU, as one background run polled
# across device calls (a call is at most 10 minutes; every stage below is under its own timeout):
#   bash studies/device/device_jobs.sh start            # starts the run (setsid nohup), returns at once
#   bash studies/device/device_jobs.sh poll N           # waits up to N seconds, copies what is done to $OUT
#   STAGES="tests split" bash studies/device/device_jobs.sh start   # some stages only (default: tests gpucpu split stepprof jobqwen)
# Needs: artifacts/ (oscar-mix.safetensors, oscar-mix-long.safetensors; carried, gitignored) and $ROTKV_GGUF (the real
# SmolLM2) for gpucpu, split's and stepprof's real rows, aquastep, niah48 and jobsmol (without it those rows are skipped). Stages (results under ~/jobs, copied to $OUT by every poll):
#   tests     the GPU tests of this work: the continuous-batching job in a CUDA graph against the eager job, the
#             refine split with the CUDA kernel as the rest (tests/kernels/test_refine_split.py runs it against the
#             PyTorch reference), the flush graph per bucket, the refine kernel's tests (about 4 minutes; TEST_FILES and
#             TEST_K pick fewer)
#   gpucpu    GPU = CPU on the real SmolLM2 (tests/kernels/test_gpu_equals_cpu.py): for every preset with a kernel
#             path and oscar-aqua, per-token distributions of the GPU kernel path and the GPU PyTorch path against the
#             CPU PyTorch path, 2 windows of 2048 tokens then 256 teacher-forced, bounded by the KL of rounding every
#             attention output to bf16 (small artifacts calibrated in the test; about 20 minutes: poll across calls)
#   split     the step of oscar-refine +graph+compile without and with the split (ROTKV_TUNING=refine_split=SPLIT_MODES, default "0 1"; "kernel": the CUDA kernel reads the tier; a mode may add
#             DecodeConfig fields or switches: "kernel,cuda_prefetch=0", "auto,cuda_key4=1"; SPLIT_QWEN_MODES: the
#             Qwen3-8B rows' own list) beside
#             oscar-mix and bf16 +graph+compile: `rotkv bench`, real SmolLM2 64 x 8K; then the Qwen3-8B shape
#             (random weights, 8 layers, 16 x 32K): quarot-int2 with oscar-refine's tiers (sink 4, window 32, share
#             1/64, 224 refined tokens, keys and values, one page per 19) without and with the split, beside the same
#             tiers unrefined (target: the split's step within 5% of the unrefined one's) (about 6 minutes)
#   stepprof  profile_step.py: the flush graph's time alone (flush_ms at 1, 8 and 64 pages, its share of the step)
#             at SmolLM2's shape 64 x 8K for quarot-int2 and bf16 +compile, and oscar-refine (split) and oscar-mix
#             on the real SmolLM2 (about 4 minutes)
#   aquastep  the step of oscar-aqua (eager PyTorch path: no kernel reads a predicting layer) against oscar-refine eager
#             and +graph+compile and rotkv bf16 +graph+compile: `rotkv bench`, real SmolLM2 64 x 8K, one artifact
#             (oscar-mix-long+aqua, calibrated on the GPU when artifacts/ lacks it) (about 5 minutes; not a default
#             stage: STAGES=aquastep)
#   jobqwen   bench_job.py --workload reasoning at the Qwen3-8B shape, 36 layers, random weights: 512 requests of
#             512-2K prompt and 8K-32K new tokens, one KV budget (the free memory less 8 GB), each method cut at
#             150 s (a first request ends after 8K steps: at about 30 ms a step the cut measures the batch each
#             method holds and its tokens/s; JOB_SECONDS=600 and one method at a time see rows refilled):
#             quarot-int2 with oscar-mix's tiers, with oscar-refine's (split on), rotkv bf16, all +graph+compile, and
#             HF StaticCache + compile (waves) (about 15 minutes: poll across calls; JOBQWEN_METHODS picks others;
#             JOB_PREFILL_ROWS: requests prefilled together, default 4)
#   niah48    NIAH at 4, 6 and 8K (noise, essay, multikey; 8 haystacks per cell: 96 questions per method) for
#             NIAH_METHODS (default bf16,oscar-refine) at their own sink and window, `rotkv eval --device cuda`
#             (not a default stage: STAGES=niah48)
#   jobsmol   the same job on the real SmolLM2: oscar-refine (split on), oscar-mix, quarot-int2, bf16 (+graph+compile)
#             and HF StaticCache + compile, 2048 requests, 90 s each (about 10 minutes)
set -u
R=${RES:-$HOME/jobs}
if [ "${1:-}" = start ]; then
  mkdir -p "$R"
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
  export ROTKV_COMMIT=${ROTKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
  setsid nohup bash "$0" run >> "$R/run.log" 2>&1 < /dev/null &
  echo "started $ROTKV_COMMIT"
  exit 0
fi
if [ "${1:-}" = poll ]; then
  end=$(( $(date +%s) + ${2:-500} ))
  while [ "$(date +%s)" -lt "$end" ] && ! grep -q "^all done" "$R/run.log" 2>/dev/null; do sleep 10; done
  mkdir -p "${OUT:-/tmp/out}" && cp -r "$R"/. "${OUT:-/tmp/out}/"
  grep -E "^(stage|all done)|rc=|passed|failed|tok/s|^\| (16|64) x" "$R/run.log" | tail -60
  exit 0
fi
cd "$(dirname "$0")/../.."
mkdir -p "$R"  # (run without start: device_vllm.sh's rotkv-split job)
STAGES=${STAGES:-tests gpucpu split stepprof jobqwen}
JOB_SECONDS=${JOB_SECONDS:-150}
stage() { echo "stage $1 start $(date +%T)"; }
want() { case " $STAGES " in *" $1 "*) return 0;; *) return 1;; esac; }
# the real SmolLM2's rows run where its GGUF is here; elsewhere they are skipped, said once per stage, and the
# random-weight rows of the same stage still run
gguf() { [ -n "${ROTKV_GGUF:-}" ] && [ -f "$ROTKV_GGUF" ] && return 0; echo "$1: no SmolLM2 GGUF (\$ROTKV_GGUF), its rows skipped"; return 1; }
MIX_TIERS="sink=16,window=32,window_share=0.015625,meta_v=float8"  # as job_reasoning.MIX_TIERS / REFINE_TIERS
REFINE_TIERS="sink=4,window=32,window_share=0.015625,meta_v=float8,refine_tokens=224,refine_values=true,refine_every=19"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
if want tests; then stage tests
timeout 420 python3 -m pytest -q -n 8 -p no:cacheprovider ${TEST_FILES:-tests/test_jobs.py tests/kernels/test_refine_split.py \
  tests/kernels/test_refine_kernel.py tests/kernels/test_refine_cuda.py tests/kernels/test_backend.py} \
  -k "${TEST_K:-job or split or refine or graph or flush or cuda}" > "$R/tests-jobs.log" 2>&1
echo "tests rc=$?"; tail -3 "$R/tests-jobs.log"; fi
if want gpucpu; then stage gpucpu
timeout 2400 python3 -m pytest -q -s -p no:cacheprovider tests/kernels/test_gpu_equals_cpu.py > "$R/tests-gpucpu.log" 2>&1
echo "gpucpu rc=$?"; grep -E "own KL|passed|failed|Error" "$R/tests-gpucpu.log" | tail -14; fi
if want split; then stage split
if [ "${SPLIT_REAL:-1}" = 1 ] && gguf split; then  # SPLIT_REAL=0: the Qwen3-8B shape's rows only
for mode in ${SPLIT_MODES:-0 1}; do
  ROTKV_TUNING=refine_split=$mode timeout 300 python3 -m rotkv.cli bench --model "$ROTKV_GGUF" \
    --batch 64 --context 8160 --new-tokens 32 --methods rotkv:oscar-refine+graph+compile \
    --artifact artifacts/oscar-mix-long.safetensors --out "$R/generate-split$mode-refine-smollm2.json" >> "$R/split.log" 2>&1
  echo "split $mode oscar-refine rc=$?"; grep "^| 64 x" "$R/split.log" | tail -1
done
timeout 300 python3 -m rotkv.cli bench --model "$ROTKV_GGUF" --batch 64 --context 8160 --new-tokens 32 \
  --methods rotkv:oscar-mix+graph+compile rotkv:bf16+graph+compile --artifact artifacts/oscar-mix.safetensors \
  --out "$R/generate-split-mix-smollm2.json" >> "$R/split.log" 2>&1
echo "split oscar-mix bf16 rc=$?"; grep "^| 64 x" "$R/split.log" | tail -2
fi
for mode in ${SPLIT_QWEN_MODES:-${SPLIT_MODES:-0 1}}; do
  ROTKV_TUNING=refine_split=$mode timeout 300 python3 -m rotkv.cli bench --random qwen3-8b --layers 8 --batch 16 --context 32768 \
    --new-tokens 32 --methods rotkv:quarot-int2+graph+compile --sink 4 --window 32 --window-share 0.015625 --refine-tokens 224 \
    --refine-values --refine-every 19 --out "$R/generate-split$mode-refine-qwen8L.json" >> "$R/split.log" 2>&1
  echo "split $mode qwen refine rc=$?"; grep "^| 16 x" "$R/split.log" | tail -1
done
timeout 300 python3 -m rotkv.cli bench --random qwen3-8b --layers 8 --batch 16 --context 32768 --new-tokens 32 \
  --methods rotkv:quarot-int2+graph+compile rotkv:bf16+graph+compile --sink 4 --window 32 --window-share 0.015625 \
  --out "$R/generate-split-plain-qwen8L.json" >> "$R/split.log" 2>&1
echo "split qwen plain rc=$?"; grep "^| 16 x" "$R/split.log" | tail -2; fi
if want stepprof; then stage stepprof
timeout 240 python3 studies/profile_step.py --shape smollm2 --requests 64 --context 8192 \
  --presets quarot-int2+compile bf16+compile --out "$R/stepprof-flush-smollm2.json" > "$R/stepprof.log" 2>&1
echo "stepprof shape rc=$?"; grep -E "flush|graph_ms" "$R/stepprof.log" | tail -6
if gguf stepprof; then
ROTKV_TUNING=refine_split=1 timeout 300 python3 studies/profile_step.py --model "$ROTKV_GGUF" \
  --artifact-dir artifacts --requests 64 --context 8192 --presets oscar-refine+compile oscar-mix+compile \
  --out "$R/stepprof-flush-real.json" >> "$R/stepprof.log" 2>&1
echo "stepprof real rc=$?"; grep -E "flush|graph_ms" "$R/stepprof.log" | tail -6; fi; fi
if want aquastep && gguf aquastep; then stage aquastep
A=artifacts/oscar-mix-long+aqua.safetensors
[ -f "$A" ] || timeout 300 python3 -m rotkv.cli calibrate --device cuda --method aqua \
  --base-artifact artifacts/oscar-mix-long.safetensors --out "$A" > "$R/aquastep.log" 2>&1
timeout 420 python3 -m rotkv.cli bench --model "$ROTKV_GGUF" --batch 64 --context 8160 \
  --new-tokens 32 --methods rotkv:oscar-aqua rotkv:oscar-refine rotkv:oscar-refine+graph+compile rotkv:bf16+graph+compile \
  --artifact "$A" --out "$R/generate-aqua-smollm2.json" >> "$R/aquastep.log" 2>&1
echo "aquastep rc=$?"; grep "^| 64 x" "$R/aquastep.log" | tail -4; fi
if want jobqwen; then stage jobqwen
ROTKV_TUNING=refine_split=1 timeout 1500 python3 benchmarks/bench_job.py --workload reasoning --shape qwen3-8b --requests 512 \
  --prefill-rows "${JOB_PREFILL_ROWS:-4}" --max-seconds "$JOB_SECONDS" --methods ${JOBQWEN_METHODS:-"rotkv:quarot-int2+graph+compile@$MIX_TIERS" \
  "rotkv:quarot-int2+graph+compile@$REFINE_TIERS" rotkv:bf16+graph+compile hf-static-compile} \
  --out "$R/jobreason-qwen3-8b-36l.json" > "$R/jobqwen.log" 2>&1
echo "jobqwen rc=$?"; grep "tok/s" "$R/jobqwen.log" | tail -4; fi
if want niah48 && gguf niah48; then stage niah48
timeout 900 python3 -m rotkv.cli eval --device cuda --model "$ROTKV_GGUF" --artifact-dir artifacts \
  --methods "${NIAH_METHODS:-bf16,oscar-refine}" --sink preset --window preset --tasks niah \
  --lengths niah=4096,6144,8192 --samples 8 --variants noise,essay,multikey --out "$R/niah48" > "$R/niah48.log" 2>&1
echo "niah48 rc=$?"; grep -E "^\| (bf16|oscar)" "$R/niah48/report.md" 2>/dev/null | tail -4; fi
if want jobsmol && gguf jobsmol; then stage jobsmol
ROTKV_TUNING=refine_split=1 timeout 1200 python3 benchmarks/bench_job.py --workload reasoning --model "$ROTKV_GGUF" \
  --artifact-dir artifacts --requests 2048 --max-seconds "${SMOL_SECONDS:-90}" --methods rotkv:oscar-refine+graph+compile \
  rotkv:oscar-mix+graph+compile rotkv:quarot-int2+graph+compile rotkv:bf16+graph+compile hf-static-compile \
  --out "$R/jobreason-smollm2.json" > "$R/jobsmol.log" 2>&1
echo "jobsmol rc=$?"; grep "tok/s" "$R/jobsmol.log" | tail -5; fi
echo "all done $(date +%T)"
