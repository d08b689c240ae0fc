"""The refine tier's kernel path against its PyTorch path on the CPU (the Triton kernels under TRITON_INTERPRET=1),
on the model and batch of tests/kernels/test_refine_kernel.py's CUDA-graph test, where an H200 saw the eager
PyTorch path part from the kernel at step 7 of row 0 (greedy agreement 0.725).

Three paths, each a greedy (or teacher-forced) decode of ``--new`` tokens after 3 x 300 prompt tokens (row 1
left-padded by 37) on a random 2-layer bf16 Llama (seed 0, the same weights the GPU test builds):
- ``float32``: the PyTorch path as the CPU runs it (dense attention in float32);
- ``bf16``: the PyTorch path as the GPU runs it (dense attention in bf16: `_attend_dense` with the GPU's dtype);
- ``kernel``: the Triton v1 decode kernel reading the refine rings.
Printed: each path's greedy tokens against float32's (first differing step per row, agreement); the float32
path's top-2 logits where a path parts; teacher-forced on float32's tokens, the kernel's and bf16's logit
differences; per layer and decode step on the kernel run's own state, the relative error of the kernel's and the
bf16 path's attention output against float32's, beside the float32 output rounded to bf16; the rings' sizes.

    PYTHONPATH=. TRITON_INTERPRET=1 python studies/refine_step7.py     # the test's cache (about 7 minutes)
    PYTHONPATH=. TRITON_INTERPRET=1 python studies/refine_step7.py --tiers preset --lens 640,300,520
"""

from __future__ import annotations

import argparse
import inspect
import os
import textwrap

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

from rotkv import switches  # noqa: E402
from rotkv.kernels import plan as kernel_plan  # noqa: E402

TIERS = {
    # test_cuda_graph_decode_with_a_refine_tier_matches_eager's cache (quarot-int2)
    "test": dict(sink=4, window=32, page_size=16, prefill_chunk=128, refine_tokens=64),
    # oscar-refine's tiers on quarot-int2 (no artifact): keys and values, the size rule
    "preset": dict(sink=4, window=32, window_share=1 / 64, refine_tokens=224, refine_values=True, refine_every=19),
}


