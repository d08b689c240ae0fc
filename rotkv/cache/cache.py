"""RotkvCache: the transformers ``Cache`` made of hybrid layers (bf16 for sliding-window layers)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache

from rotkv.cache.codecs import TokenCodec, make_codecs, with_key_table
import numpy as np

from rotkv.cache.layer import HybridLayer
from rotkv.cache.plan import PageState
from rotkv.config import CacheSpec, get_preset, parse_layer_bits
from rotkv.hf import compat
from rotkv.hf.attention import install
from rotkv.hf.models import check_supported, mean_centering_blocker, sliding_layers
from rotkv.quant.quantizer import check_group
from rotkv.rotations.artifact import Artifact, load_artifact, model_geometry, validate_artifact
from rotkv.rotations.base import LayerRotation
from rotkv.rotations.registry import build_rotations


def resolve_spec(spec: CacheSpec | str, **overrides) -> CacheSpec:
    return get_preset(spec, **overrides) if isinstance(spec, str) else spec.replace(**overrides)


def layer_rotations(model, spec: CacheSpec, artifact: Artifact | str | None) -> tuple[list[LayerRotation], Artifact | None]:
    layers, kv_heads, head_dim = model_geometry(model.config)
    if spec.needs_artifact:
        if artifact is None:
            method = spec.method or (spec.name.split("-")[0] if spec.name != "custom" else "oscar")
            raise ValueError(
                f"preset {spec.name!r} needs a calibration artifact (rotations, key means, clip ratios); make one with "
                f"`rotkv calibrate --method {method} --out {method}.safetensors` and pass --artifact {method}.safetensors"
            )
        artifact = load_artifact(artifact) if isinstance(artifact, str) else artifact
        validate_artifact(artifact, model, spec)
        rots = [artifact.layer_rotation(i) for i in range(layers)]
        if not spec.key_mean:
            rots = [LayerRotation(r.R_K, r.R_V, None, r.clip_k, r.clip_v) for r in rots]
        if artifact.values_folded and not getattr(model.config, "rotkv_values_folded", False):
            raise ValueError(
                f"artifact {artifact.path} has R_V folded into the weights, but this model is not folded; "
                "fold it with rotkv.rotations.folding before building the cache"
            )
        return rots, artifact
    if spec.key_mean:
        raise ValueError("`key_mean` needs calibrated means: use rotation='artifact'")
    return build_rotations(spec.rotation, layers, kv_heads, head_dim, spec.seed, spec.rotate_values), None


class RotkvCache(Cache):
    """A drop-in KV cache: ``model.generate(..., past_key_values=RotkvCache(model, "quarot-int2"))``.

    Full-attention layers get a :class:`HybridLayer` (bf16 sink + quantized body + bf16 window)
    over page pools, all sharing one :class:`~rotkv.cache.plan.PageState` (the page lists and
    free lists of the batch); sliding-window layers stay bf16 (transformers' own layer).
    Building the cache registers the "rotkv" attention function and switches the model to it.

    check_finite: refuse NaN/Inf keys and values (nothing is stored). It costs one device sync
    per layer on the GPU; the CUDA-graph decode (``rotkv.cache.graph``) runs without it.
    layer_bits: per-layer ``(key bits, value bits)`` of the token codec (each 2 or 4 for the GPU
    kernels; 8 runs the reference path), one pair per model layer; None: ``spec.bits`` everywhere.
    decode_score: the decode kernels' score variant ("auto", "bf16", "int8"; see
    ``rotkv.kernels.decode.DecodeConfig.score``); None: ``ROTKV_DECODE_SCORE`` or "auto".
    """

    def __new__(cls, model=None, spec: CacheSpec | str = "quarot-int2", artifact=None, check_finite: bool = True,
                layer_bits=None, decode_score: str | None = None, **overrides):
        # a spec with a memory budget (pmkvq, oscar-pmkvq, ...) needs budgeted layers: hand back a
        # BudgetCache (a subclass, so Python then runs its __init__ with the same arguments)
        if cls is RotkvCache and model is not None and resolve_spec(spec, **overrides).budget_tokens is not None:
            from rotkv.cache.progressive import BudgetCache

            cls = BudgetCache
        return super().__new__(cls)

    def __init__(self, model, spec: CacheSpec | str = "quarot-int2", artifact: Artifact | str | None = None,
                 check_finite: bool = True, layer_bits=None, decode_score: str | None = None, **overrides):
        check_supported(model)
        self.spec = resolve_spec(spec, **overrides)
        num_layers, kv_heads, head_dim = model_geometry(model.config)
        self.head_dim, self.kv_heads = head_dim, kv_heads
        if self.spec.quantized:
            check_group(self.spec.resolved_group(head_dim), head_dim)
        if self.spec.k_bits and self.spec.k_bits != "artifact":
            bad = sorted(i for i in parse_layer_bits(self.spec.k_bits) if i >= num_layers)
            if bad:
                raise ValueError(f"`k_bits` names layers {bad} but the model has {num_layers} layers (0-{num_layers - 1})")
        if self.spec.key_mean:
            why = mean_centering_blocker(model)
            if why:
                raise ValueError(f"key mean-centering is not exact on this model ({why}); use a preset without key_mean")
        rotations, self.artifact = layer_rotations(model, self.spec, artifact)
        artifact_bits = None
        if self.spec.k_bits == "artifact":
            if self.artifact is None or "k_bits" not in self.artifact.tensors:
                raise ValueError("`k_bits`='artifact' needs an artifact with per-layer key widths (`k_bits`); make one with "
                                 "`python -m rotkv.calibrate.keybits --base-artifact A --layers N --out B`")
            artifact_bits = [int(b) for b in self.artifact.tensors["k_bits"].tolist()]
        windows = sliding_layers(model)
        sp = self.spec
        self.state = PageState(sp.sink, sp.window, sp.page_size, sp.quantized, sp.prefill_chunk)
        if layer_bits is not None:
            if len(layer_bits) != num_layers or self.spec.codec != "token" or not self.spec.quantized:
                raise ValueError(f"layer_bits needs one (key bits, value bits) pair per layer ({num_layers}) and a "
                                 f"quantized token-codec spec")
            for kb, vb in layer_bits:
                if kb not in (2, 4, 8) or vb not in (2, 4, 8):
                    raise ValueError(f"layer_bits entries must be in (2, 4, 8), got {(kb, vb)}")
        layers = []
        for i in range(num_layers):
            if windows[i] is not None:
                layers.append(compat.sliding_layer(windows[i]))
                continue
            codecs = None
            if self.spec.quantized:
                r = rotations[i]
                codecs = make_codecs(self.spec.codec, self.spec.bits, self.spec.resolved_group(head_dim),
                                     r.clip_k or self.spec.clip_k, r.clip_v or self.spec.clip_v,
                                     self.spec.key_bits(i, artifact_bits), self.spec.meta_k, self.spec.meta_v)
                codecs = with_key_table(self.spec, self.artifact, i, codecs)
                if layer_bits is not None:
                    kc, vc = codecs
                    codecs = (TokenCodec(layer_bits[i][0], kc.group_size, kc.clip, kc.meta),
                              TokenCodec(layer_bits[i][1], vc.group_size, vc.clip, vc.meta))
            layers.append(HybridLayer(self.spec, rotations[i], head_dim, kv_heads, i, codecs, model.dtype,
                                      state=self.state, check_finite=check_finite))
            layers[-1].decode_score = decode_score
        super().__init__(layers=layers)
        self.rotation_bytes = sum(r.nbytes for r in rotations)
        install(model)

    # ---- batch edits: one page-list edit, then every layer copies the pages it must ---------------
    def _select_rows(self, index) -> None:
        index = np.asarray(index.tolist() if isinstance(index, torch.Tensor) else index, dtype=np.int64)
        paged = [layer for layer in self.layers if isinstance(layer, HybridLayer)]
        if paged and paged[0].is_initialized:
            copies = self.state.select_rows(index)
            for layer in paged:
                layer.pools.fit(self.state.tier_free.capacity, self.state.body_free.capacity)
                layer.pools.copy_pages(*(torch.as_tensor(c, device=layer.device) for c in copies))
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
        """Measured resident bytes and bits per element over every layer and tier.

        kv_bytes counts codes, metadata and the bf16 tiers of the stored tokens (and bf16 sliding
        layers); rotation matrices and means are reported apart as rotation_bytes, the PyTorch
        reference reader's float32 mirror of the body (not part of the cache format; the GPU
        kernels have none) as scratch_bytes, and the pools' allocated capacity (free pages
        included) as pool_bytes.
        """
        tot = {"tokens": 0, "body_tokens": 0, "body_bytes": 0, "tier_bytes": 0, "scratch_bytes": 0, "elements": 0,
               "body_elements": 0, "pool_bytes": 0}
        for layer in self.layers:
            if hasattr(layer, "stats"):
                for k, v in layer.stats().items():
                    tot[k] = tot.get(k, 0) + v
            elif getattr(layer, "is_initialized", False) and layer.keys is not None:
                tot["tier_bytes"] += layer.keys.numel() * layer.keys.element_size() * 2
                tot["elements"] += layer.keys.numel() * 2
        kv_bytes = tot["body_bytes"] + tot["tier_bytes"]
        return {
            "kv_bytes": kv_bytes,
            "kv_bytes_bf16": tot["elements"] * 2,
            "body_bytes": tot["body_bytes"],
            "tier_bytes": tot["tier_bytes"],
            "rotation_bytes": self.rotation_bytes,
            "scratch_bytes": tot["scratch_bytes"],
            "pool_bytes": tot["pool_bytes"],
            "artifact_bytes": self.artifact.nbytes if self.artifact is not None else 0,
            "bits_per_element": 8 * kv_bytes / tot["elements"] if tot["elements"] else 0.0,
            "body_bits_per_element": 8 * tot["body_bytes"] / tot["body_elements"] if tot["body_elements"] else 0.0,
            "elements": tot["elements"],
        }

    def kv_bytes(self) -> int:
        return int(self.stats()["kv_bytes"])

    def bits_per_element(self) -> float:
        return float(self.stats()["bits_per_element"])


def make_cache(model, spec: CacheSpec | str, artifact: Artifact | str | None = None, **overrides) -> Cache:
    """A RotkvCache for a preset name or spec; ``bf16`` also goes through rotkv (unquantized tiers).
    A spec with ``budget_tokens`` gets budgeted layers (progressive precision or eviction)."""
    return RotkvCache(model, spec, artifact, **overrides)
