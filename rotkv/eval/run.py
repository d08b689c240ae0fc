"""The evaluation driver: resolves methods, runs every (task, length) unit, caches results per method.

Results are cached in ``DIR/cache/<method>/<task>-<length>.json`` together with a fingerprint of the
settings that produced them, so an interrupted run resumes where it stopped and a changed setting
recomputes only what it affects. Several processes may share one DIR with disjoint method lists.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata

import torch
from tqdm.auto import tqdm

from rotkv.eval import attn_error, nll, niah
from rotkv.eval.config import EvalConfig
from rotkv.eval.methods import Method, cached_method, resolve
from rotkv.eval.stats import mean_ci, wilson

PACKAGES = ("rotkv", "torch", "transformers", "optimum-quanto", "hqq", "turboquant", "numpy", "scipy", "matplotlib")


# ---- provenance ---------------------------------------------------------------------------------------
def versions() -> dict[str, str | None]:
    out = {"python": platform.python_version()}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = None
    return out


def git_commit() -> dict[str, str | None]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "rotkv"], cwd=here, capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return {"commit": sha or None, "rotkv_tree_dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "rotkv_tree_dirty": None}


def _sha(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


# ---- texts --------------------------------------------------------------------------------------------
def read_tokens(tokenizer, files: list[str]) -> list[int]:
    text = "\n\n".join(open(f, encoding="utf-8").read() for f in files)
    return tokenizer(text, add_special_tokens=False).input_ids


# ---- the units ----------------------------------------------------------------------------------------
def unit_settings(cfg: EvalConfig, unit: tuple, text_sha: str, hay_sha: str) -> dict:
    """The settings a (task, variant, length) unit's results depend on (its cache fingerprint)."""
    task, variant, length = unit
    s = {"model": cfg.model, "task": task, "variant": variant, "length": length, "sink": cfg.sink, "window": cfg.window,
         "chunk": cfg.chunk, "seed": cfg.seed}
    if cfg.device != "cpu":  # GPU results (kernels, not the CPU references) are cached apart; CPU caches stay valid
        s["device"] = cfg.device.split(":")[0]
    if task == "nll":
        s.update(windows=cfg.windows_at(length), new_tokens=cfg.new_tokens, texts=text_sha)
        if cfg.window_batch > 1:  # batched rows round differently: cached apart (batch-1 caches stay valid)
            s["window_batch"] = cfg.window_batch
    elif task == "attn-error":
        s.update(queries=cfg.attn_queries, texts=text_sha)
    else:
        depths = cfg.niah_depths if variant in ("noise", "essay") else cfg.niah_multi_depths
        s.update(depths=depths, samples=cfg.niah_samples, answer=cfg.max_answer_tokens,
                 haystack=hay_sha if variant != "noise" else None, prompt=niah.PROMPT_VERSION)
    return s


# cache fields that came after results were first cached: in a record's fingerprint only when set (_spec_key)
SPEC_KEYED = ("window_share", "refine_tokens", "refine_values", "refine_every", "refine_salient", "meta_k")


def _spec_key(method: Method) -> dict:
    """Cache fields that came after results were first cached, in the fingerprint only when set (older
    caches stay valid; a preset that gains one, like oscar-mix's window_share, is not served stale results)."""
    if method.kind != "rotkv":
        return {}
    from rotkv.config import get_preset

    spec = get_preset(method.name, **method.overrides)
    return {f: getattr(spec, f) for f in SPEC_KEYED if getattr(spec, f)}


