"""The calibration driver: capture statistics, fit the rotations of a registered method
(rotkv.rotations.registry: hadamard, oscar, optr, pairwise, ...), key means and clip ratios, and return
the artifact tensors and metadata.

Statistics come from all chunks but the last ``n_heldout``; those (calibration text, never evaluation
text) drive clip search and OptR's early stopping. OptR trains on the first ``n_train`` chunks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from rotkv.calibrate import clip
from rotkv.calibrate.capture import capturing
from rotkv.calibrate.corpus import token_chunks
from rotkv.calibrate.stats import StatsRecorder
from rotkv.contract import kind_meta
from rotkv.hf.fingerprint import model_meta
from rotkv.hf.geometry import attention_modules, model_geometry
from rotkv.hf.models import mean_centering_blocker
from rotkv.quant.widths import check_width
from rotkv.rotations import registry
from rotkv.rotations.base import LayerRotation

CS_FORMS = ("exact", "weighted", "diag")


@dataclass
class CalibConfig:
    method: str = registry.DEFAULT_METHOD
    tokens: int = 16384
    bits: int = 2
    group_size: int | None = None  # None: min(64, head_dim)
    granularity: str | None = None  # None: the method's default (registry: layer; kv-head for optr)
    cs: str = "exact"
    base: str = registry.DEFAULT_METHOD
    key_mean: bool = True  # clips (and OptR) are fitted with the key mean subtracted
    sink: int = 16
    chunk_len: int = 512
    n_heldout: int = 2
    n_train: int = 4
    clip_grid: tuple = clip.GRID
    search_clips: bool = True
    steps: int = 80
    lr: float = 0.02
    files: list[str] | None = None
    progress: bool = True
    timings: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in registry.rotation_fits():
            raise ValueError(f"`method` has to be one of {registry.rotation_fits()} but got {self.method!r}")
        if self.cs not in CS_FORMS:
            raise ValueError(f"`cs` has to be one of {list(CS_FORMS)} but got {self.cs!r}")
        if self.base not in registry.bases():
            raise ValueError(f"`base` has to be one of {registry.bases()} but got {self.base!r}")
        if self.granularity is None:
            self.granularity = self.spec.granularity
        if self.granularity not in ("layer", "kv-head"):
            raise ValueError(f"`granularity` has to be one of ['layer', 'kv-head'] but got {self.granularity!r}")
        check_width(self.bits)
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"`group_size` has to be a positive divisor of head_dim or None but got {self.group_size}")
        for name, low in (("sink", 0), ("steps", 1), ("chunk_len", 1), ("n_heldout", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"`{name}` has to be >= {low} but got {getattr(self, name)}")
        if self.tokens < self.min_tokens:
            held = self.n_heldout if self.needs_heldout else 0
            why = (f"{held} held-out chunk(s) of {self.chunk_len} tokens for the "
                   f"{'clip search' if self.search_clips else 'OptR early stopping'} and 1 for the statistics"
                   if held else f"one chunk of {self.chunk_len} tokens")
            raise ValueError(f"`tokens` has to be >= {self.min_tokens} for method {self.method!r} but got "
                             f"{self.tokens}: calibration needs {why}")

    @property
    def spec(self) -> registry.RotationMethod:
        """The registered method."""
        return registry.get(self.method)

    @property
    def refines(self) -> bool:
        """The method trains the rotations of ``base`` (OptR)."""
        return self.spec.refine is not None

    @property
    def needs_heldout(self) -> bool:
        """Held-out chunks drive the clip search and OptR's early stopping."""
        return self.search_clips or self.refines

    @property
    def min_tokens(self) -> int:
        """One chunk for the statistics and the held-out chunks; without held-out chunks any number of
        tokens is rounded up to whole chunks (:attr:`rounded_tokens`)."""
        return self.chunk_len * (1 + self.n_heldout) if self.needs_heldout and self.n_heldout else 1

    @property
    def rounded_tokens(self) -> int:
        """The tokens actually used: whole chunks of ``chunk_len``."""
        return -(-self.tokens // self.chunk_len) * self.chunk_len


def collect(model, chunks, sink: int, keep: set[int], keep_kv: bool, heldout: set[int] = frozenset(),
            progress: bool = True, desc: str = "capture") -> StatsRecorder:
    """Run every chunk through the model with the capture attention; statistics skip ``heldout`` chunks."""
    layers, kv_heads, head_dim = model_geometry(model.config)
    rec = StatsRecorder(layers, kv_heads, head_dim, sink=sink, keep=keep, keep_kv=keep_kv)
    dev = next(model.parameters()).device
    with torch.no_grad(), capturing(model, _Switch(rec, heldout)):
        for i, ids in enumerate(tqdm(chunks, desc=desc, disable=not progress)):
            rec.chunk = i
            model(ids.to(dev), use_cache=False)
    return rec


class _Switch:
    """Forward to the recorder, but only keep samples (no statistics) of held-out chunks."""

    def __init__(self, rec: StatsRecorder, heldout):
        self.rec, self.heldout = rec, heldout

    def __call__(self, layer, q, k, v, out, probs):
        if self.rec.chunk in self.heldout:
            if self.rec.chunk in self.rec.keep:
                from rotkv.calibrate.stats import Sample
                self.rec.layers[layer].samples[self.rec.chunk] = Sample(*(t[0].float().cpu().clone() for t in (q, k, v)))
            return
        self.rec(layer, q, k, v, out, probs)


def base_rotations(st, cfg: CalibConfig, method: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(R_K, R_V ``[H, D, D]``, extra tensors) of one layer: the registered method's fit."""
    fit = registry.get(method).fn("fit")
    if fit is None:
        raise ValueError(f"method {method!r} has no fit from statistics")
    return fit(st, registry.FitOptions(head_dim, cfg.granularity, cfg.cs))


def calibrate(loaded, cfg: CalibConfig) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Calibrate ``loaded`` (rotkv.hf.models.Loaded); returns (artifact tensors, metadata)."""
    model, tok = loaded.model, loaded.tokenizer
    if cfg.key_mean and (why := mean_centering_blocker(model)):
        raise ValueError(f"key mean-centering is not exact on this model ({why}); pass key_mean=False")
    layers, kv_heads, head_dim = model_geometry(model.config)
    group = cfg.group_size or min(64, head_dim)
    t0 = time.perf_counter()
    chunks = token_chunks(tok, cfg.files, cfg.tokens, cfg.chunk_len)
    n = len(chunks)
    n_held = min(cfg.n_heldout, max(n - 1, 0))
    heldout = set(range(n - n_held, n))
    train = set(range(min(cfg.n_train, n - n_held))) if cfg.refines else set()
    rec = collect(model, chunks, cfg.sink, keep=heldout | train, keep_kv=cfg.cs == "weighted" and cfg.spec.uses_cs,
                  heldout=heldout, progress=cfg.progress)
    cfg.timings["capture_s"] = time.perf_counter() - t0
    attn = attention_modules(model)
    tensors: dict[str, torch.Tensor] = {}
    clips_k, clips_v, infos = [], [], []
    t1 = time.perf_counter()
    for l in tqdm(range(layers), desc=f"fit {cfg.method}", disable=not cfg.progress):
        st = rec.layers[l]
        base = cfg.base if cfg.refines else cfg.method
        r_k, r_v, extra = base_rotations(st, cfg, base, head_dim)
        mu = st.k_mean if cfg.key_mean else None
        w_o = attn[l].o_proj.weight.detach().float().cpu()
        scaling = float(getattr(attn[l], "scaling", head_dim**-0.5))
        held = [st.samples[i] for i in sorted(heldout)]
        ck = cv = 1.0
        if cfg.search_clips and held:
            ck, cv = clip.search_layer(held, LayerRotation(r_k, r_v, mu), w_o, cfg.bits, group, cfg.sink, scaling, cfg.clip_grid)
        if cfg.refines:
            tr = [st.samples[i] for i in sorted(train)]
            r_k, r_v, info = cfg.spec.fn("refine")(tr, held, r_k, r_v, mu, w_o, cfg.bits, group, ck, cv, cfg.sink, scaling,
                                                 steps=cfg.steps, lr=cfg.lr)
            infos.append(info)
            if cfg.search_clips:
                ck, cv = clip.search_layer(held, LayerRotation(r_k, r_v, mu), w_o, cfg.bits, group, cfg.sink, scaling, cfg.clip_grid)
        same = lambda r: r[:1] if cfg.granularity == "layer" and not cfg.refines else r  # noqa: E731
        tensors[f"R_K.{l}"], tensors[f"R_V.{l}"] = same(r_k).clone(), same(r_v).clone()  # never shared storage
        tensors[f"k_mean.{l}"] = st.k_mean
        for name, t in extra.items():
            tensors[f"{name}.{l}"] = same(t).clone()
        clips_k.append(ck)
        clips_v.append(cv)
    tensors["clip_k"] = torch.tensor(clips_k, dtype=torch.float32)
    tensors["clip_v"] = torch.tensor(clips_v, dtype=torch.float32)
    cfg.timings["fit_s"] = time.perf_counter() - t1
    cfg.timings["total_s"] = time.perf_counter() - t0
    meta = model_meta(model, loaded.model_id)
    meta.update({
        "method": cfg.method, "bits": cfg.bits, "group_size": group, "granularity": cfg.granularity,
        "cs": cfg.cs if cfg.spec.uses_cs else "",
        "key_mean_fitted": int(cfg.key_mean), "sink": cfg.sink, "values_folded": "0",
        "clip_k": ",".join(f"{c:g}" for c in clips_k), "clip_v": ",".join(f"{c:g}" for c in clips_v),
        "calib_tokens": sum(c.shape[1] for i, c in enumerate(chunks) if i not in heldout),
        "heldout_tokens": sum(chunks[i].shape[1] for i in heldout),
        "calib_seconds": f"{cfg.timings['total_s']:.1f}",
        "threads": torch.get_num_threads(),
        # what the fit's floating point depends on besides the inputs: other versions can give another
        # key-width ranking
        "torch_version": torch.__version__, "transformers_version": _transformers_version(),
    })
    if cfg.refines:
        meta["base"] = cfg.base  # the rotation the refinement starts from
    meta.update(kind_meta(cfg.method))
    if infos:
        meta["optr_heads_improved_k"] = sum(i["heads_improved_k"] for i in infos)
        meta["optr_heads_improved_v"] = sum(i["heads_improved_v"] for i in infos)
        meta["optr_steps"], meta["optr_lr"] = cfg.steps, cfg.lr
    return tensors, {k: str(v) for k, v in meta.items()}


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
