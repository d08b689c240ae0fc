"""Greedy tokens of vLLM + rotkv's backend against rotkv's transformers path, on the real SmolLM2.

The same prompt token ids (``--context`` tokens of the project's held-out text,
rotkv/data/eval_python_reference.txt, repeated if short), the same preset, artifact, sink and window, and
``--new`` greedy tokens (ignore_eos) on each side:

- vLLM: ``LLM(model=<SmolLM2 dir>, attention_backend="CUSTOM", additional_config={"rotkv": {...}})`` (the
  directory ``bench_vllm.py prepare`` writes: rotkv's own float32 conversion of the GGUF, loaded as bf16),
  ``logprobs=2`` per step;
- transformers: ``rotkv.generation.generate`` with ``make_cache(model, preset, artifact, sink=, window=)``
  on the same converted weights (bf16 on CUDA), plus a ``model.generate(output_scores=True)`` run with a
  fresh cache for the top-2 logit gaps.

``bf16`` compares vLLM's default backend with transformers' own cache: the divergence the two engines'
bf16 arithmetic orders alone give. At the first differing step the JSON holds both sides' top-2 gaps: a
divergence where the transformers path's top-2 gap is small (a near tie) is what reordered bf16 sums
explain; a large gap is a real difference. Each vLLM engine and the transformers side run in their
own subprocesses (GPU memory).

    python benchmarks/vllm_greedy_compare.py --model-dir ~/vllm-models/smollm2 --methods bf16,quarot-int2,oscar-mix \
        --artifact-dir artifacts --sink 16 --window 32 --out $OUT/greedy.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))
TEXT = HERE.parent / "rotkv" / "data" / "eval_python_reference.txt"


def prompt_ids(tokenizer, n: int, text_path: Path = TEXT) -> list[int]:
    """The first ``n`` token ids of the held-out text (repeated until long enough), no special tokens."""
    ids = tokenizer(text_path.read_text(), add_special_tokens=False)["input_ids"]
    if not ids:
        raise ValueError(f"{text_path} gives no tokens")
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def rotkv_config(method: str, args) -> dict:
    """additional_config["rotkv"] (and make_cache's arguments) of one method."""
    cfg: dict = {"preset": method}
    art = artifact_for(method, args.artifact_dir)
    if art:
        cfg["artifact"] = art
    if args.sink is not None:
        cfg["sink"] = args.sink
    if args.window is not None:
        cfg["window"] = args.window
    return cfg


def artifact_for(method: str, artifact_dir: str | None) -> str | None:
    """``<artifact_dir>/<preset>.safetensors`` for presets that take an artifact (rotation="artifact")."""
    from rotkv.config import get_preset

    spec = get_preset(method)
    if getattr(spec, "rotation", None) != "artifact":
        return None
    if not artifact_dir:
        raise ValueError(f"preset {method} needs a calibration artifact: pass --artifact-dir")
    p = Path(artifact_dir) / f"{method}.safetensors"
    if not p.exists():
        raise FileNotFoundError(f"no artifact {p} for preset {method}")
    return str(p.resolve())


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where the two token lists differ (a length difference counts), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def recorded_vllm_side(folder: Path, methods: list[str]) -> tuple[dict, dict]:
    """(the spec, {method: result}) of an earlier run's vLLM side in ``folder``; every method must be there, and
    every spec must hold the same prompt ids."""
    spec, results = None, {}
    for sp in sorted(folder.glob("greedy-spec_vllm-*.json")):
        res = sp.with_name(sp.name.replace("spec", "result"))
        if not res.exists():
            continue
        s = json.loads(sp.read_text())
        if spec is not None and s["ids"] != spec["ids"]:
            raise ValueError(f"{sp} has other prompt ids than the folder's first spec")
        spec = spec or s
        results.update(json.loads(res.read_text()))
    missing = [m for m in methods if m not in results]
    if spec is None or missing:
        raise FileNotFoundError(f"{folder}: no recorded vLLM result for {missing or methods}")
    return spec, {m: results[m] for m in methods}


def side_vllm(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    out = {}
    for method in spec["methods"]:
        kw = dict(model=spec["model_dir"], dtype="bfloat16", max_model_len=spec["context"] + spec["new"] + 16,
                  enable_prefix_caching=False, gpu_memory_utilization=spec["gpu_memory_utilization"], seed=0,
                  enforce_eager=spec["enforce_eager"])
        if method != "bf16":
            from rotkv.integrations.vllm import register

            register()
            kw.update(attention_backend="CUSTOM", block_size=16, additional_config={"rotkv": spec["configs"][method]})
        llm = LLM(**kw)
        sp = SamplingParams(temperature=0.0, max_tokens=spec["new"], ignore_eos=True, logprobs=2)
        o = llm.generate([{"prompt_token_ids": spec["ids"]}], sp, use_tqdm=False)[0].outputs[0]
        gaps = []
        for step in o.logprobs or []:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            gaps.append(round(top[0] - top[1], 5) if len(top) > 1 else None)
        out[method] = dict(tokens=list(o.token_ids), top2_logprob_gap=gaps, engine_kwargs=kw)
    return out


def side_rotkv(spec: dict) -> dict:
    import torch

    from rotkv.cache.cache import make_cache
    from rotkv.generation import generate
    from rotkv.hf.compat import cache_kwarg
    from rotkv.hf.models import load_model

    loaded = load_model(spec["gguf"], device=spec.get("rotkv_device", "cuda"), dtype=torch.bfloat16)
    model, tok = loaded.model, loaded.tokenizer
    ids = torch.tensor([spec["ids"]], device=model.device)
    out = {}
    for method in spec["methods"]:
        cfg = dict(spec["configs"].get(method, {}))
        cfg.pop("preset", None)
        art = cfg.pop("artifact", None)
        if method == "bf16":
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec["new"],
                               min_new_tokens=spec["new"], do_sample=False, output_scores=True,
                               return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
            tokens = g.sequences[0, ids.shape[1]:].tolist()
            scores = g.scores
        else:
            tokens = generate(model, tok, ids, make_cache(model, method, art, **cfg), max_new_tokens=spec["new"]).new_tokens
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=spec["new"],
                               min_new_tokens=spec["new"], do_sample=False, output_scores=True,
                               return_dict_in_generate=True, pad_token_id=tok.pad_token_id,
                               **{cache_kwarg(model): make_cache(model, method, art, **cfg)})
            scores = g.scores
        gaps = []
        for s in scores:
            lp = torch.log_softmax(s[0].float(), -1)
            top = lp.topk(2).values.tolist()
            gaps.append(round(top[0] - top[1], 5))
        out[method] = dict(tokens=tokens, scores_run_tokens=g.sequences[0, ids.shape[1]:].tolist(), top2_logprob_gap=gaps)
    return out


def compare(v: dict, r: dict) -> dict:
    """Per method: equal or not, the first differing step, and both sides' top-2 gaps there."""
    rows = {}
    for method in v:
        a, b = v[method]["tokens"], r[method]["tokens"]
        i = first_divergence(a, b)
        row = dict(equal=i is None, first_divergence=i, agree_prefix=len(a) if i is None else i,
                   vllm_tokens=a, rotkv_tokens=b)
        if i is not None:
            row["vllm_top2_gap_at_divergence"] = v[method]["top2_logprob_gap"][i] if i < len(v[method]["top2_logprob_gap"]) else None
            row["rotkv_top2_gap_at_divergence"] = r[method]["top2_logprob_gap"][i] if i < len(r[method]["top2_logprob_gap"]) else None
        row["rotkv_scores_run_equal"] = r[method].get("scores_run_tokens", b) == b
        # a top-2 gap of exactly 0 at most steps means equal logits: a model vLLM did not load (not a comparison)
        gaps = [x for x in v[method].get("top2_logprob_gap", []) if x is not None]
        row["vllm_zero_gap_steps"] = sum(x == 0 for x in gaps)
        row["vllm_degenerate"] = bool(gaps) and row["vllm_zero_gap_steps"] > len(gaps) // 2
        rows[method] = row
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("_vllm", "_rotkv"):
        spec = json.loads(Path(argv[1]).read_text())
        res = side_vllm(spec) if argv[0] == "_vllm" else side_rotkv(spec)
        Path(argv[2]).write_text(json.dumps(res))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="the SmolLM2 directory `bench_vllm.py prepare` wrote")
    ap.add_argument("--gguf", default=None, help="SmolLM2's GGUF for the transformers side (default: ROTKV_GGUF or the package)")
    ap.add_argument("--methods", default="bf16,quarot-int2,oscar-mix")
    ap.add_argument("--artifact-dir", default=None)
    ap.add_argument("--sink", type=int, default=None)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--vllm-from", default=None, help="a folder of an earlier run's greedy-spec_vllm-*.json and "
                    "greedy-result_vllm-*.json: compare those vLLM tokens (same prompt ids) instead of starting engines")
    ap.add_argument("--rotkv-device", default="cuda", help="device of the transformers side (bf16 weights on any)")
    args = ap.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    sides = {"_vllm": {}, "_rotkv": {}}
    if args.vllm_from:
        spec, sides["_vllm"] = recorded_vllm_side(Path(args.vllm_from), methods)
        configs = {}
        for m in methods:  # the recorded settings, with this machine's artifact where the preset reads one
            if m != "bf16":
                art = artifact_for(m, args.artifact_dir)
                configs[m] = dict(spec["configs"][m], **({"artifact": art} if art else {}))
        spec = dict(spec, methods=methods, gguf=args.gguf or os.environ.get("ROTKV_GGUF"), configs=configs)
        args.context, args.new = spec["context"], spec["new"]
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
        spec = dict(model_dir=str(Path(args.model_dir).resolve()), gguf=args.gguf or os.environ.get("ROTKV_GGUF"),
                    methods=methods, ids=prompt_ids(tok, args.context), context=args.context, new=args.new,
                    gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                    configs={m: rotkv_config(m, args) for m in methods if m != "bf16"})
    spec["rotkv_device"] = args.rotkv_device
    work = Path(args.out or "greedy.json").resolve().parent
    work.mkdir(parents=True, exist_ok=True)
    # one process per vLLM engine (an engine's GPU memory is only surely free once its process ends),
    # one for the transformers side
    jobs = [] if args.vllm_from else [("_vllm", [m]) for m in methods]
    jobs += [("_rotkv", methods)]
    for side, ms in jobs:
        sp = work / f"greedy-spec{side}-{len(sides[side])}.json"
        sp.write_text(json.dumps({**spec, "methods": ms}))
        res = sp.with_name(sp.name.replace("spec", "result"))
        rc = subprocess.run([sys.executable, __file__, side, str(sp), str(res)]).returncode
        if rc != 0 or not res.exists():
            raise SystemExit(f"vllm_greedy_compare: the {side[1:]} side failed for {ms} (exit {rc})")
        sides[side].update(json.loads(res.read_text()))
    from results_io import write_results

    data = dict(schema="rotkv-vllm-greedy/1", context=args.context, new=args.new, text=str(TEXT.name),
                rotkv_device=args.rotkv_device, vllm_from=args.vllm_from,
                settings={m: spec["configs"].get(m, {"preset": "bf16"}) for m in methods},
                methods=compare(sides["_vllm"], sides["_rotkv"]))
    for m, row in data["methods"].items():
        print(f"{m}: {'equal' if row['equal'] else 'first divergence at step ' + str(row['first_divergence'])}")
        if row["vllm_degenerate"]:
            print(f"WARNING {m}: vLLM's top-2 log-probs are equal at {row['vllm_zero_gap_steps']} of {args.new} steps: "
                  "its logits are flat, so the model did not load as rotkv's path reads it")
    write_results("vllm-greedy", data, out=args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
