"""KL(fp32 model || method) over teacher-forced decode steps: vLLM + rotkv's backend against rotkv's transformers path.

The held-out text is the mixed suite's test split (rotkv/data/suite/<domain>_test.txt, ``--split``), cut into
``--requests`` windows of ``--prompt-len + --new-tokens`` tokens spread over the domains (rotkv.eval.nll's
window_starts). Per window the first ``--prompt-len`` tokens are the prompt; the next ``--new-tokens`` are
teacher-forced one decode step each, every step reading the stored (quantized) history:

- vLLM: one request per window, ``max_tokens = --new-tokens``; a logits processor (``ForceTextTokens``,
  ids in ``SamplingParams.extra_args["rotkv_forced"]``) leaves only the text's next token, greedy picks it;
  the returned log-probs are the full vocabulary (``logprobs=-1``, ``max_logprobs=-1``) taken before any
  processor (``logprobs_mode="raw_logprobs"``). One request at a time (``max_num_seqs=1``) and a token
  budget of ``--chunk`` make vLLM's prefill chunks those of the transformers side. Custom logits
  processors run only under vLLM's V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0`` is set).
- transformers: ``rotkv.eval.nll.score_window`` (the decode KL of ``rotkv eval``) with the same preset,
  artifact, sink, window and prefill chunk, on the bf16 weights vLLM runs (and, with ``--rotkv-dtypes
  bfloat16,float32``, also on the float32 weights ``rotkv eval`` uses).
- reference: ``rotkv.eval.nll.reference``, the float32 model without a cache over the same tokens.

``ratio`` = vLLM KL / transformers KL (bf16 weights); its interval is a paired bootstrap over windows.
``bf16`` is vLLM's default backend against rotkv's bf16 preset.

    python benchmarks/vllm_kl_compare.py --model-dir ~/vllm-models/smollm2 --gguf smollm2.gguf \
        --methods bf16,quarot-int2,oscar-mix --artifact-dir artifacts --sink 16 --window 32 --out $OUT/kl.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))
from vllm_greedy_compare import rotkv_config  # noqa: E402

FORCED_KEY = "rotkv_forced"


# ---- pure parts (CPU-tested) ------------------------------------------------------------------------------
def forced_row(logits, output_ids: list[int], forced: list[int]):
    """The logits row with every token but ``forced[len(output_ids)]`` at -inf (unchanged past the end)."""
    import torch

    k = len(output_ids)
    if k >= len(forced):
        return logits
    out = torch.full_like(logits, float("-inf"))
    out[forced[k]] = 0.0
    return out


def dense_logprobs(token_ids: list[int], logprobs: list[float], vocab: int):
    """One decode step's returned (token id, log-prob) pairs as a dense float32 ``[vocab]`` array; fails unless
    every id of the vocabulary is there and the distribution sums to one."""
    import numpy as np

    ids = np.asarray(token_ids, dtype=np.int64)
    row = np.full(vocab, np.nan, dtype=np.float32)
    row[ids] = np.asarray(logprobs, dtype=np.float32)
    missing = int(np.isnan(row).sum())
    if missing:
        raise AssertionError(f"a decode step returned log-probs of {vocab - missing} of {vocab} tokens: "
                             "not the full vocabulary (logprobs=-1, max_logprobs=-1)")
    total = float(np.logaddexp.reduce(row.astype(np.float64)))
    if abs(total) > 1e-3:
        raise AssertionError(f"a decode step's log-probs sum to exp({total:.4g}), not 1: not raw_logprobs?")
    if float(row.max() - row.min()) < 1e-4:
        raise AssertionError("a decode step's log-probs are all equal (flat logits): the engine did not load the "
                             "model's weights as the transformers side reads them (tied embeddings?)")
    return row


def kl_rows(ref, logp):
    """Per-row KL(ref || logp) of log-prob arrays ``[N, vocab]`` (score_window's formula, clamped at 0)."""
    import torch

    ref, logp = torch.as_tensor(ref).float(), torch.as_tensor(logp).float()
    if ref.shape != logp.shape:
        raise AssertionError(f"reference log-probs {tuple(ref.shape)} and method log-probs {tuple(logp.shape)} differ")
    return (ref.exp() * (ref - logp)).sum(-1).clamp_min(0)


def mean(xs) -> float:
    return sum(xs) / len(xs)


def bootstrap_ratio(a: list[list[float]], b: list[list[float]], reps: int = 2000, seed: int = 0) -> list[float]:
    """95% interval of mean(a) / mean(b) (pooled tokens) resampling windows, paired: ``a[i]``, ``b[i]`` one window."""
    import numpy as np

    if len(a) != len(b) or not a:
        raise ValueError("bootstrap_ratio needs the same windows on both sides")
    sa = np.array([sum(w) for w in a]); sb = np.array([sum(w) for w in b])
    n = np.array([len(w) for w in a])
    idx = np.random.default_rng(seed).integers(0, len(a), size=(reps, len(a)))
    r = (sa[idx].sum(1) / n[idx].sum(1)) / np.maximum(sb[idx].sum(1) / n[idx].sum(1), 1e-30)
    return [float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))]


