#!/usr/bin/env bash
# How docs/results/cpu-w64 was produced (SmolLM2-135M-Instruct, CPU, transformers 5.24, torch 2.13):
# the full profile, split over parallel single-thread processes by method (results are cached per method,
# task and length, so the processes share one output folder), then one --report-only pass that merges
# every method into results.json, report.md, README_section.md and the plots.
#
#   bash docs/results/cpu-w64/run_full.sh [ARTIFACT_DIR]          # run from the repository root
#
# One thread per process: on a busy CPU, torch's default (every core, OpenMP spin-waiting) was 10x slower.
# Peers: pip install 'rotkv[peers]' (optimum-quanto compiles its CPU extension on first use: needs a C++
# compiler and a few minutes).
set -euo pipefail
ART=${1:-artifacts}
OUT=docs/results/cpu-w64
mkdir -p "$ART"
# Artifacts. oscar: the calibration defaults. optr: fewer tokens and steps than the defaults (8192 / 20
# instead of 16384 / 80), which would have taken about 100 minutes on the shared CPU of this run.
[ -f "$ART/oscar.safetensors" ] || OMP_NUM_THREADS=1 rotkv calibrate --method oscar --out "$ART/oscar.safetensors"
[ -f "$ART/optr.safetensors" ] || OMP_NUM_THREADS=1 rotkv calibrate --method optr --tokens 8192 --steps 20 --out "$ART/optr.safetensors"
COMMON=(--profile full --out "$OUT" --artifact-dir "$ART" --threads 1)
run() { OMP_NUM_THREADS=1 rotkv eval "${COMMON[@]}" --methods $1 > "$OUT/log_$2.txt" 2>&1; }
run bf16,int4,naive-int2 a &
run quarot-int2,kivi-2,oscar-int2 b &
run hf-quanto-int4,hf-quanto-int2,hf-hqq-int2 c &
run turboquant-int3 d &
run optr-int2 e &       # started once its artifact was written
# started later, to share the slow peers' and the 8K units (a unit already cached is skipped):
run "hf-hqq-int2,hf-quanto-int2,hf-quanto-int4 --tasks attn-error,niah --variants noise,multivalue" f &
run "oscar-int2 --tasks nll --lengths nll=8192" g &
run "kivi-2 --tasks nll --lengths nll=8192" h &
wait   # the committed run was stopped at 12:06 UTC instead (report.md lists the units that had not finished)
rotkv eval "${COMMON[@]}" --methods bf16,int4,naive-int2,quarot-int2,kivi-2,oscar-int2,optr-int2,hf-quanto-int4,hf-quanto-int2,hf-hqq-int2,turboquant-int3 --report-only
