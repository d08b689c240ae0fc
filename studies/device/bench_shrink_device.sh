#!/usr/bin/env bash
# The one device run of the progressive-cache study: shrink cost of an 8K-token body per layer on the GPU (and a
# 128K-token body, and the device's idle 16-core CPU for comparison). Writes JSON into $OUT.
set -u
export PYTHONPATH=.
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name())'
python3 studies/bench_shrink.py --device cuda --tokens 8192 --warmup 5 --repeats 30 --out "$OUT/bench_shrink_cuda_8k.json"
python3 studies/bench_shrink.py --device cuda --tokens 131072 --warmup 3 --repeats 15 --out "$OUT/bench_shrink_cuda_128k.json"
python3 studies/bench_shrink.py --device cpu --threads 16 --tokens 8192 --warmup 2 --repeats 11 --out "$OUT/bench_shrink_devcpu16_8k.json"
