#!/bin/bash
# One device call (third decode session, after device_decode4.sh): the value-accumulator
# flush (cuda_value_flush) with bf16 and fp16 value products: the CUDA kernel grid, error against
# the float32 reference, and bench_decode.py at the Qwen3-8B shape. Run from the tree's root.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
mkdir -p $OUT
timeout 110 python3 studies/decode_error.py --batch 8 --context 32768 --configs cuda-bf16v cuda-bf16v-f8 \
  cuda-vf16 cuda-vf16-f4 cuda-vf16-f8 cuda-vf16-f16 --out $OUT/error.json > $OUT/error.log 2>&1
echo "error rc=$?"; python3 -c "
import json; [print(r['q_scale'], r['config'], '%.5f' % r['rel_err'], '%.5f' % r['max_abs']) for r in json.load(open('$OUT/error.json'))]"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_kernels.py -k "cuda_kernel_matches" \
  > $OUT/tests.log 2>&1; echo "tests rc=$?"; grep -E "passed|failed|FAILED|Error" $OUT/tests.log | tail -12
timeout 200 python3 benchmarks/bench_decode.py --configs default cuda-bf16v-f8 cuda-vf16 cuda-vf16-f8 cuda-vf16-f16 \
  --out $OUT/decode.json > $OUT/decode.log 2>&1; echo "decode rc=$?"
python3 benchmarks/decode_table.py $OUT/decode.json