def method_row(v: dict, r: dict) -> dict:
    """One method's figures from its per-window per-token KLs: ``v`` the vLLM side, ``r`` {dtype: transformers side}."""
    flat = lambda ws: [x for w in ws for x in w]  # noqa: E731
    vk = mean(flat(v["kl"]))
    row = dict(vllm_kl=vk, vllm_nll=mean(flat(v["nll"])), vllm_top1=mean(flat(v["top1"])),
               n_tokens=len(flat(v["kl"])), windows=len(v["kl"]))
    for dt, side in r.items():
        suffix = "" if dt == "bfloat16" else "_" + {"float32": "fp32"}.get(dt, dt) + "_model"
        rk = mean(flat(side["kl"]))
        if len(flat(side["kl"])) != row["n_tokens"]:
            raise AssertionError(f"the transformers side ({dt}) scored {len(flat(side['kl']))} tokens, vLLM {row['n_tokens']}")
        row["rotkv_kl" + suffix] = rk
        row["rotkv_nll" + suffix] = mean(flat(side["nll"]))
        row["ratio" + suffix] = vk / rk if rk > 0 else math.inf
        row["ratio" + suffix + "_ci95"] = bootstrap_ratio(v["kl"], side["kl"]) if rk > 0 else None
    if "ratio" in row:
        row["within_10pct"] = abs(row["ratio"] - 1.0) <= 0.10
    return row


def windows(tokenizer, split: str, requests: int, prompt_len: int, new_tokens: int) -> list[dict]:
    """``requests`` windows of the mixed suite's ``split``, spread evenly over its domains and within each."""
    from rotkv.eval.nll import window_starts
    from rotkv.eval.suite import suite_texts

    texts = suite_texts("mixed", split)
    out = []
    for i, (domain, path) in enumerate(texts.items()):
        count = requests // len(texts) + (i < requests % len(texts))
        if count == 0:
            continue
        ids = tokenizer(Path(path).read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
        for s in window_starts(len(ids), prompt_len, new_tokens, count):
            out.append(dict(domain=domain, text=os.path.relpath(path, HERE.parent), start=s,
                            ids=ids[s: s + prompt_len + new_tokens]))
    return out


# ---- vLLM side --------------------------------------------------------------------------------------------
try:
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor
except ImportError:  # the CPU tests import this file without vLLM
    AdapterLogitsProcessor = None

if AdapterLogitsProcessor is not None:
    class ForceTextTokens(AdapterLogitsProcessor):
        """Forces each decode step of a request to ``extra_args["rotkv_forced"][step]``."""

        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params):
            forced = (params.extra_args or {}).get(FORCED_KEY)
            if forced is None:
                return None
            return lambda output_ids, logits: forced_row(logits, output_ids, forced)


