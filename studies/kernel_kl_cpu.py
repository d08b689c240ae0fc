"""The GPU = CPU test's bound, measured on the CPU: on SmolLM2 (float32), the KL of the kernel path (the Triton
kernels under TRITON_INTERPRET=1) against the float32 PyTorch path, beside the KL of the PyTorch path with every
attention output (o_proj's input) rounded to bf16 (tests/kernels/test_gpu_equals_cpu.py's yardstick), over the
prose dev text: a context prefilled through the cache, then teacher-forced tokens one per call.

    PYTHONPATH=. TRITON_INTERPRET=1 python studies/kernel_kl_cpu.py --context 512 --new 9   # about 13 minutes
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

from rotkv import switches  # noqa: E402
from rotkv.kernels import plan as kernel_plan  # noqa: E402

# quarot-int2 as it is, and with oscar-refine's tiers (no artifact needed)
SPECS = {"quarot-int2": {}, "quarot-int2+refine": dict(sink=4, refine_tokens=224, refine_values=True, refine_every=19)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=9)
    args = ap.parse_args()
    kernel_plan.kernels_enabled = lambda t: switches.get().kernels  # the kernels for CPU tensors
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
    import test_gpu_equals_cpu as gpu_test

    from rotkv.eval.suite import suite_texts
    from rotkv.hf.models import load_model

    loaded = load_model(os.environ.get("ROTKV_GGUF") or None, device="cpu", dtype=torch.float32)
    text = open(suite_texts("mixed", "dev")["prose"], encoding="utf-8").read()
    ids = torch.tensor(loaded.tokenizer(text, add_special_tokens=False).input_ids[: args.context + args.new])[None]
    run = dict(context=args.context, new=args.new)
    for name, over in SPECS.items():
        os.environ["ROTKV_KERNELS"] = "0"
        switches.reload()
        ref = gpu_test.path_logps(loaded, "quarot-int2", None, ids, **run, **over)
        rounded = gpu_test.path_logps(loaded, "quarot-int2", None, ids, round_attention=True, **run, **over)
        os.environ["ROTKV_KERNELS"] = "1"
        switches.reload()
        t0 = time.time()
        kernel = gpu_test.path_logps(loaded, "quarot-int2", None, ids, **run, **over)
        yard, got = gpu_test.kl(ref, rounded), gpu_test.kl(ref, kernel)
        print(f"{name}, {args.context} + {args.new} tokens: KL(float32 || attention rounded to bf16) mean "
              f"{yard.mean():.3e} max {yard.max():.3e}; KL(float32 || kernel) mean {got.mean():.3e} max "
              f"{got.max():.3e}; ratio mean {got.mean() / yard.mean():.3f} max {got.max() / yard.max():.3f}; argmax "
              f"agreement {(ref.argmax(-1) == kernel.argmax(-1)).float().mean():.3f} ({time.time() - t0:.0f} s "
              f"kernel path)", flush=True)


if __name__ == "__main__":
    main()