def graph_llama():
    """tests/kernels/test_backend.py's _graph_llama, on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      intermediate_size=512, num_hidden_layers=2, vocab_size=512, pad_token_id=0)
    return LlamaForCausalLM(cfg).bfloat16().eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiers", choices=sorted(TIERS), default="test")
    ap.add_argument("--lens", default="300,263,300", help="real prompt tokens per row (left padded to the longest)")
    ap.add_argument("--new", type=int, default=40)
    args = ap.parse_args()

    # the kernels for CPU tensors (as tests/conftest.py's kernels_on_cpu)
    kernel_plan.kernels_enabled = lambda t: switches.get().kernels
    from rotkv.cache import RotkvCache
    from rotkv.cache import layer as layer_mod
    from rotkv.generation import cache_kwarg, prefill, reserve

    Layer = layer_mod.HybridLayer
    # the PyTorch path as on the GPU: the same method with its dtype choice taken for a CUDA query
    src = textwrap.dedent(inspect.getsource(Layer._attend_dense)).replace("query.is_cuda", "True")
    ns = dict(vars(layer_mod))
    exec(src, ns)
    dense_f32, dense_bf16 = Layer._attend_dense, ns["_attend_dense"]
    kernel_query, attend_kernel = Layer._kernel_query, Layer._attend_kernel
    records = []

    def kq(self, query):
        self._study_query = query
        return kernel_query(self, query)

    def ak(self, step, q, scaling, plan):  # the kernel, and both PyTorch paths on the same state
        o = attend_kernel(self, step, q, scaling, plan).float()
        f32 = dense_f32(self, step, self._study_query, scaling)[:, :, 0].float()
        b16 = dense_bf16(self, step, self._study_query, scaling)[:, :, 0].float()
        rel = lambda x: ((x - f32).norm(dim=(-1, -2)) / f32.norm(dim=(-1, -2)))  # noqa: E731
        rings = self.pools.tiers[0].pages if self.pools.tiers else 0
        records.append((rel(o), rel(b16), rel(f32.bfloat16().float()), rings, step.body_count.max()))
        return o.to(q.dtype)

    model = graph_llama()
    lens = [int(x) for x in args.lens.split(",")]
    b, t = len(lens), max(lens)
    ids = torch.randint(1, 512, (b, t), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(t)[None] >= torch.tensor([t - n for n in lens])[:, None]).long()

    def run(path: str, forced=None, study=False):
        os.environ["ROTKV_KERNELS"] = "1" if path == "kernel" else "0"
        switches.reload()
        Layer._attend_dense = dense_bf16 if path == "bf16" else dense_f32
        if study:
            Layer._kernel_query, Layer._attend_kernel = kq, ak
        try:
            cache = RotkvCache(model, "quarot-int2", check_finite=False, **TIERS[args.tiers])
            reserve(cache, b, t + args.new)
            kw, m = cache_kwarg(model), mask
            with torch.inference_mode():
                logits = [prefill(model, ids, cache, m, None, None).float()]
                toks = []
                for i in range(args.new):
                    tok = logits[-1].argmax(-1) if forced is None else forced[:, i]
                    toks.append(tok)
                    m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
                    out = model(input_ids=tok[:, None], attention_mask=m, position_ids=(m.sum(-1) - 1)[:, None],
                                use_cache=True, **{kw: cache})
                    logits.append(out.logits[:, -1].float())
        finally:
            Layer._attend_dense, Layer._kernel_query, Layer._attend_kernel = dense_f32, kernel_query, attend_kernel
        return torch.stack(toks, 1), torch.stack(logits[:-1], 1)

    f32_tok, f32_lg = run("float32")
    print(f"tiers {args.tiers} {TIERS[args.tiers]}, rows {lens}, {args.new} new tokens")
    top2 = f32_lg.topk(2, -1)
    for path in ("bf16", "kernel"):
        tok, _ = run(path)
        for r in range(b):
            d = (tok[r] != f32_tok[r]).nonzero()
            at = int(d[0]) if len(d) else None
            where = "" if at is None else (f" (float32's top-2 logits there {top2.values[r, at].tolist()}, "
                                           f"tokens {top2.indices[r, at].tolist()})")
            print(f"greedy {path} vs float32, row {r}: first differing step {at}{where}")
        print(f"greedy {path} vs float32: agreement {(tok == f32_tok).float().mean():.3f}")
    margin = top2.values[..., 0] - top2.values[..., 1]
    for path in ("bf16", "kernel"):
        _, lg = run(path, forced=f32_tok, study=path == "kernel")
        dl = (lg - f32_lg).abs().amax(-1)
        print(f"teacher-forced {path}: |logit - float32's| median {dl.median():.4f} max {dl.max():.4f}; float32's "
              f"logit std {f32_lg.std(-1).mean():.3f}; steps with float32's top-2 within 0.0079: "
              f"{(margin <= 0.0079).sum().item()} of {margin.numel()}")
    k, b16, rnd = (torch.stack([rec[i] for rec in records]) for i in range(3))
    print(f"per layer and decode step (kernel run's state), relative error against float32: kernel mean {k.mean():.2e} "
          f"max {k.max():.2e}; bf16 PyTorch path mean {b16.mean():.2e} max {b16.max():.2e}; float32 rounded to bf16 "
          f"mean {rnd.mean():.2e} max {rnd.max():.2e}; ring slots seen {sorted({rec[3] for rec in records})}, "
          f"longest row's body pages {min(rec[4] for rec in records)}..{max(rec[4] for rec in records)}")


if __name__ == "__main__":
    main()
