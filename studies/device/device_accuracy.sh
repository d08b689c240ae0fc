#!/usr/bin/env bash
# One device call (the model halves already assembled at $ROTKV_GGUF, the gguf wheel on PYTHONPATH):
# 1. `rotkv calibrate --device cuda` works (a short run, its artifact unused);
# 2. per-layer key widths on CUDA from calibration text (python -m rotkv.calibrate.keybits) on top of
#    artifacts/oscar.safetensors (the CPU-calibrated artifact of the lever runs);
# 3. the accuracy table on CUDA: nll at 2K and 8K, NIAH at 1-3K, every preset at sink 16 / window 32.
set -u
export PYTHONPATH=/tmp/site:$PWD
A=$OUT/artifacts; mkdir -p $A; cp artifacts/oscar.safetensors $A/
t() { echo "[$(date +%T)] $*"; }
t calibrate; timeout 150 python3 -m rotkv.cli calibrate --model $ROTKV_GGUF --device cuda --method oscar --tokens 2048 \
  --out /tmp/oscar-cuda.safetensors 2>&1 | grep -v '%|' | tail -4
t keybits; timeout 200 python3 -m rotkv.calibrate.keybits --model $ROTKV_GGUF --device cuda --base-artifact $A/oscar.safetensors \
  --layers ${KEY_LAYERS:-10} --windows 4 --out $A/oscar-mix.safetensors 2>&1 | grep -v '%|' | tail -3
t eval; timeout ${EVAL_S:-330} python3 -m rotkv.cli eval --model $ROTKV_GGUF --device cuda --profile full --window 32 \
  --tasks nll,niah --lengths nll=2048,8192 niah=1024,2048,3072 --methods ${METHODS:-bf16,int4,oscar-mix,oscar-int2,kivi-2,quarot-int2} \
  --artifact-dir $A --out $OUT/eval-w32 2>&1 | grep -v '%|' | tail -40
t report; python3 -m rotkv.cli eval --model $ROTKV_GGUF --device cuda --profile full --window 32 --tasks nll,niah \
  --lengths nll=2048,8192 niah=1024,2048,3072 --methods ${METHODS:-bf16,int4,oscar-mix,oscar-int2,kivi-2,quarot-int2} \
  --artifact-dir $A --out $OUT/eval-w32 --report-only 2>&1 | tail -3
t done
