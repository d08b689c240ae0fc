"""Cache assembly: what every layer of a :class:`~rotkv.cache.RotkvCache` is, resolved once, then built.

:func:`plan_cache` reads the model, the spec and the artifact once and resolves, per layer: its
kind, rotation, (key, value) codecs (their widths, group size, clip ratios and metadata dtypes)
and byte budget; the widths from :func:`rotkv.cache.widths.resolve_widths`, called once here.
:func:`build_layer` makes the layer a :class:`LayerPlan` describes. Nothing is built and then replaced.

Layer kinds:

- ``sliding``: a sliding-window layer of the model, kept bf16 (transformers' own layer);
- ``paged``: :class:`~rotkv.cache.layer.HybridLayer`, sink + quantized body + window over page pools;
- ``progressive``: :class:`~rotkv.cache.progressive.ProgressiveLayer` (``spec.start_bits`` set), a
  body that shrinks to its final width to stay within its budget;
- ``evicting``: :class:`~rotkv.cache.progressive.EvictingLayer` (``budget_tokens`` without
  ``start_bits``), fixed width, oldest tokens dropped over budget.

Imports run one way: cache -> assembly -> layer, progressive, rowstore, codecs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from rotkv.cache.base import tier_dtype
from rotkv.cache.codecs import fixed_codecs, with_key_table
from rotkv.cache.layer import HybridLayer
from rotkv.cache.plan import PageState
from rotkv.cache.progressive import EvictingLayer, ProgressiveCodec, ProgressiveLayer, layer_budget
from rotkv.cache.widths import check_width_sources, resolve_widths
from rotkv.config import CacheSpec, artifact_file, artifact_kind, get_preset
from rotkv.contract import make_command, validate_artifact
from rotkv.hf import compat
from rotkv.hf.geometry import model_geometry
from rotkv.hf.models import check_supported, mean_centering_blocker, sliding_layers
from rotkv.quant.quantizer import check_group
from rotkv.rotations.artifact import Artifact, load_artifact, pick_key_fit
from rotkv.rotations.base import LayerRotation
from rotkv.rotations.registry import build_rotations

KINDS = ("sliding", "paged", "progressive", "evicting")


@dataclass(frozen=True)
class LayerPlan:
    """One layer of a cache, resolved.

    kind: one of :data:`KINDS` (see the module docstring).
    rotation: the layer's rotations, key mean and clip ratios (identity for sliding layers).
    codecs: (key codec, value codec), each with its width, group size, clip ratio and metadata
        dtype; None for an unquantized layer (and sliding ones).
    window: a sliding layer's window size.
    budget: bytes one sequence may hold in the layer (progressive and evicting layers).
    final_bits: a progressive layer's final width.
    """

    index: int
    kind: str
    rotation: LayerRotation
    codecs: tuple | None = None
    window: int | None = None
    budget: int | None = None
    final_bits: int | None = None

    @property
    def widths(self) -> tuple[int, int] | None:
        """(key bits, value bits) of the body as written now (a progressive layer's start width)."""
        return None if self.codecs is None else (self.codecs[0].bits, self.codecs[1].bits)


@dataclass(frozen=True)
class CachePlan:
    """A whole cache, resolved: the spec, the model's geometry, the artifact read and one plan per layer."""

    spec: CacheSpec
    kv_heads: int
    head_dim: int
    artifact: Artifact | None
    layers: tuple[LayerPlan, ...]
    key_maps: tuple | None = None  # `predict_keys`: [None, A_1, ...] (rotkv.cache.predict), else None

    @property
    def rotation_bytes(self) -> int:
        return sum(lp.rotation.nbytes for lp in self.layers)


def resolve_spec(spec: CacheSpec | str, **overrides) -> CacheSpec:
    """A CacheSpec from a preset name or a spec, with field overrides (``sink=16, window=64``)."""
    if not isinstance(spec, (str, CacheSpec)):
        raise TypeError(f"spec has to be a preset name (e.g. 'quarot-int2') or a CacheSpec, not {spec!r}")
    return get_preset(spec, **overrides) if isinstance(spec, str) else spec.replace(**overrides)


def layer_rotations(model, spec: CacheSpec, artifact: Artifact | str | None,
                    context_length: int | None = None) -> tuple[list[LayerRotation], Artifact | None]:
    """Every layer's rotation: the artifact's for ``rotation="artifact"`` (loaded and checked against the
    model and the spec; with ``context_length``, its key fit picked for that length: ``Artifact.for_context``),
    else the data-free ones of ``spec.rotation``; and the artifact read (or None)."""
    layers, kv_heads, head_dim = model_geometry(model.config)
    if spec.needs_artifact:
        if artifact is None:
            raise ValueError(
                f"preset {spec.name!r} needs a calibration artifact (rotations, key means, clip ratios); make one with "
                f"`{make_command(artifact_kind(spec))}` and pass --artifact {artifact_file(spec)}"
            )
        artifact = load_artifact(artifact) if isinstance(artifact, str) else artifact
        validate_artifact(artifact, model, spec)
        artifact = artifact.for_context(context_length)
        rots = [artifact.layer_rotation(i) for i in range(layers)]
        if not spec.key_mean:
            rots = [dataclasses.replace(r, k_mean=None) for r in rots]
        if artifact.values_folded and not getattr(model.config, "rotkv_values_folded", False):
            raise ValueError(
                f"artifact {artifact.path} has R_V folded into the weights, but this model is not folded; "
                "fold it with rotkv.hf.folding before building the cache"
            )
        return rots, artifact
    if spec.key_mean:
        raise ValueError("`key_mean` needs calibrated means: use rotation='artifact'")
    return build_rotations(spec.rotation, layers, kv_heads, head_dim, spec.seed, spec.rotate_values), None


def _check(model, spec: CacheSpec, num_layers: int, head_dim: int, layer_bits) -> None:
    """The checks that need the model: group size, `k_bits` layers, mean-centering, `layer_bits`."""
    if spec.quantized:
        check_group(spec.resolved_group(head_dim), head_dim)
    check_width_sources(spec, num_layers, layer_bits)
    if spec.key_mean:
        why = mean_centering_blocker(model)
        if why:
            raise ValueError(f"key mean-centering is not exact on this model ({why}); use a preset without key_mean")


def plan_cache(model, spec: CacheSpec, artifact: Artifact | str | None = None, layer_bits=None,
               context_length: int | None = None) -> CachePlan:
    """Resolve every layer of a cache for ``model`` once: kind, rotation, codecs, widths, clip ratios, budget.

    artifact: an Artifact or a path; read for ``rotation="artifact"`` (rotations, key means, clip
    ratios, ``k_bits``) and, for a budgeted spec, for its per-layer final widths (``bits``).
    layer_bits: per-layer ``(key bits, value bits)`` of the token codec (see RotkvCache).
    context_length: expected tokens per row; picks the artifact's key fit (see RotkvCache).
    Every bad input raises here, before any layer exists.
    """
    check_supported(model)
    num_layers, kv_heads, head_dim = model_geometry(model.config)
    _check(model, spec, num_layers, head_dim, layer_bits)
    if context_length is not None:
        pick_key_fit((), context_length)  # a bad length fails whatever the preset
    rotations, art = layer_rotations(model, spec, artifact, context_length)
    budgeted = spec.budget_tokens is not None
    if budgeted and art is None and artifact is not None:  # rotation-free budgeted presets read only `bits`
        art = load_artifact(artifact) if isinstance(artifact, str) else artifact
        validate_artifact(art, model)
    widths = resolve_widths(spec, num_layers, art, layer_bits)
    g = spec.resolved_group(head_dim)
    tier_size = torch.empty(0, dtype=tier_dtype(spec, model.dtype)).element_size()
    windows = sliding_layers(model)
    layers = []
    for i, r in enumerate(rotations):
        if windows[i] is not None:
            layers.append(LayerPlan(i, "sliding", r, window=windows[i]))
            continue
        clip_k, clip_v = r.clip_k or spec.clip_k, r.clip_v or spec.clip_v
        w = widths[i]
        if spec.start_bits is not None:
            codecs = tuple(ProgressiveCodec(w.key, w.final, g, clip, spec.anchor, spec.shift) for clip in (clip_k, clip_v))
            budget = layer_budget(spec, w.final, kv_heads, head_dim, tier_size)
            layers.append(LayerPlan(i, "progressive", r, codecs, budget=budget, final_bits=w.final))
            continue
        codecs = None
        if spec.quantized:
            codecs = fixed_codecs(spec, w, g, clip_k, clip_v)
            if layer_bits is None:  # a calibrated key format (`k_table`), if any; layer_bits keeps the token codec
                codecs = with_key_table(spec, art, i, codecs)
        if budgeted:  # a fixed width (w.final: spec.bits), oldest tokens evicted over budget
            budget = layer_budget(spec, w.final, kv_heads, head_dim, tier_size)
            layers.append(LayerPlan(i, "evicting", r, codecs, budget=budget))
        else:
            layers.append(LayerPlan(i, "paged", r, codecs))
    key_maps = None
    if spec.predict_keys:
        from rotkv.cache.predict import load_key_maps

        if any(lp.kind != "paged" for lp in layers):
            raise ValueError(f"preset {spec.name!r} (`predict_keys`) needs every layer in rotkv's paged pools; this "
                             "model has sliding-window layers")
        key_maps = tuple(load_key_maps(art, spec.name, num_layers, kv_heads, head_dim))
    return CachePlan(spec, kv_heads, head_dim, art, tuple(layers), key_maps)


def build_layer(lp: LayerPlan, plan: CachePlan, model_dtype: torch.dtype, state: PageState,
                check_finite: bool = True, decode_score: str | None = None):
    """The layer object ``lp`` describes. ``state`` is the cache's shared PageState (paged layers);
    ``check_finite`` and ``decode_score`` apply to paged layers (the per-row layers always check)."""
    args = (plan.spec, lp.rotation, plan.head_dim, plan.kv_heads, lp.index)
    if lp.kind == "sliding":
        return compat.sliding_layer(lp.window)
    if lp.kind == "paged":
        return HybridLayer(*args, lp.codecs, model_dtype, state=state, check_finite=check_finite,
                           decode_score=decode_score)
    if lp.kind == "progressive":
        return ProgressiveLayer(*args, codecs=lp.codecs, model_dtype=model_dtype, final_bits=lp.final_bits, budget=lp.budget)
    if lp.kind == "evicting":
        return EvictingLayer(*args, codecs=lp.codecs, model_dtype=model_dtype, budget=lp.budget)
    raise ValueError(f"`kind` has to be one of {list(KINDS)} but got {lp.kind!r}")
