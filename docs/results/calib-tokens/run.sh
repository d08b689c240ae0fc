#!/usr/bin/env bash
# calib-tokens: what the calibration length (--tokens) does to oscar-refine's KL on the suite's dev split at 2K.
# usage: run.sh N [N...]   one stream (two ran side by side); KW=8 runs the key-width search over 8 windows
# (folders and artifacts get the suffix -kw8). Run from the checkout's root (the runs used a worktree at /tmp/study).
set -u
P=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1 PYTHONPATH=$PWD
R=docs/results/calib-tokens
KW=${KW:-2}; S=$([ "$KW" = 2 ] || echo "-kw$KW")
mkdir -p $R
for N in "$@"; do
  A=${ART_ROOT:-/tmp/calibtok}/a$N$S; mkdir -p $A
  echo "[$(date -u +%T)] $N$S calibrate oscar-mix"
  $P -m rotkv.cli calibrate --method oscar-mix --tokens $N --key-windows $KW --out $A/oscar-mix.safetensors \
    > $R/calib-$N$S.log 2>&1 || echo "calib $N failed"
  echo "[$(date -u +%T)] $N$S calibrate oscar-mix-long"
  $P -m rotkv.cli calibrate --method oscar-mix-long --base-artifact $A/oscar-mix.safetensors \
    --out $A/oscar-mix-long.safetensors >> $R/calib-$N$S.log 2>&1 || echo "long $N failed"
  echo "[$(date -u +%T)] $N$S eval dev"
  $P -m rotkv.cli eval --suite mixed --split dev --profile full --lengths 2048 --windows 2 --new-tokens 64 --threads 1 \
    --methods oscar-refine --sink preset --window preset --artifact-dir $A --out $R/dev-t$N$S > $R/eval-$N$S.log 2>&1 \
    || echo "eval $N failed"
  echo "[$(date -u +%T)] $N$S done"
done
