"""What a cache holds for the demo's prompt: ``RotkvCache.stats()`` after the demo's run (a fact in
``--tokens`` tokens of text, the question, 10 new tokens), per preset, on the default model.

    python benchmarks/resident_memory.py --presets bf16 oscar-mix --artifact oscar-mix=oscar-mix.safetensors \
        --out benchmarks/results/resident_memory.json
    PYTHONPATH=/tmp/base python benchmarks/resident_memory.py ...   # an older checkout (no resident_bytes:
                                                                    # pool_bytes + scratch_bytes)

Per preset: kv_bytes (the stored tokens' bytes), pool_bytes (the pools' capacity), scratch_bytes (what a
reader keeps beside them), resident_bytes (what the process holds for the cache), the decode speed and
the answer; then each preset's resident bytes over bf16's. One JSON object.
"""

from __future__ import annotations

import argparse
import json
import time


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["bf16", "oscar-mix"])
    ap.add_argument("--artifact", nargs="*", default=[], metavar="PRESET=FILE", help="an artifact per preset")
    ap.add_argument("--tokens", type=int, default=2048, help="the demo's context length (default 2048)")
    ap.add_argument("--new-tokens", type=int, default=10)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    a = ap.parse_args(argv)
    artifacts = dict(x.split("=", 1) for x in a.artifact)

    import torch

    import rotkv
    from rotkv.cache import RotkvCache
    from rotkv.cli.demo import build_prompt
    from rotkv.generation import generate
    from rotkv.hf.models import load_model

    loaded = load_model(None)
    ctx, ids = build_prompt(loaded.tokenizer, a.tokens, 0.5, "4729")
    rows = {}
    for name in a.presets:
        cache = RotkvCache(loaded.model, name, artifacts.get(name), context_length=ids.shape[1] + a.new_tokens)
        t0 = time.perf_counter()
        g = generate(loaded.model, loaded.tokenizer, ids, cache, max_new_tokens=a.new_tokens, context=ctx)
        st = cache.stats()
        rows[name] = {
            "elements": int(st["elements"]),
            "kv_bytes": int(st["kv_bytes"]), "pool_bytes": int(st["pool_bytes"]),
            "scratch_bytes": int(st["scratch_bytes"]),
            "resident_bytes": int(st.get("resident_bytes", st["pool_bytes"] + st["scratch_bytes"])),
            "kv_bytes_bf16": int(st["kv_bytes_bf16"]), "decode_tokens_per_s": round(g.decode_tokens_per_s, 2),
            "seconds": round(time.perf_counter() - t0, 1), "answer": g.text.strip()[:40],
        }
        print(name, rows[name], flush=True)
    out = {"prompt_tokens": int(ids.shape[1]), "context_tokens": int(ctx.shape[1]), "new_tokens": a.new_tokens,
           "rotkv": rotkv.__file__, "torch": torch.__version__, "threads": torch.get_num_threads(), "presets": rows}
    if "bf16" in rows:
        out["resident_vs_bf16"] = {n: round(r["resident_bytes"] / rows["bf16"]["resident_bytes"], 3)
                                   for n, r in rows.items()}
    print(json.dumps(out))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