def engine_kwargs(spec: dict, method: str) -> dict:
    """``LLM(**kw)`` of one method: one request at a time, prefill chunks of ``spec["chunk"]`` tokens, the
    forcing processor, full-vocabulary log-probs from before the processors, rotkv's backend for presets."""
    P, N = spec["prompt_len"], spec["new_tokens"]
    kw = dict(model=spec["model_dir"], dtype="bfloat16", max_model_len=P + N + 16, enable_prefix_caching=False,
              gpu_memory_utilization=spec["gpu_memory_utilization"], seed=0, enforce_eager=spec["enforce_eager"],
              max_num_seqs=1, max_num_batched_tokens=spec["chunk"], enable_chunked_prefill=True,
              async_scheduling=False, max_logprobs=-1, logprobs_mode="raw_logprobs",
              logits_processors=["vllm_kl_compare:ForceTextTokens"])
    if method != "bf16":
        kw.update(attention_backend="CUSTOM", block_size=16, additional_config={"rotkv": spec["configs"][method]})
    return kw


def side_vllm(spec: dict) -> dict:
    import numpy as np
    import torch
    from vllm import LLM, SamplingParams

    assert AdapterLogitsProcessor is not None
    ref = torch.load(spec["ref_path"])  # [R, N, vocab] float32
    P, N = spec["prompt_len"], spec["new_tokens"]
    out = {}
    for method in spec["methods"]:
        kw = engine_kwargs(spec, method)
        if method != "bf16":
            from rotkv.integrations.vllm import register

            register()
        t0 = time.time()
        llm = LLM(**kw)
        print(f"vllm_kl_compare: vLLM {method}: engine up in {time.time() - t0:.0f} s", flush=True)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        if vocab != ref.shape[-1]:
            raise AssertionError(f"vLLM's vocabulary {vocab} != the reference's {ref.shape[-1]}")
        res = dict(kl=[], nll=[], top1=[], engine_kwargs={k: v for k, v in kw.items() if k != "model"})
        for w, win in enumerate(spec["windows"]):
            ids = win["ids"]
            forced = ids[P:P + N]
            sp = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True, logprobs=-1, flat_logprobs=True,
                                detokenize=False, extra_args={FORCED_KEY: forced})
            o = llm.generate([{"prompt_token_ids": ids[:P]}], sp, use_tqdm=False)[0].outputs[0]
            got = list(o.token_ids)
            if got != forced:
                i = next((j for j, (a, b) in enumerate(zip(got, forced)) if a != b), min(len(got), len(forced)))
                raise AssertionError(f"{method} window {w}: the forced tokens are not the text's: first difference at "
                                     f"step {i} of {N} (got {got[i:i + 4]}, text {forced[i:i + 4]}, {len(got)} tokens)")
            lps = o.logprobs
            if lps is None or len(lps) != N:
                raise AssertionError(f"{method} window {w}: {0 if lps is None else len(lps)} logprob steps, want {N}")
            if hasattr(lps, "start_indices"):  # FlatLogprobs
                rows = [dense_logprobs(lps.token_ids[s:e], lps.logprobs[s:e], vocab)
                        for s, e in zip(lps.start_indices, lps.end_indices)]
            else:  # list of {token id: Logprob}
                rows = [dense_logprobs(list(d), [x.logprob for x in d.values()], vocab) for d in lps]
            del lps, o
            lp = torch.from_numpy(np.stack(rows))  # [N, vocab]
            r = ref[w]
            tgt = torch.tensor(forced)
            res["kl"].append(kl_rows(r, lp).tolist())
            res["nll"].append((-lp.gather(-1, tgt[:, None])[:, 0]).tolist())
            res["top1"].append((lp.argmax(-1) == r.argmax(-1)).float().tolist())
        print(f"vllm_kl_compare: vLLM {method}: {len(spec['windows'])} windows in {time.time() - t0:.0f} s, mean KL "
              f"{mean([x for w in res['kl'] for x in w]):.5f}", flush=True)
        out[method] = res
        del llm
    return out


