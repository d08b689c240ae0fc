"""The backend's settings, read from vLLM's configuration surface.

A user picks the preset, the artifact and any cache field through ``additional_config``::

    LLM(model, attention_backend="CUSTOM", additional_config={"rotkv": {"preset": "oscar-mix",
        "artifact": "oscar-mix.safetensors"}})
    vllm serve MODEL --attention-backend CUSTOM --additional-config '{"rotkv": {"preset": "quarot-int2"}}'

Keys: ``preset``, ``artifact``, ``context_length``, ``spare_slots``, ``cuda_graphs`` and the :class:`~rotkv.config.CacheSpec`
fields listed in :data:`SPEC_KEYS`. Every bad value raises a ValueError naming the key.

:func:`layer_settings` resolves what one layer stores: its rotation (artifact or data-free), its key and
value codecs (widths, group size, clip ratios, metadata dtypes). It mirrors the paged layers of
``rotkv.cache.assembly.plan_cache`` without a transformers model (vLLM gives the geometry).
"""

from __future__ import annotations

import json
import os
import dataclasses
from dataclasses import dataclass, field

from rotkv.cache.codecs import TokenCodec, fixed_codecs
from rotkv.cache.widths import resolve_widths
from rotkv.config import RECOMMENDED_PRESET, CacheSpec, get_preset
from rotkv.quant.quantizer import check_group
from rotkv.rotations.base import LayerRotation

WHERE = 'additional_config["rotkv"]'
DEFAULT_PRESET = "int4"  # without a preset and an artifact: 4 bits, no calibration, keeps the answer
# the CacheSpec fields a user may override from vLLM (the others are format choices this backend fixes)
SPEC_KEYS = ("sink", "window", "window_share", "group_size", "clip_k", "clip_v", "k_bits", "meta_k", "meta_v",
             "key_mean", "rotate_values", "seed", "page_size", "refine_tokens", "refine_values", "refine_every")
OWN_KEYS = ("preset", "artifact", "context_length", "spare_slots", "cuda_graphs")
PAGE_SIZE = 16  # the vLLM block size the backend accepts (one block = one body page)


@dataclass(frozen=True)
class VllmSettings:
    """The resolved settings: the spec, the artifact path, the context length that picks an artifact's key
    fit (None: vLLM's max_model_len), the side pool's request slots beyond ``max_num_seqs``, and whether
    decode batches run in vLLM's full CUDA graphs (``cuda_graphs``)."""

    spec: CacheSpec
    artifact: str | None = None
    context_length: int | None = None
    spare_slots: int = 8
    raw: dict = field(default_factory=dict, compare=False)
    cuda_graphs: bool = True


def _raw(additional_config) -> dict:
    """The ``rotkv`` dict from vLLM's additional_config (a dict, or an object holding one), else {}."""
    if additional_config is not None and not isinstance(additional_config, dict):
        additional_config = getattr(additional_config, "__dict__", None)
    if not isinstance(additional_config, dict) or "rotkv" not in additional_config:
        return {}
    raw = additional_config["rotkv"]
    if isinstance(raw, str):  # --additional-config '{"rotkv": "{...}"}' or a preset name alone
        try:
            raw = {"preset": raw} if not raw.strip().startswith("{") else json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"{WHERE} must hold a JSON object like '{{\"preset\": \"int4\"}}': {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{WHERE} must be a dict like {{\"preset\": \"int4\"}}, got {type(raw).__name__}")
    return raw


def default_preset(artifact: str | None) -> str:
    """The preset served without a ``preset`` key, as rotkv picks it (``rotkv.contract.default_preset``): the
    recommended preset where the artifact serves it, else the first preset the artifact was made for
    (``rotkv.contract.presets_served``), of those this backend serves; without an artifact :data:`DEFAULT_PRESET`."""
    if artifact is None or not os.path.isfile(artifact):
        return DEFAULT_PRESET
    from rotkv.contract import presets_served
    from rotkv.rotations.artifact import load_artifact

    art = load_artifact(artifact)
    for name in sorted(presets_served(art.kind), key=lambda n: n != RECOMMENDED_PRESET):
        try:
            check_spec(get_preset(name))
        except ValueError:
            continue
        return name
    raise ValueError(f'{WHERE}["artifact"] {artifact} is {art.describe()}, which no preset this backend serves '
                     f'reads: name a preset in {WHERE}["preset"]')