def _fingerprint(settings: dict, method: Method) -> str:
    blob = json.dumps({**settings, "method": method.name, "artifact": method.artifact and _sha(method.artifact),
                       **_spec_key(method)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _mem_fields(mem: dict, bpe_nominal: float) -> dict:
    el = max(mem["elements"], 1)
    return {"kv_bytes": mem["kv_bytes"], "kv_bytes_at_bf16": mem["kv_bytes_at_bf16"], "elements": mem["elements"],
            "bpe_measured": 8 * mem["kv_bytes"] / el, "bpe_at_bf16": 8 * mem["kv_bytes_at_bf16"] / el,
            "bpe_nominal": bpe_nominal, "scratch_bytes": mem.get("scratch_bytes", 0)}


def _avg_mem(mems: list[dict]) -> dict:
    keys = ("kv_bytes", "kv_bytes_at_bf16", "elements", "scratch_bytes")
    return {k: sum(m.get(k, 0) for m in mems) / len(mems) for k in keys}


def run_nll(model, method, ids_all, cfg, length, refs) -> list[dict]:
    pooled: dict[str, list[float]] = {"nll": [], "kl": [], "top1": []}
    windows: dict[str, list[float]] = {k: [] for k in pooled}  # each window's mean (paired suite intervals)
    mems = []
    span = length + cfg.new_tokens
    for b0 in range(0, len(refs), cfg.window_batch):
        group = refs[b0:b0 + cfg.window_batch]
        ids = torch.cat([ids_all[:, start:start + span] for start, _ in group])
        pers, mem = nll.score_windows(model, method, ids, length, cfg.new_tokens, cfg.chunk, [r for _, r in group])
        for per in pers:
            for k in pooled:
                pooled[k] += per[k]
                windows[k].append(sum(per[k]) / len(per[k]))
            mems.append(mem)
    rec = {"method": method.name, "task": "nll", "length": length, "variant": None, "depth": None}
    rec.update(nll.summarize(pooled, len(refs)))
    rec["per_window"] = windows
    rec.update(_mem_fields(_avg_mem(mems), method.bpe_nominal))
    return [rec]


def run_attn(model, method, ids_all, cfg, length, ref) -> list[dict]:
    errs, mem = attn_error.layer_errors(model, method, ids_all[:, : length + cfg.attn_queries], length,
                                        cfg.attn_queries, cfg.chunk, ref)
    m, ci = mean_ci(errs)
    rec = {"method": method.name, "task": "attn-error", "length": length, "variant": None, "depth": None,
           "n": len(errs), "ci95": ci, "rel_error": m, "rel_error_per_layer": errs}
    rec.update(_mem_fields(mem, method.bpe_nominal))
    return [rec]


def niah_samples(tokenizer, cfg: EvalConfig, variant: str, length: int, essay_ids: list[int]) -> list[niah.Sample]:
    """The haystacks of one (variant, length) unit: per sample, one per depth (single variants) or one in all."""
    out = []
    for s in range(cfg.niah_samples):
        seed = int(hashlib.sha256(f"{cfg.seed}-{variant}-{length}-{s}".encode()).hexdigest()[:8], 16)
        if variant in ("noise", "essay"):
            for d_i, d in enumerate(cfg.niah_depths):
                out.append(niah.make_sample(tokenizer, variant, length, [d], essay_ids, seed + d_i))
        else:
            out.append(niah.make_sample(tokenizer, variant, length, cfg.niah_multi_depths, essay_ids, seed))
    return out


def _tiers(method, cfg) -> tuple[int, int]:
    """(sink, window) tokens a method keeps unquantized, for the needle's tier label: the run's override, or
    with ``"preset"`` (or none given) a rotkv preset's own; 0 for a peer without one and for an unquantized
    preset (bf16: every token is in a bf16 tier)."""
    if method.kind == "rotkv":
        from rotkv.config import get_preset

        spec = get_preset(method.name, **method.overrides)
        return (spec.sink, spec.window) if spec.quantized else (0, 0)
    return tuple(v if isinstance(v, int) else 0 for v in (cfg.sink, cfg.window))


def run_niah(model, tokenizer, method, cfg, length, samples, sink: int, window: int) -> list[dict]:
    cells: dict[tuple, dict] = {}
    for sample in samples:
        results, mem = niah.run_sample(model, tokenizer, method, sample, cfg.chunk, cfg.max_answer_tokens)
        n_ctx = sample.context.shape[1]
        for r in results:
            key = (sample.variant, r["depth"])
            c = cells.setdefault(key, {"scores": [], "mems": [], "tiers": set(), "answers": [], "ctx": []})
            c["scores"].append(r["score"])
            c["mems"].append(mem)
            c["ctx"].append(n_ctx)
            c["answers"].append({"expected": r["expected"], "answer": r["answer"][:80]})
            tier = niah.tier_of(tuple(r["span"]), n_ctx, sink, window)
            if tier:
                c["tiers"].add(tier)
    recs = []
    for (variant, depth), c in cells.items():
        acc, ci = wilson(sum(c["scores"]), len(c["scores"]))
        rec = {"method": method.name, "task": "niah", "length": length, "variant": variant, "depth": depth,
               "n": len(c["scores"]), "ci95": ci, "accuracy": acc, "context_tokens": sum(c["ctx"]) / len(c["ctx"]),
               "bf16_tier": ",".join(sorted(c["tiers"])), "answers": c["answers"]}
        rec.update(_mem_fields(_avg_mem(c["mems"]), method.bpe_nominal))
        recs.append(rec)
    return recs


# ---- the driver ---------------------------------------------------------------------------------------
def calibrator(loaded, log, fit_lengths=None):
    """``calibrate(method, path) -> None or why not``: makes a missing artifact with the calibration defaults;
    ``fit_lengths``: the long refit's sequence lengths of an oscar-mix-long artifact (None: the defaults,
    ``rotkv.calibrate.longfit.DEFAULT_FIT_LENGTHS``)."""
    def calibrate(method: str, path: str) -> str | None:
        try:
            from rotkv.calibrate.run import CalibConfig, calibrate as fit
            from rotkv.rotations.artifact import save_artifact
        except ImportError as e:
            return f"calibration is not available in this checkout ({e})"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        from rotkv.config import PRESETS

        if method == "oscar-mix-long":  # oscar-mix's artifact (made or reused beside), key side refitted
            from rotkv.calibrate.longfit import DEFAULT_FIT_LENGTHS, calibrate_mix_long
            from rotkv.eval.methods import artifact_file

            mix = os.path.join(os.path.dirname(os.path.abspath(path)), artifact_file("oscar-mix"))
            if not os.path.exists(mix) and (why := calibrate("oscar-mix", mix)):
                return why
            log(f"refitting the key side of {mix} on long sequences into {path} ...")
            lengths = DEFAULT_FIT_LENGTHS if fit_lengths is None else list(fit_lengths)
            tensors, meta = calibrate_mix_long(loaded, mix, seq_len=lengths, log=log)
        elif method in PRESETS and PRESETS[method].k_bits == "artifact":  # oscar-mix: base + key widths
            from rotkv.calibrate.keybits import calibrate_mix
            from rotkv.eval.methods import artifact_file

            base = os.path.join(os.path.dirname(os.path.abspath(path)), artifact_file(method, base=True))
            if not os.path.exists(base) and (why := calibrate(PRESETS[method].method, base)):
                return why
            log(f"measuring the per-layer key widths of {method} on {base} into {path} ...")
            tensors, meta = calibrate_mix(loaded, base, log=log)
        else:
            log(f"calibrating {method} with the defaults into {path} ...")
            tensors, meta = fit(loaded, CalibConfig(method=method))
        save_artifact(path, tensors, meta)
        return None
    return calibrate


# the order units run in: what the report needs most first, contexts over 4K tokens last (the most expensive)
PRIORITY = [("nll", None), ("niah", "multikey"), ("niah", "essay"), ("attn-error", None), ("niah", "noise"),
            ("niah", "multivalue")]


def plan(cfg: EvalConfig) -> list[tuple[str, str | None, int]]:
    """(task, variant, length) units in the order they run."""
    units = []
    for t in cfg.tasks:
        for v in (cfg.niah_variants if t == "niah" else [None]):
            units += [(t, v, L) for L in (cfg.niah_lengths(v) if t == "niah" else sorted(cfg.lengths[t]))]
    return sorted(units, key=lambda u: (u[2] > 4096, PRIORITY.index((u[0], u[1])), u[2]))


def evaluate(cfg: EvalConfig, out_dir: str, loaded=None, log=print) -> list[dict]:
    """Run (or resume) the evaluation into ``out_dir``; returns every record of the configured methods."""
    from rotkv.hf.models import load_model

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    os.makedirs(out_dir, exist_ok=True)
    t0 = time.time()
    # float32 on every device: the plain model is the KL reference, and the cached runs use the same object
    loaded = loaded or load_model(cfg.model, device=cfg.device, dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    methods, unavailable = [], {}
    for name in cfg.methods:
        m, why = resolve(name, cfg.sink, cfg.window, cfg.artifact_dir, calibrator(loaded, log), cfg.window_share)
        if m is None:
            unavailable[name] = why
            log(f"  {name}: unavailable: {why}")
        else:
            methods.append(m)
    text_ids = read_tokens(tok, cfg.texts) if {"nll", "attn-error"} & set(cfg.tasks) else []
    essay_ids = read_tokens(tok, cfg.haystacks) if "niah" in cfg.tasks else []
    text_sha = hashlib.sha256(b"".join(_sha(f).encode() for f in cfg.texts)).hexdigest()[:16]
    hay_sha = hashlib.sha256(b"".join(_sha(f).encode() for f in cfg.haystacks)).hexdigest()[:16]
    ids_all = torch.tensor([text_ids]) if text_ids else None
    _write_provenance(cfg, out_dir, loaded, methods, unavailable)
    failed: dict[str, str] = {}
    for unit in plan(cfg):
        task, variant, length = unit
        settings = unit_settings(cfg, unit, text_sha, hay_sha)
        todo = [m for m in methods if _cached(out_dir, m, unit, settings) is None]
        if not todo:
            continue
        name = f"{task}{'-' + variant if variant else ''}@{length}"
        log(f"[{time.time() - t0:7.0f}s] {name}: {len(todo)} method(s) to run")
        ref = _reference(model, tok, cfg, unit, ids_all, essay_ids, out_dir, settings)
        for m in tqdm(todo, desc=name, unit="method"):
            t1 = time.time()
            try:
                if task == "nll":
                    recs = run_nll(model, m, ids_all, cfg, length, ref)
                elif task == "attn-error":
                    recs = run_attn(model, m, ids_all, cfg, length, ref)
                else:
                    recs = run_niah(model, tok, m, cfg, length, ref, *_tiers(m, cfg))
            except Exception as e:  # a failing method (a peer's bug) is reported, the run goes on
                failed[f"{m.name} {name}"] = f"{type(e).__name__}: {e}"
                log(f"[{time.time() - t0:7.0f}s]   {m.name} {name}: FAILED {type(e).__name__}: {e}")
                continue
            for r in recs:
                r["seconds"] = round(time.time() - t1, 1)
            _store(out_dir, m, unit, settings, recs)
            log(f"[{time.time() - t0:7.0f}s]   {m.name} {name}: {_brief(recs)}")
    records = collect(out_dir, cfg, methods, text_sha, hay_sha)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"records": records, "unavailable": unavailable, "failed": failed}, f, indent=1)
    if failed:
        with open(os.path.join(out_dir, f"failed-{os.getpid()}.json"), "w") as f:
            json.dump(failed, f, indent=1)
    return records


def _reference(model, tok, cfg, unit, ids_all, essay_ids, out_dir, settings):
    task, variant, length = unit
    if task == "nll":
        n = ids_all.shape[1]
        starts = nll.window_starts(n, length, cfg.new_tokens, cfg.windows_at(length))
        refs = []
        for i, s in enumerate(starts):
            path = os.path.join(out_dir, "cache", "_reference", f"nll-{length}-{s}-{_fingerprint_plain(settings)}.pt")
            if os.path.exists(path):
                ref = torch.load(path, map_location="cpu")
            else:  # kept on the CPU (portable cache files); score_window moves it to the model's device
                ref = nll.reference(model, ids_all[:, s:s + length + cfg.new_tokens], length, cfg.new_tokens).cpu()
                os.makedirs(os.path.dirname(path), exist_ok=True)
                torch.save(ref, path + f".{os.getpid()}.tmp")
                os.replace(path + f".{os.getpid()}.tmp", path)
            refs.append((s, ref))
        plain, per_window = {"nll": []}, []
        for s, ref in refs:
            scores = nll.reference_scores(ref, ids_all[:, s:s + length + cfg.new_tokens], length, cfg.new_tokens)
            plain["nll"] += scores
            per_window.append(sum(scores) / len(scores))
        rec = {"method": "plain-fp32", "task": "nll", "length": length, "variant": None, "depth": None}
        rec.update(nll.summarize(plain, len(refs)))
        rec["per_window"] = {"nll": per_window}
        os.makedirs(os.path.join(out_dir, "cache", "_reference"), exist_ok=True)
        with open(os.path.join(out_dir, "cache", "_reference", f"nll-{length}.json"), "w") as f:
            json.dump({"settings": settings, "records": [rec]}, f)
        return refs
    if task == "attn-error":
        return attn_error.reference(model, ids_all[:, : length + cfg.attn_queries])
    return niah_samples(tok, cfg, variant, length, essay_ids)


def _fingerprint_plain(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def _brief(recs: list[dict]) -> str:
    r = recs[0]
    if r["task"] == "nll":
        return f"nll {r['nll']:.3f} kl {r['kl']:.4f} top1 {r['top1']:.3f} bpe {r['bpe_measured']:.2f}"
    if r["task"] == "attn-error":
        return f"rel_error {r['rel_error']:.4f} bpe {r['bpe_measured']:.2f}"
    acc = sum(x["accuracy"] * x["n"] for x in recs) / sum(x["n"] for x in recs)
    return f"accuracy {acc:.3f} over {sum(x['n'] for x in recs)} questions, bpe {r['bpe_measured']:.2f}"


def _path(out_dir: str, method: Method, unit: tuple) -> str:
    task, variant, length = unit
    return os.path.join(out_dir, "cache", method.name, f"{task}{'-' + variant if variant else ''}-{length}.json")


def _cached(out_dir, method, unit, settings, unverified: bool = False) -> list[dict] | None:
    """A unit's cached records of ``method`` where their fingerprint matches; ``unverified`` (a rebuild without
    the method's artifact, whose hash is in the fingerprint): where their recorded settings match."""
    p = _path(out_dir, method, unit)
    if not os.path.exists(p):
        return None
    with open(p) as f:
        blob = json.load(f)
    if unverified:
        return blob["records"] if blob.get("settings") == settings else None
    return blob["records"] if blob.get("fingerprint") == _fingerprint(settings, method) else None


def _store(out_dir, method, unit, settings, recs) -> None:
    p = _path(out_dir, method, unit)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    tmp = p + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"fingerprint": _fingerprint(settings, method), "settings": settings, "records": recs}, f, indent=1)
    os.replace(tmp, p)


