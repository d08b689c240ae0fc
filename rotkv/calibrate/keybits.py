"""Per-layer key widths from the decode KL on calibration text: which layers' keys get 4 bits.

The INT2 error of this cache is mostly in the keys, and some layers carry much
more of it than others. For each layer l, a cache of the preset (``oscar-int2`` by default, with the
base artifact) is run with the keys of layer l alone at 4 bits, over windows of calibration text
(context prefilled in chunks, then teacher-forced decode tokens, as ``rotkv eval``'s nll task); the
layer's gain is the drop in mean KL(plain model || cache) against the preset itself. The ``--layers``
layers with the largest gains get 4-bit keys: the artifact written is the base artifact plus
``k_bits [L]`` (int32) and ``k_gain [L]`` (float32), read by presets with ``k_bits="artifact"``.

The ranking is forward-only (L + 1 cache runs per window) rather than a first-order, gradient-based
bound (PM-KVQ's, keys only), which picked worse layers (docs/calibration.md).

    rotkv calibrate --method oscar-mix --out oscar-mix.safetensors    # OSCAR base + key widths, one command
    rotkv calibrate --method oscar-mix --base-artifact oscar.safetensors --out oscar-mix.safetensors

(``--key-layers N``: how many layers get 4-bit keys.)
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch
from tqdm.auto import tqdm

from transformers.cache_utils import Cache, CacheLayerMixin

from rotkv.cache.layer import HybridLayer
from rotkv.hf import compat
from rotkv.cache.route import route


@torch.inference_mode()
def _logp(model, ids, cache=None, keep=1):
    kw = {compat.cache_kwarg(model): cache} if cache is not None else {"use_cache": False}
    out = model(input_ids=ids, logits_to_keep=keep, **kw)
    return torch.log_softmax(out.logits[0, -keep:].float(), -1)


def decode_kl(model, make_cache, ids: torch.Tensor, length: int, new: int, chunk: int, ref: torch.Tensor) -> torch.Tensor:
    """Per-token KL(ref || cache) ``[new]`` of one window: prefill ``length`` tokens in chunks, then decode."""
    cache = make_cache()
    lps = []
    for c0 in range(0, length, chunk):
        lp = _logp(model, ids[:, c0:min(c0 + chunk, length)], cache)[-1]
    lps.append(lp)
    for t in range(new - 1):
        lps.append(_logp(model, ids[:, length + t:length + t + 1], cache)[-1])
    lp = torch.stack(lps)
    return (ref.exp() * (ref - lp)).sum(-1).clamp_min(0)


class _RowsLayer(CacheLayerMixin):
    """One model layer of :class:`_RowGroups`: row group j of the batch goes to ``layers[j]``.

    With ``shared`` set (the first prefill chunk, whose attention reads only its own tokens at tier
    precision, so every group computes the same), the batch holds one group's rows: each layer
    stores them and the first one's attention output is returned. Otherwise the batch holds the
    rows of the groups active at this layer (:meth:`_RowGroups.active`), in order."""

    def __init__(self, layers, owner, idx: int):
        super().__init__()
        self.layers, self.owner, self.idx = layers, owner, idx
        self.is_sliding = getattr(layers[0], "is_sliding", False)
        self.rotkv = isinstance(layers[0], HybridLayer)

    def lazy_initialization(self, key_states, value_states):  # the group layers initialize themselves
        pass

    def _parts(self, n: int):
        if self.owner.shared:
            return [(layer, slice(None)) for layer in self.layers]
        active = self.owner.active(self.idx)
        if n % len(active):
            raise ValueError(f"{n} rows do not split into {len(active)} groups")
        w = n // len(active)
        return [(self.layers[j], slice(a * w, (a + 1) * w)) for a, j in enumerate(active)]

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        outs = [layer.update(key_states[s], value_states[s], *args, **kwargs)
                for layer, s in self._parts(key_states.shape[0])]
        if self.rotkv:  # the attention function stores them, through attend()
            route(self.idx, self, key_states)
            return key_states, value_states
        if self.owner.shared:
            return outs[0]
        return torch.cat([k for k, _ in outs]), torch.cat([v for _, v in outs])

    def attend(self, query, real, scaling):
        parts = self._parts(query.shape[0])
        if self.owner.shared:  # every group computes the same output: the others only store their tokens
            out = parts[0][0].attend(query, real, scaling)
            for layer, _ in parts[1:]:
                layer.attend(query, real, scaling, output=False)
            return out
        outs = [layer.attend(query[s], None if real is None else real[s], scaling) for layer, s in parts]
        return torch.cat(outs)

    def get_seq_length(self):
        return self.layers[0].get_seq_length()

    def get_mask_sizes(self, query_length):
        return self.layers[0].get_mask_sizes(query_length)

    def get_max_length(self):
        return -1


class _RowGroups(Cache):
    """Several caches run as one batch: rows ``[j * W, (j + 1) * W)`` are cache j's, so the model's
    GEMMs serve every cache variant at once (the key-width search's L + 1 runs in one forward).

    ``first``: per group, the first layer at which it differs from group 0 (None: everywhere). Below
    that layer its rows compute what group 0's compute, so :meth:`prune` runs each decoder layer on
    the groups that differ there only and copies group 0's rows for the others."""

    def __init__(self, caches, first=None):
        self.shared = False
        self.first = first or [0] * len(caches)
        super().__init__(layers=[_RowsLayer([c.layers[i] for c in caches], self, i) for i in range(len(caches[0].layers))])

    def active(self, layer: int) -> list[int]:
        return [j for j, f in enumerate(self.first) if j == 0 or f is None or f <= layer]

    @contextmanager
    def prune(self, model, rows_per_group: int):
        """Hooks on the decoder layers: layer i sees the rows of :meth:`active` (i) only."""
        g, w = len(self.first), rows_per_group
        hooks = []

        def pick(i):
            idx = torch.tensor(self.active(i))
            src = torch.tensor([self.active(i).index(j) if j in self.active(i) else 0 for j in range(g)])

            def pre(module, args, kwargs):
                if self.shared:
                    return None
                h = args[0]
                return (h.view(g, w, *h.shape[1:])[idx].reshape(-1, *h.shape[1:]), *args[1:]), kwargs

            def post(module, args, kwargs, out):
                if self.shared:
                    return None
                h = out[0] if isinstance(out, tuple) else out
                full = h.view(len(idx), w, *h.shape[1:])[src].reshape(g * w, *h.shape[1:])
                return (full, *out[1:]) if isinstance(out, tuple) else full
            return pre, post

        for i, layer in enumerate(decoder_layers(model)):
            pre, post = pick(i)
            hooks.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
            hooks.append(layer.register_forward_hook(post, with_kwargs=True))
        try:
            yield
        finally:
            for h in hooks:
                h.remove()


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers (the modules holding each self-attention module), by layer index."""
    from rotkv.hf.models import attention_modules

    attn = {id(m): m.layer_idx for m in attention_modules(model)}
    layers = [m for m in model.modules() if id(getattr(m, "self_attn", None)) in attn]
    return sorted(layers, key=lambda m: attn[id(m.self_attn)])


def _chunk_logp(model, ids, cache):
    kw = {compat.cache_kwarg(model): cache}
    return torch.log_softmax(model(input_ids=ids, logits_to_keep=1, **kw).logits[:, -1].float(), -1)


@torch.inference_mode()
def grouped_decode_kl(model, caches, ids: torch.Tensor, length: int, new: int, chunk: int,
                      ref: torch.Tensor, first=None, progress: bool = False) -> torch.Tensor:
    """Per-token KL(ref || cache j) ``[len(caches), W, new]`` of ``W`` windows ``ids [W, >= length + new - 1]``
    through every cache at once (the rows of cache j are the windows, in order); ``ref [W, new, V]``.

    The same runs as :func:`decode_kl` per (cache, window): the context prefilled in chunks of
    ``chunk``, then ``new - 1`` teacher-forced decode steps. The first chunk runs once for all
    caches (its attention reads only its own tokens, before anything is quantized). ``first``: per
    cache, the first layer where it differs from cache 0 (None: anywhere), see :class:`_RowGroups`;
    a model with sliding-window layers runs every row at every layer."""
    from rotkv.hf.models import sliding_layers

    g, w = len(caches), ids.shape[0]
    if first is not None and any(x is not None for x in sliding_layers(model)):
        first = None
    rows = _RowGroups(caches, first)
    rep = lambda x: x.repeat(g, 1)  # noqa: E731

    def kl(lp: torch.Tensor, t: int) -> torch.Tensor:  # [G, W]: decode token t's KL of every (cache, window)
        r = ref[:, t]  # [W, V]
        return (r.exp()[None] * (r[None] - lp.view(g, w, -1))).sum(-1).clamp_min(0)

    kls = None  # per decode token [G, W]: the log-probabilities are reduced as they come, never all kept
    bar = tqdm(total=-(-length // chunk) + new - 1, desc=f"key widths ({g} runs x {w} windows)", unit="forward",
               disable=not progress)
    with rows.prune(model, w) if first is not None else nullcontext():
        for c0 in range(0, length, chunk):
            part = ids[:, c0:min(c0 + chunk, length)]
            rows.shared = c0 == 0
            lp = _chunk_logp(model, part if rows.shared else rep(part), rows)
            kls = [kl(lp.repeat(g, 1) if rows.shared else lp, 0)]
            bar.update()
        rows.shared = False
        for t in range(new - 1):
            kls.append(kl(_chunk_logp(model, rep(ids[:, length + t:length + t + 1]), rows), t + 1))
            bar.update()
    bar.close()
    return torch.stack(kls, -1)  # [G, W, new]


MAX_ROWS = 16
"""The most rows (cache runs x windows) :func:`layer_gains` puts through the model in one forward: a
forward's activations grow with its rows times the prefill chunk, so this bounds the search's memory
whatever the layer count."""


def layer_gains(loaded, artifact, preset: str = "oscar-int2", length: int = 1024, new: int = 32, windows: int = 2,
                chunk: int = 512, sink: int = 16, window: int = 64, files=None, progress: bool = True,
                prune: bool = True, max_rows: int = MAX_ROWS) -> tuple[np.ndarray, float]:
    """(gain ``[L]``: mean KL of the preset minus mean KL with layer l's keys at 4 bits, the preset's mean KL).

    The L + 1 cache runs of every window go through the model in batches of at most ``max_rows`` rows
    (at least one run of the preset and one layer's run, times the windows), the windows as rows of
    each run (:func:`grouped_decode_kl`): the first prefill chunk runs once per batch, and with
    ``prune`` the run of layer l skips layers below l, where it computes what the preset's run
    computes. Every batch after the first holds a run of the preset again (the rows the pruned runs
    copy below their layer); the preset's KL is the first batch's. Each cache run's per-token KL is
    that of its lone run, so the batches change no result beyond float rounding."""
    from rotkv.cache import RotkvCache
    from rotkv.calibrate.corpus import token_chunks
    from rotkv.hf.models import sliding_layers

    model, tok = loaded.model, loaded.tokenizer
    n_layers = model.config.num_hidden_layers
    cached = [i for i, w in enumerate(sliding_layers(model)) if w is None]  # sliding layers stay the model's own
    span = length + new
    need = -(-span // 512) * 512
    chunks = token_chunks(tok, files, windows * need, 512)
    stream = torch.cat(chunks, 1).to(model.device)
    if stream.shape[1] < windows * span:
        raise ValueError(f"the calibration text has {stream.shape[1]} tokens, fewer than {windows} windows of {span}")
    starts = [w * (stream.shape[1] - span) // max(windows - 1, 1) for w in range(windows)]
    ids = torch.stack([stream[0, s:s + span] for s in starts])  # [W, span]
    kw = dict(sink=sink, window=window, prefill_chunk=chunk)
    runs = [None] + cached
    with torch.inference_mode():
        ref = torch.log_softmax(model(input_ids=ids[:, :span - 1], use_cache=False,
                                      logits_to_keep=new).logits[:, -new:].float(), -1)  # [W, new, V]
    if max_rows < 2 * windows:
        raise ValueError(f"max_rows has to be at least 2 x the windows ({2 * windows}) but got {max_rows}")
    per = max_rows // windows - 1  # layer runs per batch, beside the preset's
    kl = {}
    for b0 in range(0, max(len(cached), 1), per):
        part = [None] + cached[b0:b0 + per]
        caches = [RotkvCache(model, preset, artifact, **kw, **({} if r is None else {"k_bits": f"{r}:4"}))
                  for r in part]
        out = grouped_decode_kl(model, caches, ids, length, new, chunk, ref, first=part if prune else None,
                                progress=progress)
        kl.setdefault(None, out[0])
        kl |= dict(zip(part[1:], out[1:]))
        del caches, out
    base = kl[None].mean().item()
    gains = np.array([base - kl[i].mean().item() if i in kl else float("-inf") for i in range(n_layers)])
    return gains, base


def with_key_bits(artifact, gains: np.ndarray, layers: int, **info) -> tuple[dict, dict]:
    """(tensors, metadata) of ``artifact`` plus ``k_bits`` (4 for the ``layers`` largest gains, else 2) and ``k_gain``:
    an ``<method>-mix`` artifact (``oscar-mix``) made from ``artifact`` (its ``kind`` and ``base_artifact``)."""
    from rotkv.contract import kind_meta
    from rotkv.rotations.artifact import base_method

    order = np.argsort(-gains)
    bits = np.full(len(gains), 2, dtype=np.int32)
    bits[order[:layers]] = 4
    gain = torch.tensor(np.where(np.isfinite(gains), gains, 0.0), dtype=torch.float32)  # sliding layers: 0
    tensors = dict(artifact.tensors) | {"k_bits": torch.tensor(bits), "k_gain": gain}
    meta = dict(artifact.meta) | {f"keybits_{k}": str(v) for k, v in info.items()}
    meta |= kind_meta(f"{base_method(artifact)}-mix", artifact)
    return tensors, meta


def _a(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def default_layers(num_layers: int) -> int:
    """The number of layers whose keys get 4 bits by default: a third (10 of SmolLM2's 30)."""
    return max(1, round(num_layers / 3))


def check_layers(layers: int | None, num_layers: int, flag: str = "--layers") -> int:
    """``layers`` (default :func:`default_layers`) in [1, num_layers]; else a ValueError naming ``flag``."""
    if layers is None:
        return default_layers(num_layers)
    if not 1 <= layers <= num_layers:
        raise ValueError(f"{flag} has to be in [1, {num_layers}] (the model's layers) but got {layers}")
    return layers


def calibrate_mix(loaded, base=None, layers: int | None = None, preset: str = "oscar-int2", length: int = 1024,
                  new: int = 32, windows: int = 2, files=None, tokens: int | None = None, progress: bool = True,
                  log=print) -> tuple[dict, dict]:
    """(tensors, metadata) of a complete ``oscar-mix`` artifact: the base artifact (an Artifact, a
    path, or None: OSCAR calibrated here with the defaults, ``tokens`` calibration tokens) plus the
    per-layer key widths measured on it (:func:`layer_gains`, :func:`with_key_bits`)."""
    from rotkv.config import PRESETS
    from rotkv.contract import kind_serves, make_command, validate_artifact
    from rotkv.rotations.artifact import Artifact, load_artifact

    t0 = time.time()
    if base is None:
        from rotkv.calibrate.run import CalibConfig, calibrate

        log("calibrating the OSCAR base (rotations, key means, clip ratios) ...")
        cfg = CalibConfig(method="oscar", tokens=tokens or 16384, files=files, progress=progress)
        tensors, meta = calibrate(loaded, cfg)
        base = Artifact(tensors, meta, "(calibrated in memory)", sum(t.numel() * t.element_size() for t in tensors.values()))
    elif isinstance(base, str):
        base = load_artifact(base)
    validate_artifact(base, loaded.model)
    need = PRESETS[preset].artifact_kind if preset in PRESETS else None
    if need is not None and not kind_serves(base.kind, need):
        raise ValueError(f"the base artifact {base.path} is {base.describe()}; per-layer key widths (oscar-mix) are "
                         f"measured on {_a(need)} {need} artifact: make one with `{make_command(need)}`")
    t1 = time.time()
    n_layers = check_layers(layers, loaded.model.config.num_hidden_layers)
    log(f"measuring per-layer key widths ({windows} windows of {length} + {new} tokens) ...")
    gains, kl = layer_gains(loaded, base, preset, length, new, windows, files=files, progress=progress)
    tensors, meta = with_key_bits(base, gains, n_layers, preset=preset, length=length, new_tokens=new,
                                  windows=windows, base_kl=f"{kl:.5f}", seconds=f"{time.time() - t1:.0f}")
    order = [i for i in np.argsort(-gains).tolist() if np.isfinite(gains[i])]
    meta["keybits_layers"] = ",".join(str(i) for i in sorted(order[:n_layers]))
    meta["mix_seconds"] = f"{time.time() - t0:.0f}"
    log(f"{preset} KL {kl:.4f} on calibration text; gains by layer (best first): "
        + ", ".join(f"{i}:{gains[i]:+.4f}" for i in order))
    log(f"4-bit keys in layers {meta['keybits_layers']} (key widths {float(meta['keybits_seconds']):.0f} s)")
    return tensors, meta
