#!/usr/bin/env bash
# The multi-domain suite on a GPU (SmolLM2), for a session with a device: artifacts calibrated with the default
# (multi-domain) corpus, the suite's test split at 2K and 8K for the presets and quanto INT4, then the
# GPU = CPU test. Run it in the background and poll (each device call is at most 10 minutes):
#   setsid nohup bash studies/device/device_suite.sh > ~/suite.log 2>&1 &   # results under ~/suite
#   STAGES="calib test2k" bash studies/device/device_suite.sh                # some stages only
# Stages: calib (oscar-mix, oscar-mix-long with the default key fits 4096,8192), test2k / test8k (the
# presets on the GPU, each at its own sink and window; 16 windows x 128 tokens per domain), quanto2k (HF quanto
# INT4 on the CPU over the same windows: quanto's cache runs there), dev2k (the dev split, where levers are
# chosen), gpucpu (tests/kernels/test_gpu_equals_cpu.py).
set -uo pipefail
cd "$(dirname "$0")/../.."
R=${R:-$HOME/suite}
A=$R/artifacts
P=${PY:-.venv/bin/python}
STAGES=${STAGES:-calib test2k test8k quanto2k gpucpu}
METHODS=${METHODS:-bf16,int4,oscar-mix,oscar-mix-long,oscar-refine}
mkdir -p "$R" "$A"
say() { echo "[$(date +%T)] $*"; }
for s in $STAGES; do
  case $s in
    calib)
      say "calibrate oscar-mix"
      $P -m rotkv.cli calibrate --method oscar-mix --device cuda --out "$A/oscar-mix.safetensors"
      say "calibrate oscar-mix-long"
      $P -m rotkv.cli calibrate --method oscar-mix-long --device cuda --base-artifact "$A/oscar-mix.safetensors" \
        --out "$A/oscar-mix-long.safetensors" ;;
    test2k|test8k|dev2k)
      L=$([ "$s" = test8k ] && echo 8192 || echo 2048); SPLIT=$([ "$s" = dev2k ] && echo dev || echo test)
      say "suite $SPLIT at $L on the GPU"
      $P -m rotkv.cli eval --suite mixed --split "$SPLIT" --device cuda --profile full --lengths "$L" \
        --methods "$METHODS" --artifact-dir "$A" --window-batch "${WB:-16}" --out "$R/$SPLIT-$L" ;;
    quanto2k)
      say "quanto INT4 on the CPU, the test windows at 2048"
      OMP_NUM_THREADS=${OMP_NUM_THREADS:-8} $P -m rotkv.cli eval --suite mixed --split test --profile full \
        --lengths 2048 --methods int4,hf-quanto-int4 --out "$R/test-2048-cpu" ;;
    gpucpu)
      say "GPU = CPU test"
      $P -m pytest -q -s tests/kernels/test_gpu_equals_cpu.py 2>&1 | tee "$R/gpu_equals_cpu.log" ;;
    *) say "unknown stage $s"; exit 2 ;;
  esac
done
say "done"
