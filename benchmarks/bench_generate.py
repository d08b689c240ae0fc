"""End-to-end generation benchmark (the same as `rotkv bench`): prefill B x L tokens, then greedy
decode, rotkv against transformers' DynamicCache and compiled StaticCache in one run.

    python benchmarks/bench_generate.py --batch 1 64 --context 4096 8192 --sink 16 --window 64
    python benchmarks/bench_generate.py --random qwen3-8b --layers 4 --batch 8 --context 32768

Writes benchmarks/results/generate-<UTC time>.json (one row per method and shape).
"""

import sys

from rotkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
