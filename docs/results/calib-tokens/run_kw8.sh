#!/usr/bin/env bash
# issue 41 item 2: what the calibration length (--tokens) does to oscar-refine's KL on the suite's dev split at 2K
# usage: calib_tokens.sh N [N...]   (one stream; run two streams side by side)
set -u
cd /tmp/study
P=/work/main/.venv/bin/python
export OMP_NUM_THREADS=1 PYTHONPATH=/tmp/study
R=/tmp/study/docs/results/calib-tokens
mkdir -p $R
for N in "$@"; do
  A=/tmp/calibtok/a$N-kw8; mkdir -p $A
  echo "[$(date -u +%T)] $N calibrate oscar-mix"
  $P -m rotkv.cli calibrate --method oscar-mix --tokens $N --key-windows 8 --out $A/oscar-mix.safetensors > $R/calib-$N-kw8.log 2>&1 || echo "calib $N failed"
  echo "[$(date -u +%T)] $N calibrate oscar-mix-long"
  $P -m rotkv.cli calibrate --method oscar-mix-long --base-artifact $A/oscar-mix.safetensors --out $A/oscar-mix-long.safetensors >> $R/calib-$N-kw8.log 2>&1 || echo "long $N failed"
  echo "[$(date -u +%T)] $N eval dev"
  $P -m rotkv.cli eval --suite mixed --split dev --profile full --lengths 2048 --windows 2 --new-tokens 64 --threads 1 \
    --methods oscar-refine --sink preset --window preset --artifact-dir $A --out $R/dev-t$N-kw8 > $R/eval-$N-kw8.log 2>&1 || echo "eval $N failed"
  echo "[$(date -u +%T)] $N done"
done
