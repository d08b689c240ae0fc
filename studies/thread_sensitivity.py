"""How far a preset's CPU generation moves with the thread count (why the real-model batch test runs at
one thread, tests/test_real_model.py).

The same prompt (150 held-out tokens) is generated greedily alone at 1 and at 2 threads, twice at 2
threads, and as a batch of the row twice at 2 threads; per step, the largest |logit difference|
against the lone 2-thread run. A float32 GEMM blocks its reductions by rows and threads; INT2 can
turn such a last-bit difference into another code.

    PYTHONPATH=.:tests python studies/thread_sensitivity.py --presets bf16 quarot-int2
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    from rotkv.cache import RotkvCache
    from rotkv.hf.compat import cache_kwarg
    from rotkv.hf.models import load_model
    from test_real_model import eval_ids

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=["bf16", "quarot-int2"])
    ap.add_argument("--tokens", type=int, default=150)
    ap.add_argument("--new-tokens", type=int, default=6)
    a = ap.parse_args(argv)
    loaded = load_model()
    model, tok = loaded.model, loaded.tokenizer
    x = eval_ids(tok, a.tokens)[0]
    gen = dict(max_new_tokens=a.new_tokens, do_sample=False, output_scores=True, return_dict_in_generate=True,
               pad_token_id=tok.pad_token_id)
    kw = dict(sink=8, window=16, page_size=8, prefill_chunk=64)  # the batch test's cache
    threads = torch.get_num_threads()
    for preset in a.presets:
        def run(n: int, rows: int = 1):
            torch.set_num_threads(n)
            ids = x[None].expand(rows, -1)
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **gen,
                                  **{cache_kwarg(model): RotkvCache(model, preset, **kw)})

        one, two, again, pair = run(1), run(2), run(2), run(2, 2)
        torch.set_num_threads(threads)

        def diff(p, row=0):
            return [round((s[row].float() - t[0].float()).abs().max().item(), 4) for s, t in zip(p.scores, two.scores)]

        same = lambda p: p.sequences[0, a.tokens:].tolist() == two.sequences[0, a.tokens:].tolist()  # noqa: E731
        print(f"{preset}: max |logits - alone at 2 threads| per step")
        for name, p in (("alone, 2 threads again", again), ("alone, 1 thread", one), ("batch of 2, 2 threads", pair)):
            print(f"  {name:24s} {diff(p)}  same greedy tokens: {same(p)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
