set -e
cd /work/main
M=/tmp/gemma3.gguf; A=/tmp/gart
export OMP_NUM_THREADS=1
P=.venv/bin/python
echo "[$(date +%T)] calibrate"
$P -m rotkv.cli calibrate --model $M --method oscar --tokens 8192 --out $A/oscar.safetensors
echo "[$(date +%T)] keybits"
$P -m rotkv.cli calibrate --method oscar-mix --model $M --base-artifact $A/oscar.safetensors --key-layers 1 --key-length 1024 --key-new-tokens 16 --out $A/oscar-mix.safetensors
echo "[$(date +%T)] longfit"
$P -m rotkv.cli calibrate --method oscar-mix-long --model $M --base-artifact $A/oscar-mix.safetensors --long-seq-len 4096 --long-sequences 2 --out $A/oscar-mix-long.safetensors
echo "[$(date +%T)] eval refine"
$P -m rotkv.cli eval --model $M --profile full --window 32 --tasks nll,niah --lengths nll=2048 niah=1024,2048 --windows 4 --new-tokens 64 --variants essay,multikey --depths 0.1,0.5,0.9 --samples 2 --methods oscar-refine --artifact-dir $A --threads 1 --out /tmp/gemrun/eval-refine
echo "[$(date +%T)] eval refine, the preset of 2026-12-05 at its own sink"
$P -m rotkv.cli eval --model $M --profile full --sink preset --window 32 --tasks nll,niah --lengths nll=2048 niah=1024,2048 --windows 4 --new-tokens 64 --variants essay,multikey --depths 0.1,0.5,0.9 --samples 2 --methods oscar-refine --artifact-dir $A --threads 1 --out /tmp/gemrun2/eval-refine
echo "[$(date +%T)] eval others"
$P -m rotkv.cli eval --model $M --profile full --sink 16 --window 32 --tasks nll,niah --lengths nll=2048 niah=1024,2048 --windows 4 --new-tokens 64 --variants essay,multikey --depths 0.1,0.5,0.9 --samples 2 --methods int4,oscar-mix,oscar-mix-long --artifact-dir $A --threads 1 --out /tmp/gemrun/eval-others
echo "[$(date +%T)] done"