# ---- transformers side ------------------------------------------------------------------------------------
def side_rotkv(spec: dict) -> dict:
    import torch

    from rotkv.eval.methods import Method, nominal_bits
    from rotkv.eval.nll import reference, score_window
    from rotkv.hf.models import load_model

    P, N = spec["prompt_len"], spec["new_tokens"]
    wins = [torch.tensor([w["ids"]]) for w in spec["windows"]]
    out: dict = {m: {} for m in spec["methods"]}
    device = spec["device"]
    ref_model = load_model(spec["gguf"], device=device, dtype=torch.float32).model
    refs = torch.stack([reference(ref_model, w.to(ref_model.device), P, N).cpu() for w in wins])
    if refs.shape != (len(wins), N, refs.shape[-1]):
        raise AssertionError(f"reference log-probs of shape {tuple(refs.shape)}")
    torch.save(refs, spec["ref_path"])
    for dt in spec["rotkv_dtypes"]:
        model = ref_model if dt == "float32" else load_model(spec["gguf"], device=device, dtype=getattr(torch, dt)).model
        for method in spec["methods"]:
            cfg = dict(spec["configs"].get(method, {}))
            cfg.pop("preset", None)
            art = cfg.pop("artifact", None)
            m = Method(method, "rotkv", nominal_bits(method), cfg, art)
            side = dict(kl=[], nll=[])
            t0 = time.time()
            for w, ids in enumerate(wins):
                per, _ = score_window(model, m, ids, P, N, spec["chunk"], refs[w])
                side["kl"].append(per["kl"]); side["nll"].append(per["nll"])
            out[method][dt] = side
            print(f"vllm_kl_compare: transformers {method} ({dt} weights): {len(wins)} windows in {time.time() - t0:.0f} s, "
                  f"mean KL {mean([x for w in side['kl'] for x in w]):.5f}", flush=True)
        del model
    del ref_model
    return out


# ---- driver -----------------------------------------------------------------------------------------------
def run_side(side: str, spec_path: Path, result_path: Path, env: dict) -> int:
    """One side in its own process (an engine's GPU memory is only surely free once its process ends)."""
    return subprocess.run([sys.executable, __file__, side, str(spec_path), str(result_path)], env=env).returncode


