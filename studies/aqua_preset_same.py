"""Per window, are two ``rotkv eval --suite`` runs of one method the same (KL, NLL, top-1, measured bytes)? Prints
one line per domain and window and a count; used to check the oscar-aqua preset with the simulation's arithmetic
(studies/aqua_preset_arith.py) against the simulation's own runs (studies/aqua_cache.py).

    PYTHONPATH=. python studies/aqua_preset_same.py docs/results/levers-aqua/test-aqua:oscar-refine \\
        docs/results/aqua-preset/test-study-arith:oscar-aqua
"""
import json
import sys

DOMAINS = ("prose", "code", "docs", "dialogue")


def record(folder, method, domain):
    with open(f"{folder}/{domain}/results.json") as f:
        return next(r for r in json.load(f)["records"] if r["method"] == method)


def main(a, b):
    (fa, ma), (fb, mb) = a.rsplit(":", 1), b.rsplit(":", 1)
    same = total = 0
    for d in DOMAINS:
        ra, rb = record(fa, ma, d), record(fb, mb, d)
        for w, (ka, kb) in enumerate(zip(ra["per_window"]["kl"], rb["per_window"]["kl"])):
            eq = all(ra["per_window"][k][w] == rb["per_window"][k][w] for k in ("kl", "nll", "top1"))
            eq = eq and ra["kv_bytes"] == rb["kv_bytes"]
            same += eq
            total += 1
            print(f"{d} window {w}: KL {ka:.10f} vs {kb:.10f} {'identical' if eq else 'DIFFERENT'}")
    print(f"{same}/{total} windows identical (KL, NLL, top-1 and measured bytes)")


if __name__ == "__main__":
    main(*sys.argv[1:3])
