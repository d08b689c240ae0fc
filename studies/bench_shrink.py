"""Cost of shrinking a progressive body one step (16 -> 8 -> 4 -> 2), and amortized per token.

One layer's body of ``--tokens`` tokens (keys and values, ``[pages, H, P, D]``, SmolLM2's
3 KV heads x 64 dims by default) is shrunk by the equivalent right shift (unpack, integer
shift, pack). Measured in the same run, for scale: dequantizing the same body once (what the
reference read path does at every decode step) and quantizing it at that width.

Amortized: a layer whose budget holds ``--tokens`` tokens at ``--final`` bits shrinks when its
body reaches ``n_b = body(tokens at final) / row_bytes(b)`` tokens at width b; each shrink is
timed at that body size. Cost per generated token = layers x sum of shrink times / tokens.

Timing: medians over ``--repeats`` after ``--warmup``, CUDA events on the GPU. Needs only torch:

    PYTHONPATH=. python studies/bench_shrink.py --device cpu --out bench_shrink_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rotkv.quant.progressive import (
    ProgressiveRows,
    anchor_dtype,
    dequantize_progressive,
    quantize_at,
    quantize_progressive,
    shrink_stored,
    step_factor,
)


MINIMA: list[float] = []


def timed(fn, device: str, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()`` (the minimum is kept too, in ``MINIMA``: on a shared CPU it is
    the better estimate of the cost itself)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    MINIMA.append(min(times))
    return statistics.median(times)


def body_at(x: torch.Tensor, bits: int, final: int, group: int) -> ProgressiveRows:
    """``x [nb, H, P, D]`` written at 16 bits and shrunk to ``bits`` (the state a body is in)."""
    q = quantize_progressive(x, 16, final, group)
    while q.bits > bits:
        c = q.bits // 2
        q = ProgressiveRows(shrink_stored(q.codes, q.bits), q.scale, q.lo, c, q.mult * step_factor(c, "equivalent"), q.div, group)
    return q


def measure_step(x_k, x_v, bits, final, group, device, warmup, repeats) -> dict:
    """One layer (keys and values) at ``bits``: shrink to bits/2, dequantize once, quantize once."""
    qk, qv = body_at(x_k, bits, final, group), body_at(x_v, bits, final, group)
    shrink = timed(lambda: (shrink_stored(qk.codes, bits), shrink_stored(qv.codes, bits)), device, warmup, repeats)
    shrink_min = MINIMA[-1]
    deq = timed(lambda: (dequantize_progressive(qk), dequantize_progressive(qv)), device, warmup, repeats)
    dt = anchor_dtype(16, final, "final")
    quant = timed(lambda: (quantize_at(x_k, bits, qk.mult, qk.div, dt, group), quantize_at(x_v, bits, qv.mult, qv.div, dt, group)),
                  device, warmup, repeats)
    moved = 2 * x_k.numel() * (bits + bits // 2) / 8  # codes read at bits, written at bits/2, K and V
    return {"from_bits": bits, "tokens": x_k.shape[0] * x_k.shape[2], "shrink_s": shrink, "dequantize_s": deq,
            "quantize_s": quant, "shrink_min_s": shrink_min, "shrink_GBps": moved / shrink / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--final", type=int, default=2, choices=[2, 4, 8])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    mk = lambda n: torch.randn(n // a.page_size, a.heads, a.page_size, a.head_dim, generator=g).to(a.device)  # noqa: E731
    widths = [b for b in (16, 8, 4) if b // 2 >= a.final]
    at_full = [measure_step(mk(a.tokens), mk(a.tokens), b, a.final, a.group_size, a.device, a.warmup, a.repeats) for b in widths]
    # where each shrink happens in a run whose budget holds a.tokens at a.final (body share only)
    row = lambda b: a.head_dim * b / 8 + 2 * (a.head_dim // a.group_size) * anchor_dtype(16, a.final, "final").itemsize  # noqa: E731
    at_point = []
    for b in widths:
        n = max(a.page_size, int(a.tokens * row(a.final) / row(b)) // a.page_size * a.page_size)
        at_point.append(measure_step(mk(n), mk(n), b, a.final, a.group_size, a.device, a.warmup, a.repeats))
    total = a.layers * sum(s["shrink_s"] for s in at_point)
    out = {"device": torch.cuda.get_device_name() if a.device == "cuda" else f"cpu ({a.threads} threads)",
           "torch": torch.__version__, "config": vars(a), "full_body": at_full, "at_shrink_points": at_point,
           "shrinks_total_s_all_layers": total, "amortized_s_per_token": total / a.tokens}
    for s in at_full:
        print(f"{a.device} {s['tokens']} tokens {s['from_bits']:>2}->{s['from_bits'] // 2}: shrink {s['shrink_s'] * 1e3:8.3f} ms "
              f"({s['shrink_GBps']:.2f} GB/s)  dequantize {s['dequantize_s'] * 1e3:8.3f} ms  quantize {s['quantize_s'] * 1e3:8.3f} ms")
    for s in at_point:
        print(f"  shrink point {s['from_bits']:>2}->{s['from_bits'] // 2} at {s['tokens']} body tokens: {s['shrink_s'] * 1e3:.3f} ms")
    total_min = a.layers * sum(s["shrink_min_s"] for s in at_point)
    out |= {"shrinks_total_min_s_all_layers": total_min, "amortized_min_s_per_token": total_min / a.tokens}
    print(f"all {a.layers} layers, a run to {a.tokens} tokens at final {a.final} bits: shrinks {total * 1e3:.1f} ms in all, "
          f"{total / a.tokens * 1e6:.2f} us per generated token (minima: {total_min * 1e3:.1f} ms, {total_min / a.tokens * 1e6:.2f} us)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