def parse_settings(additional_config=None) -> VllmSettings:
    """Validate the user's settings (see the module docstring) into a :class:`VllmSettings`."""
    raw = dict(_raw(additional_config))
    unknown = sorted(set(raw) - set(SPEC_KEYS) - set(OWN_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {WHERE}; known: {sorted(OWN_KEYS + SPEC_KEYS)}")
    preset = raw["preset"] if "preset" in raw else default_preset(raw.get("artifact"))
    if not isinstance(preset, str):
        raise ValueError(f'{WHERE}["preset"] must be a preset name, got {preset!r}')
    overrides = {k: raw[k] for k in SPEC_KEYS if k in raw}
    try:
        spec = get_preset(preset, **overrides)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{WHERE}: {e}") from None
    check_spec(spec)
    artifact = raw.get("artifact")
    if artifact is not None and not isinstance(artifact, str):
        raise ValueError(f'{WHERE}["artifact"] must be a file path, got {artifact!r}')
    if spec.needs_artifact and artifact is None:
        raise ValueError(f'preset {spec.name!r} needs a calibration artifact: set {WHERE}["artifact"] to the '
                         f'.safetensors file `rotkv calibrate` wrote')
    if artifact is not None and not os.path.isfile(artifact):
        raise ValueError(f'{WHERE}["artifact"]: no such file {artifact!r}')
    ctx = raw.get("context_length")
    if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 1):
        raise ValueError(f'{WHERE}["context_length"] must be a positive int or null, got {ctx!r}')
    spare = raw.get("spare_slots", 8)
    if isinstance(spare, bool) or not isinstance(spare, int) or spare < 0:
        raise ValueError(f'{WHERE}["spare_slots"] must be an int >= 0, got {spare!r}')
    graphs = raw.get("cuda_graphs", True)
    if not isinstance(graphs, bool):
        raise ValueError(f'{WHERE}["cuda_graphs"] must be true or false, got {graphs!r}')
    return VllmSettings(spec, artifact, ctx, spare, raw, graphs)


def check_spec(spec: CacheSpec) -> None:
    """Refuse what the backend does not serve, naming the field."""
    why = []
    if not spec.quantized:
        why.append("an unquantized preset (bf16): serve it with vLLM's own attention backend")
    if spec.codec != "token":
        why.append(f"codec {spec.codec!r} (only the per-token codec, 'token')")
    if spec.bits not in (2, 4, None):
        why.append(f"bits={spec.bits} (the kernels read 2 or 4)")
    if spec.start_bits is not None or spec.budget_tokens is not None:
        why.append("progressive precision or a token budget (start_bits / budget_tokens)")
    if spec.k_table is not None:
        why.append(f"k_table={spec.k_table!r} (a calibrated key format the kernels do not read)")
    if spec.predict_keys:
        why.append("predict_keys=True (each layer's keys are predicted from the previous layer's; eager PyTorch only)")
    if spec.page_size != PAGE_SIZE:
        why.append(f"page_size={spec.page_size} (vLLM's block size must be {PAGE_SIZE}: one block is one page)")
    if why:
        raise ValueError(f"rotkv's vLLM backend cannot serve preset {spec.name!r}: " + "; ".join(why))


@dataclass(frozen=True)
class LayerSettings:
    """What one layer stores: its rotation (all KV heads of the model) and (key, value) codecs."""

    rotation: LayerRotation
    key_codec: TokenCodec
    value_codec: TokenCodec


def load_rotations(settings: VllmSettings, num_layers: int, kv_heads: int, head_dim: int,
                   context_length: int | None = None):
    """(every layer's :class:`LayerRotation` for all ``kv_heads`` heads, the artifact or None), checked
    against the model's geometry (vLLM's, not a transformers model: the artifact's weights fingerprint
    cannot be checked here)."""
    from rotkv.contract import check_contract
    from rotkv.rotations.artifact import ArtifactMismatch, check_model, load_artifact
    from rotkv.rotations.registry import build_rotations

    spec = settings.spec
    if not spec.needs_artifact:
        if spec.key_mean:
            raise ValueError(f"{WHERE}: `key_mean` needs calibrated means: use a preset with rotation='artifact'")
        return build_rotations(spec.rotation, num_layers, kv_heads, head_dim, spec.seed, spec.rotate_values), None
    art = load_artifact(settings.artifact)
    try:
        check_model(art, (num_layers, kv_heads, head_dim))
    except ArtifactMismatch as e:
        raise ValueError(f'{WHERE}["artifact"]: {e}') from None
    check_contract(art, spec)
    if art.values_folded:
        raise ValueError(f'{WHERE}["artifact"] has R_V folded into the model weights; vLLM loads the unfolded '
                         "checkpoint: use an artifact made without folding")
    art = art.for_context(settings.context_length or context_length)
    rots = [art.layer_rotation(i) for i in range(num_layers)]
    if not spec.key_mean:
        rots = [dataclasses.replace(r, k_mean=None) for r in rots]
    return rots, art


def layer_codecs(spec: CacheSpec, layer: int, head_dim: int, rotation: LayerRotation,
                 artifact=None, num_layers: int | None = None) -> tuple[TokenCodec, TokenCodec]:
    """(key codec, value codec) of ``layer`` of ``num_layers`` (None: ``layer + 1``), as
    ``rotkv.cache.assembly.plan_cache`` makes them for a paged layer: its widths from
    :func:`rotkv.cache.widths.resolve_widths`."""
    g = spec.resolved_group(head_dim)
    check_group(g, head_dim)
    try:
        width = resolve_widths(spec, layer + 1 if num_layers is None else num_layers, artifact)[layer]
    except ValueError as e:
        raise ValueError(f"{WHERE}: {e}") from None
    clip_k, clip_v = rotation.clip_k or spec.clip_k, rotation.clip_v or spec.clip_v
    kc, vc = fixed_codecs(spec, width, g, clip_k, clip_v)
    for side, c in (("key", kc), ("value", vc)):
        if c.bits not in (2, 4):
            raise ValueError(f"layer {layer}: {side} width {c.bits} is not one the kernels read (2 or 4)")
    return kc, vc
