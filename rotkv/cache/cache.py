"""RotkvCache: the transformers ``Cache`` made of hybrid layers (bf16 for sliding-window layers)."""

from __future__ import annotations

import dataclasses
import os
import warnings

import numpy as np
import torch
from transformers.cache_utils import Cache

from rotkv import switches
from rotkv.cache.assembly import CachePlan, build_layer, plan_cache, resolve_spec
from rotkv.cache.base import RotkvLayer
from rotkv.cache.layer import HybridLayer
from rotkv.cache.plan import PageState, to_device
from rotkv.cache.progressive import ProgressiveLayer
from rotkv.config import CacheSpec, RotkvWarning
from rotkv.hf.attention import install
from rotkv.rotations.artifact import Artifact
from rotkv.hf.folding import fold_model_values, without_values


DECODE_SCORES = ("auto", "bf16", "int8")  # the decode kernels' score variants (rotkv.kernels.plan)


class RotkvCache(Cache):
    """A drop-in KV cache: ``model.generate(..., past_key_values=RotkvCache(model, "quarot-int2"))``.

    Full-attention layers get a :class:`HybridLayer` (bf16 sink + quantized body + bf16 window)
    over page pools, all sharing one :class:`~rotkv.cache.plan.PageState` (the page lists and
    free lists of the batch); sliding-window layers stay bf16 (transformers' own layer). A spec
    with a memory budget (``budget_tokens``: ``pmkvq``, ``oscar-pmkvq``, ...) gets budgeted layers
    instead (``rotkv.cache.progressive``). What each layer is comes from one resolution,
    :func:`rotkv.cache.assembly.plan_cache`, kept as ``self.plan``.
    Building the cache registers the "rotkv" attention function and switches the model to it.
    :meth:`fold_values` moves the value rotations into the model's weights; a cache built for a
    model folded so already holds none.

    spec: a preset name or a CacheSpec; None: the preset ``artifact`` was made for (``oscar-mix`` for an
    oscar-mix artifact: rotkv.contract.default_preset), or without an artifact ``int4`` with a
    :class:`~rotkv.config.RotkvWarning` naming the calibration of the recommended preset.
    check_finite: refuse NaN/Inf keys and values (nothing is stored). It costs one device sync
    per layer on the GPU; the CUDA-graph decode (``rotkv.cache.graph``) runs without it.
    layer_bits: per-layer ``(key bits, value bits)`` of the token codec (each 2 or 4 for the GPU
    kernels; 8 runs the reference path), one pair per model layer; None: ``spec.bits`` everywhere.
    decode_score: the decode kernels' score variant ("auto", "bf16", "int8"; see
    ``rotkv.kernels.decode_config.DecodeConfig.score``); None: the ``decode_score`` switch ("auto";
    ``rotkv.switches``).
    context_length: the tokens each row is expected to reach (prompt + new tokens). An artifact with several
    key-side fits (``key_fit_lengths``) then serves the fit nearest that length
    (:func:`rotkv.rotations.artifact.pick_key_fit`); None keeps its primary fit. The fit used is
    ``key_fit_length`` (also in :meth:`stats`; None for an artifact without named fits).
    """

    def __init__(self, model, spec: CacheSpec | str | None = None, artifact: Artifact | str | None = None,
                 check_finite: bool = True, layer_bits=None, decode_score: str | None = None,
                 context_length: int | None = None, **overrides):
        if not hasattr(model, "config"):
            raise TypeError(f"model has to be a transformers model (with a config), not {type(model).__name__}")
        if artifact is not None and not isinstance(artifact, (str, os.PathLike, Artifact)):
            raise TypeError(f"artifact has to be a file path, an Artifact or None, not {type(artifact).__name__}")
        artifact = os.fspath(artifact) if isinstance(artifact, os.PathLike) else artifact
        switches.get()  # the environment's switches, checked on any device before any work
        if not isinstance(check_finite, bool):
            raise TypeError(f"check_finite has to be a bool but got {check_finite!r} ({type(check_finite).__name__})")
        if decode_score is not None and decode_score not in DECODE_SCORES:
            raise ValueError(f"decode_score has to be one of {list(DECODE_SCORES)} or None but got {decode_score!r}")
        if spec is None:  # the preset the artifact was made for; without one, DEFAULT_PRESET and a note
            from rotkv.contract import default_note, default_preset
            from rotkv.rotations.artifact import load_artifact

            artifact = load_artifact(artifact) if isinstance(artifact, str) else artifact
            spec = default_preset(artifact)
            if artifact is None:
                warnings.warn(default_note(), RotkvWarning, stacklevel=2)
        spec = resolve_spec(spec, **overrides)
        if artifact is not None and not spec.needs_artifact and spec.budget_tokens is None:
            warnings.warn(f"the artifact is not used by preset {spec.name!r} (rotation {spec.rotation!r})",
                          RotkvWarning, stacklevel=2)
        if decode_score is not None and spec.budget_tokens is not None:
            raise ValueError("decode_score picks the paged layers' decode kernel; a spec with `budget_tokens` "
                             "has per-row layers, which run no kernel")
        self.plan: CachePlan = plan_cache(model, spec, artifact, layer_bits, context_length)
        self.spec, self.artifact = spec, self.plan.artifact
        fits = self.artifact.key_fit_lengths if self.artifact is not None else []
        self.key_fit_length: int | None = fits[0] if fits else None  # the picked fit is the plan's primary
        self.head_dim, self.kv_heads = self.plan.head_dim, self.plan.kv_heads
        if spec.quantized and (overrides.get("group_size") or 0) > self.head_dim:  # asked for (a preset's is clamped quietly)
            warnings.warn(f"group_size {spec.group_size} is larger than head_dim {self.head_dim}: using {self.head_dim}",
                          RotkvWarning, stacklevel=2)
        self.state = PageState.from_spec(spec)
        super().__init__(layers=[build_layer(lp, self.plan, model.dtype, self.state, check_finite, decode_score)
                                 for lp in self.plan.layers])
        self.rotation_bytes = self.plan.rotation_bytes
        self.key_map_bytes = 0  # `predict_keys`: the inter-layer key maps (fp16), per model like the rotations
        if self.plan.key_maps is not None:
            from rotkv.cache.predict import attach, bias_after_rope, map_bytes

            attach(self, model, self.plan.key_maps, bias_after_rope(self.plan.artifact.meta))
            self.key_map_bytes = map_bytes(self.plan.key_maps)
        if getattr(model.config, "rotkv_values_folded", False):
            self.fold_values(model)  # the weights hold R_V already: these very matrices leave the cache, others raise
        install(model)

    @torch.compiler.disable  # a compiled model breaks its graph here (rotkv.cache.compiled)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """transformers' entry (the model calls it once per layer and forward); checks what a direct
        call can get wrong: the layer index and the shapes ``[B, kv_heads, q, head_dim]`` (NaN/Inf:
        the layers' ``check_finite``; nothing is stored then)."""
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer_idx has to be an int in [0, {len(self.layers) - 1}] but got {layer_idx!r}")
        want = (self.kv_heads, self.head_dim)
        for name, t in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or (t.shape[1], t.shape[3]) != want \
                    or not t.is_floating_point():
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{name} has to be a float tensor [batch, {want[0]}, tokens, {want[1]}] "
                                 f"(kv_heads, head_dim of layer {layer_idx}) but got {shape}")
        if key_states.shape[:3] != value_states.shape[:3]:
            raise ValueError(f"key_states {tuple(key_states.shape)} and value_states {tuple(value_states.shape)} "
                             "differ in batch or tokens")
        # what the previous call's kernel writes stored: one sync per call; not while a CUDA graph is
        # captured (a sync breaks the capture; the graph decoder's flushes are eager and are read at
        # the end of generate_batch)
        if layer_idx == 0 and not (key_states.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.check_metadata_range()
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def check_metadata_range(self) -> None:
        """Raise where a kernel write stored e4m3 quantization metadata out of its range (the kernel
        marks such groups NaN; the reference encoder raises at once). The write itself does not sync:
        this reads every layer's flag in one host sync (none for a cache without e4m3 metadata). It runs
        at the start of every model call and at the end of ``rotkv.generation``'s prefill and generate;
        the pages stay marked, so a cache that failed keeps failing until it is reset."""
        flags = [(layer.layer_idx, side, f) for layer in self.layers
                 if isinstance(layer, HybridLayer) and layer.is_initialized
                 for side, f in zip(("keys", "values"), layer.pools.range_flags) if f is not None]
        if not flags or not bool(torch.stack([f for _, _, f in flags]).any()):
            return
        where = ", ".join(f"layer {i} {side}" for i, side, f in flags if bool(f))
        raise ValueError(f"values exceed the range of the float8_e4m3fn quantization metadata ({where}); store "
                         "this side's metadata in float16 (meta_k / meta_v) and reset the cache")

    def fold_values(self, model) -> None:
        """Fold this cache's value rotations into ``model`` (in place) and drop them from the cache.

        v_proj then R_V per KV head, o_proj's input columns by R_V^T per query-head group
        (:func:`rotkv.hf.folding.fold_model_values`): v_proj then emits ``v R_V``, so the cache
        stores the same rotated values with no rotation of the values or the attention output. Only
        layers that rotate values are touched. A cache without R_V (folded already, or none) is a
        no-op; the model is marked folded, and one folded with other matrices raises. Fold before the
        cache's first forward: a decode step already captured in a CUDA graph keeps its rotations."""
        r_v = [layer.rotation_cpu.R_V if isinstance(layer, RotkvLayer) else None for layer in self.layers]
        if all(r is None for r in r_v):
            return
        fold_model_values(model, r_v)
        plans = list(self.plan.layers)
        for i, layer in enumerate(self.layers):
            if r_v[i] is not None:
                cpu = without_values(layer.rotation_cpu)
                layer.rotation = cpu if layer.rotation is layer.rotation_cpu else without_values(layer.rotation)
                layer.rotation_cpu = cpu
                plans[i] = dataclasses.replace(plans[i], rotation=cpu)
        self.plan = dataclasses.replace(self.plan, layers=tuple(plans))
        self.rotation_bytes = self.plan.rotation_bytes

    # ---- batch edits: one page-list edit, then every layer copies the pages it must ---------------
    def _select_rows(self, index) -> None:
        index = np.asarray(index.tolist() if isinstance(index, torch.Tensor) else index, dtype=np.int64)
        paged = [layer for layer in self.layers if isinstance(layer, HybridLayer)]
        if paged and paged[0].is_initialized:
            copies = self.state.select_rows(index)
            for layer in paged:
                layer.pools.fit(self.state.tier_free.capacity, self.state.body_free.capacity)
                layer.pools.copy_pages(*(torch.as_tensor(c, device=layer.device) for c in copies))
                layer.pools.select_tiers(torch.as_tensor(index))  # each row takes its source row's
        for layer in self.layers:
            if not isinstance(layer, HybridLayer) and getattr(layer, "is_initialized", False):
                layer.reorder_cache(torch.as_tensor(index))  # index_select (row-store layers copy rows)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows become ``beam_idx`` (beam search); a row chosen twice gets its own copy of its pages."""
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only these rows; the pages of the others go back to the free lists."""
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._select_rows(np.repeat(np.arange(self.state.rows), repeats))

    # ---- continuous batching: rows freed and refilled while the others go on ----------------------
    def _paged(self, what: str) -> list[HybridLayer]:
        paged = [layer for layer in self.layers if isinstance(layer, HybridLayer)]
        if len(paged) != len(self.layers):
            raise ValueError(f"{what} needs every layer in rotkv's paged pools (no sliding-window or budgeted layers)")
        return paged

    def open_rows(self, rows: int, tier_pages: int, body_pages: int, device, dtype=None) -> None:
        """Make this unused cache a batch of ``rows`` empty rows over pools of ``tier_pages`` and
        ``body_pages`` pages (allocated now, so they never grow while a decode step is captured);
        rows are then filled by :meth:`adopt_rows` and emptied by :meth:`release_rows`."""
        paged = self._paged("open_rows")
        st = self.state
        if st.rows or st.seen:
            raise ValueError("open_rows needs a cache that holds no batch yet (reset it first)")
        probe = torch.zeros(rows, self.kv_heads, 1, self.head_dim, dtype=dtype or paged[0].tier_dtype, device=device)
        for layer in paged:
            layer.lazy_initialization(probe, probe)
        st.reset(rows)
        st.tier_free.grow(tier_pages)
        st.body_free.grow(max(body_pages, 1))
        for layer in paged:
            layer.pools.fit(st.tier_free.capacity, st.body_free.capacity, rows)

    def release_rows(self, rows) -> None:
        """Free the pages of ``rows`` (finished requests) for others; the rows stay, empty
        (:meth:`rotkv.cache.plan.PageState.release`)."""
        self._paged("release_rows")
        self.state.release(rows)

    def adopt_rows(self, rows, src: "RotkvCache", src_rows) -> None:
        """Move ``src``'s rows ``src_rows`` (requests prefilled in a cache of their own, the same spec and
        model) into this cache's empty ``rows``: pages from this cache's free lists, every layer's pages
        and tiers copied. ``src`` is left as it was."""
        mine, theirs = self._paged("adopt_rows"), src._paged("adopt_rows")
        if src.spec != self.spec or len(mine) != len(theirs):
            raise ValueError("adopt_rows needs a cache of the same spec over the same model")
        st = self.state
        rows, src_rows = np.atleast_1d(rows).tolist(), np.atleast_1d(src_rows).tolist()
        if len(rows) != len(src_rows) or len(set(rows)) != len(rows):
            raise ValueError(f"adopt_rows needs distinct rows, one per source row: got {rows} and {src_rows}")
        busy = st.busy_rows(rows)
        if busy:
            raise ValueError(f"rows {busy} hold tokens: release them first")
        # the state first, row by row (pages from the free lists); then every layer copies all the rows'
        # pages at once, and its tiers take the rows in the same order (each at the body counts before it)
        moves, ids = [], ([], [], [], [])
        for row, src_row in zip(rows, src_rows):
            counts = st.body_count.copy()
            for part, i in zip(ids, st.adopt(row, src.state, src_row)):
                part.append(i)
            moves.append((row, src_row, counts, int(src.state.body_count[src_row])))
        ids = tuple(np.concatenate(part) for part in ids)
        on = {}  # the page ids on each layer's device, copied there once
        for a, b in zip(mine, theirs):
            a.pools.fit(st.tier_free.capacity, st.body_free.capacity)
            if a.device not in on:
                on[a.device] = tuple(to_device(i, a.device) for i in ids)
            a.pools.copy_from(b.pools, *on[a.device])
            a.pools.adopt_tiers(b.pools, moves)

    def reset(self) -> None:
        """Forget every token; the pools keep their memory for the next batch."""
        for layer in self.layers:
            layer.reset()
        self.state.reset(0)

    def free_pages(self) -> dict[str, int]:
        """Pages in use and free in the shared pools (every layer has the same)."""
        st = self.state
        return {"tier_used": st.tier_free.used, "tier_free": st.tier_free.free_count,
                "body_used": st.body_free.used, "body_free": st.body_free.free_count}

    # ---- accounting ------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Measured resident bytes and bits per element over every layer and tier (and ``key_fit_length``,
        the artifact's key fit in use, None without named fits).

        kv_bytes counts codes, metadata and the bf16 tiers of the stored tokens (and bf16 sliding
        layers); rotation matrices and means are reported apart as rotation_bytes (and the inter-layer key
        maps of a ``predict_keys`` spec as key_map_bytes, fp16 as the artifact stores them), the pools'
        allocated capacity (free pages included) as pool_bytes, what a budgeted (per-row) layer's
        reference reader keeps beside its tiers (a float32 view of its tokens) as scratch_bytes,
        and resident_bytes is what the process holds for the stored tokens: the pools, the
        per-row layers' tensors and scratch, and the model's own sliding layers (the paged
        layers' reader decodes the body per call, a chunk at a time, and keeps nothing).
        """
        tot = {"tokens": 0, "body_tokens": 0, "body_bytes": 0, "tier_bytes": 0, "scratch_bytes": 0, "elements": 0,
               "body_elements": 0, "pool_bytes": 0, "resident_bytes": 0}
        for layer in self.layers:
            if hasattr(layer, "stats"):
                for k, v in layer.stats().items():
                    tot[k] = tot.get(k, 0) + v
            elif getattr(layer, "is_initialized", False) and layer.keys is not None:
                tot["tier_bytes"] += layer.keys.numel() * layer.keys.element_size() * 2
                tot["resident_bytes"] += layer.keys.numel() * layer.keys.element_size() * 2
                tot["elements"] += layer.keys.numel() * 2
        kv_bytes = tot["body_bytes"] + tot["tier_bytes"]
        return {
            "kv_bytes": kv_bytes,
            "kv_bytes_bf16": tot["elements"] * 2,
            "body_bytes": tot["body_bytes"],
            "tier_bytes": tot["tier_bytes"],
            "rotation_bytes": self.rotation_bytes,
            "key_map_bytes": self.key_map_bytes,
            "scratch_bytes": tot["scratch_bytes"],
            "pool_bytes": tot["pool_bytes"],
            "resident_bytes": tot["resident_bytes"],
            "artifact_bytes": self.artifact.nbytes if self.artifact is not None else 0,
            "bits_per_element": 8 * kv_bytes / tot["elements"] if tot["elements"] else 0.0,
            "body_bits_per_element": 8 * tot["body_bytes"] / tot["body_elements"] if tot["body_elements"] else 0.0,
            "elements": tot["elements"],
            "key_fit_length": self.key_fit_length,
        }

    def widths(self) -> list[int | None]:
        """Current body width of every layer (None: not progressive)."""
        return [layer.bits if isinstance(layer, ProgressiveLayer) else None for layer in self.layers]

    def kv_bytes(self) -> int:
        return int(self.stats()["kv_bytes"])

    def bits_per_element(self) -> float:
        return float(self.stats()["bits_per_element"])


def make_cache(model, spec: CacheSpec | str, artifact: Artifact | str | None = None,
               context_length: int | None = None, **overrides) -> RotkvCache:
    """A RotkvCache for a preset name or spec; ``bf16`` also goes through rotkv (unquantized tiers).
    A spec with ``budget_tokens`` gets budgeted layers (progressive precision or eviction).
    ``context_length``: expected tokens per row, picks the artifact's key fit (see RotkvCache)."""
    return RotkvCache(model, spec, artifact, context_length=context_length, **overrides)