def collect(out_dir: str, cfg: EvalConfig, methods: list[Method], text_sha: str, hay_sha: str,
            unverified: frozenset = frozenset()) -> list[dict]:
    """Every cached record of the configured methods and units, plus the plain-model nll references; the methods
    named in ``unverified`` matched by their recorded settings (:func:`_cached`)."""
    records = []
    for unit in plan(cfg):
        task, _, length = unit
        settings = unit_settings(cfg, unit, text_sha, hay_sha)
        if task == "nll":
            p = os.path.join(out_dir, "cache", "_reference", f"nll-{length}.json")
            if os.path.exists(p):
                with open(p) as f:
                    blob = json.load(f)
                if blob["settings"] == settings:
                    records += blob["records"]
        for m in methods:
            recs = _cached(out_dir, m, unit, settings, m.name in unverified)
            if recs:
                records += recs
    return records


def _write_provenance(cfg, out_dir, loaded, methods, unavailable) -> None:
    arts = {}
    for m in methods:
        if m.artifact:
            from rotkv.rotations.artifact import artifact_id, load_artifact

            a = load_artifact(m.artifact)
            # the file's hash changes with its metadata (date, timings); the id is its tensors' (equal tensors, equal id)
            arts[m.name] = {"path": m.artifact, "sha256_16": _sha(m.artifact), "id": artifact_id(a.tensors),
                            "meta": dict(getattr(a, "meta", {}) or {})}
    blob = {"config": cfg.to_dict(), "model_id": loaded.model_id, "versions": versions(), "git": git_commit(),
            "threads": torch.get_num_threads(), "argv": sys.argv, "artifacts": arts, "unavailable": unavailable,
            "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(blob, f, indent=1, default=str)


def rebuild(cfg: EvalConfig, out_dir: str) -> list[dict]:
    """results.json from the cache alone (e.g. after several processes ran disjoint method lists). A method that
    cannot run here (its artifact or its peer's library missing) keeps its cached records: a peer's fingerprint
    needs no library; a preset's holds its artifact's hash, so without the artifact its records are matched by
    their recorded settings, and results.json names it under ``unverified`` with the reason. Only a method with
    no records at all is listed as ``unavailable``."""
    methods, unavailable, unverified = [], {}, {}
    for name in cfg.methods:
        m, why = resolve(name, cfg.sink, cfg.window, cfg.artifact_dir, None, cfg.window_share)
        if m is None:
            m = cached_method(name, cfg.sink, cfg.window, cfg.window_share)
            if m.kind == "rotkv":  # no artifact here: its hash cannot be checked
                unverified[name] = why
            else:
                unavailable[name] = why
        methods.append(m)
    text_sha = hashlib.sha256(b"".join(_sha(f).encode() for f in cfg.texts)).hexdigest()[:16]
    hay_sha = hashlib.sha256(b"".join(_sha(f).encode() for f in cfg.haystacks)).hexdigest()[:16]
    records = collect(out_dir, cfg, methods, text_sha, hay_sha, frozenset(unverified))
    have = {r["method"] for r in records}
    for name in list(unavailable):
        if name in have:  # a peer that cannot run here, read back from its cache
            del unavailable[name]
    for name in list(unverified):
        if name not in have:
            unavailable[name] = unverified.pop(name)
    methods = [m for m in methods if m.name not in unavailable]
    failed = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("failed-") and name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                failed.update(json.load(f))
    done = {(r["method"], r["task"], r["variant"], r["length"]) for r in records}
    missing = [f"{m.name} {t}{'-' + v if v else ''}@{L}" for m in methods for t, v, L in plan(cfg)
               if (m.name, t, v, L) not in done]
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"records": records, "unavailable": unavailable, "unverified": unverified, "failed": failed,
                   "missing": missing}, f, indent=1)
    prov_path = os.path.join(out_dir, "config.json")
    if os.path.exists(prov_path):  # the merged run's configuration: every method of this call
        with open(prov_path) as f:
            prov = json.load(f)
        # every process of a split run rewrites config.json at its start: keep the merged view explicit
        prov.update(config=cfg.to_dict(), unavailable=unavailable, argv_merge=sys.argv,
                    report_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        with open(prov_path, "w") as f:
            json.dump(prov, f, indent=1, default=str)
    return records
