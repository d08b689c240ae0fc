"""Which backend rotkv.cache.layer.attention_lse takes on this GPU, and its error against float32 math.

    python studies/check_lse_backend.py   # prints one line per shape (GQA and not, causal and not)
"""

import torch

import rotkv.cache.layer as L

torch.manual_seed(0)
for hq, h, c, n, causal in [(9, 3, 256, 256, True), (9, 3, 256, 1024, False), (32, 8, 512, 2048, False),
                            (32, 8, 512, 512, True)]:
    q = torch.randn(2, hq, c, 64 if hq == 9 else 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, h, n, q.shape[-1], device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    o, lse = L.attention_lse(q, k, v, causal, 0.125)
    ro, rl = L.attention_lse(q.cpu().float(), k.cpu().float(), v.cpu().float(), causal, 0.125)
    print(f"hq={hq} h={h} c={c} n={n} causal={causal}: out err {(o.cpu().float() - ro).abs().max():.2e}, "
          f"lse err {(lse.cpu() - rl).abs().max():.2e}, refused: {L._LSE_FAILED or 'none'}", flush=True)