def table(rows: dict) -> str:
    lines = [f"{'method':<14} {'vLLM KL':>10} {'rotkv KL':>10} {'ratio':>7} {'95% CI':>16} {'rotkv KL fp32':>14} {'n':>6}"]
    for m, r in rows.items():
        ci = r.get("ratio_ci95") or [math.nan, math.nan]
        lines.append(f"{m:<14} {r['vllm_kl']:>10.5f} {r['rotkv_kl']:>10.5f} {r['ratio']:>7.3f} "
                     f"{'[%.3f, %.3f]' % tuple(ci):>16} {r.get('rotkv_kl_fp32_model', math.nan):>14.5f} {r['n_tokens']:>6}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", required=True, help="the SmolLM2 directory `bench_vllm.py prepare` wrote")
    ap.add_argument("--gguf", default=None, help="SmolLM2's GGUF for the transformers side (default: ROTKV_GGUF or the package)")
    ap.add_argument("--methods", default="bf16,quarot-int2,oscar-mix", help="bf16 and rotkv presets (rotkv: prefix optional)")
    ap.add_argument("--artifact-dir", default=None)
    ap.add_argument("--sink", type=int, default=None)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=8, help="windows of the held-out text (spread over the suite's domains)")
    ap.add_argument("--split", default="test", choices=("dev", "test"), help="the mixed suite's split")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk of both sides (default: --prompt-len, one chunk)")
    ap.add_argument("--rotkv-dtypes", default="bfloat16",
                    help="weights of the transformers side: bfloat16 (what vLLM runs; the ratio's base), "
                         "and float32 (what `rotkv eval` uses) if listed too")
    ap.add_argument("--device", default="cuda", help="device of the transformers side")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--out", default=None)
    return ap


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("_vllm", "_rotkv"):
        spec = json.loads(Path(argv[1]).read_text())
        res = side_vllm(spec) if argv[0] == "_vllm" else side_rotkv(spec)
        Path(argv[2]).write_text(json.dumps(res))
        return 0
    args = build_parser().parse_args(argv)
    from transformers import AutoTokenizer

    methods = [m.strip().removeprefix("rotkv:") for m in args.methods.split(",") if m.strip()]
    dtypes = [d.strip() for d in args.rotkv_dtypes.split(",") if d.strip()]
    if "bfloat16" not in dtypes or not set(dtypes) <= {"bfloat16", "float32"}:
        raise SystemExit(f"--rotkv-dtypes has to list bfloat16 (and may list float32), got {args.rotkv_dtypes!r}")
    tok = AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    P, N = args.prompt_len, args.new_tokens
    wins = windows(tok, args.split, args.requests, P, N)
    assert all(len(w["ids"]) == P + N for w in wins), "a window is shorter than --prompt-len + --new-tokens"
    tmp = tempfile.TemporaryDirectory(prefix="vllm-kl-")  # the reference log-probs (R x N x vocab floats) stay out of --out's dir
    spec = dict(model_dir=str(Path(args.model_dir).resolve()), gguf=args.gguf or os.environ.get("ROTKV_GGUF"),
                methods=methods, rotkv_dtypes=dtypes, device=args.device, windows=wins, prompt_len=P, new_tokens=N, chunk=args.chunk or P,
                gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                configs={m: rotkv_config(m, args) for m in methods if m != "bf16"},
                ref_path=str(Path(tmp.name) / "ref.pt"))
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "0",
           "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    from results_io import write_results

    sides: dict = {"_vllm": {}, "_rotkv": {}}
    failed: dict = {}

    def report(final: bool) -> None:
        """The JSON of what has run so far (rewritten after each side: a run cut short still leaves its part)."""
        rows = {}
        for m in methods:
            if m in sides["_vllm"] and m in sides["_rotkv"]:
                v, r = sides["_vllm"][m], sides["_rotkv"][m]
                rows[m] = dict(method_row(v, r), vllm_engine_kwargs=v["engine_kwargs"],
                               per_window_kl=dict(vllm=[mean(w) for w in v["kl"]],
                                                  rotkv=[mean(w) for w in r["bfloat16"]["kl"]]))
            elif m in sides["_rotkv"]:
                rows[m] = {"rotkv_kl" + ("" if dt == "bfloat16" else "_fp32_model"): mean([x for w in side["kl"] for x in w])
                           for dt, side in sides["_rotkv"][m].items()}
            if m in failed:
                rows.setdefault(m, {})["vllm_failed"] = failed[m]
        data = dict(schema="rotkv-vllm-kl/1", complete=final and not failed, prompt_len=P, new_tokens=N,
                    chunk=spec["chunk"], split=args.split, reference="float32 model, no cache (rotkv.eval.nll.reference)",
                    windows=[{k: w[k] for k in ("domain", "text", "start")} for w in wins],
                    settings={m: spec["configs"].get(m, {"preset": "bf16"}) for m in methods}, methods=rows)
        if final:
            print(table({m: r for m, r in rows.items() if "ratio" in r}), flush=True)
        write_results("vllm-kl", data, out=args.out)

    # the transformers side first (it writes the reference), then one process per vLLM engine
    for k, (side, ms) in enumerate([("_rotkv", methods)] + [("_vllm", [m]) for m in methods]):
        sp = Path(tmp.name) / f"spec{k}.json"
        sp.write_text(json.dumps({**spec, "methods": ms}))
        res = sp.with_name(f"result{k}.json")
        t0 = time.time()
        rc = run_side(side, sp, res, env)
        print(f"vllm_kl_compare: {side[1:]} side {ms}: exit {rc} after {time.time() - t0:.0f} s", flush=True)
        if rc != 0 or not res.exists():
            if side == "_rotkv":
                raise SystemExit(f"vllm_kl_compare: the transformers side failed (exit {rc})")
            failed[ms[0]] = f"exit {rc}"  # the other methods' engines still run
        else:
            sides[side].update(json.loads(res.read_text()))
        report(final=False)
    report(final=True)
    tmp.cleanup()
    if failed:
        raise SystemExit(f"vllm_kl_compare: the vLLM side failed for {sorted(failed)}")
    return 0

if __name__ == "__main__":
    sys.exit(main())
