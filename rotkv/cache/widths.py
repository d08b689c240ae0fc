"""A layer's widths, resolved from every source in one place.

The sources, each read here and nowhere else:

- ``spec.bits``: every layer's keys and values (None: unquantized);
- ``spec.k_bits`` as ``"LAYERS:BITS"`` items: those layers' keys (their clip ratio is dropped: the
  ratios are fitted for ``bits``);
- ``spec.k_bits="artifact"``: the artifact's ``k_bits [L]``, each layer's keys, likewise;
- ``spec.start_bits`` (progressive precision): the width every layer starts at, shrinking to its final
  width, the artifact's ``bits [L]`` where it has them, else ``spec.bits``;
- ``budget_tokens`` without ``start_bits``: a fixed width, ``spec.bits``, whatever widths an artifact carries;
- ``layer_bits``: per-layer ``(key bits, value bits)`` from the caller (``RotkvCache(layer_bits=...)``),
  replacing the widths of the token codec; the clip ratios stay what ``k_bits`` resolves.

:func:`check_width_sources` refuses bad sources before anything is read; :func:`resolve_widths` gives one
:class:`LayerWidth` per layer. :func:`rotkv.cache.assembly.plan_cache` calls both once per cache, and
the vLLM backend's layer codecs (``rotkv.integrations.vllm.config``) and calibration's key grids read
the same :func:`resolve_widths`.
"""

from __future__ import annotations

from dataclasses import dataclass

from rotkv.config import CacheSpec, artifact_kind, parse_layer_bits
from rotkv.quant.widths import WIDTHS


@dataclass(frozen=True)
class LayerWidth:
    """One layer's widths.

    key, value: bits the body is written at (a progressive layer's start width); None: unquantized.
    final: the width a budgeted layer's budget counts (a progressive layer shrinks to it); None
        without a budget.
    clip_key: the keys take the clip ratio (False where ``k_bits`` puts them at a width other than ``bits``).
    """

    key: int | None
    value: int | None
    final: int | None = None
    clip_key: bool = True


def check_width_sources(spec: CacheSpec, num_layers: int, layer_bits=None) -> None:
    """Refuse width sources that do not fit a model of ``num_layers`` layers: ``k_bits`` naming a layer
    it does not have, ``layer_bits`` of the wrong length or widths, or for a spec it cannot apply to."""
    if spec.k_bits and spec.k_bits != "artifact":
        bad = sorted(i for i in parse_layer_bits(spec.k_bits) if i >= num_layers)
        if bad:
            raise ValueError(f"`k_bits` names layers {bad} but the model has {num_layers} layers (0-{num_layers - 1})")
    if layer_bits is not None:
        if len(layer_bits) != num_layers or spec.codec != "token" or not spec.quantized or spec.budget_tokens is not None:
            raise ValueError(f"layer_bits needs one (key bits, value bits) pair per layer ({num_layers}) and a "
                             f"quantized token-codec spec without a budget")
        for kb, vb in layer_bits:
            if kb not in WIDTHS or vb not in WIDTHS:
                raise ValueError(f"layer_bits entries must be in {WIDTHS}, got {(kb, vb)}")


def final_widths(spec: CacheSpec, artifact, num_layers: int) -> list[int | None]:
    """Per-layer final widths of a budgeted cache: the artifact's ``bits [L]`` when it has them, else ``spec.bits``."""
    if artifact is not None and "bits" in artifact.tensors:
        bits = [int(b) for b in artifact.tensors["bits"].tolist()]
        if len(bits) != num_layers:
            raise ValueError(f"artifact {artifact.path} has {len(bits)} widths in `bits` for {num_layers} layers")
        return bits
    return [spec.bits] * num_layers


def artifact_key_bits(spec: CacheSpec, artifact) -> list[int] | None:
    """The artifact's per-layer key widths for ``k_bits="artifact"`` (None for any other spec); an
    artifact without them is refused with the command that makes them."""
    if spec.k_bits != "artifact":
        return None
    if artifact is None or "k_bits" not in artifact.tensors:
        from rotkv.contract import make_command

        raise ValueError("`k_bits`='artifact' needs an artifact with per-layer key widths (`k_bits`); make one with "
                         f"`{make_command(artifact_kind(spec))}`")
    return [int(b) for b in artifact.tensors["k_bits"].tolist()]


def resolve_widths(spec: CacheSpec, num_layers: int, artifact=None, layer_bits=None) -> tuple[LayerWidth, ...]:
    """Every layer's :class:`LayerWidth` from the sources in the module docstring (checked first:
    :func:`check_width_sources`). ``artifact``: the artifact read (its ``k_bits`` and ``bits``), or None."""
    check_width_sources(spec, num_layers, layer_bits)
    key_bits = artifact_key_bits(spec, artifact)
    ranges = parse_layer_bits(spec.k_bits) if spec.k_bits and key_bits is None else {}
    budgeted = spec.budget_tokens is not None
    finals = final_widths(spec, artifact, num_layers) if budgeted else None
    out = []
    for i in range(num_layers):
        if spec.start_bits is not None:
            final = finals[i]
            if final is None or final > spec.start_bits:
                raise ValueError(f"layer {i}: final width {final} has to be one of {list(WIDTHS)} and <= start_bits "
                                 f"{spec.start_bits}")
            out.append(LayerWidth(spec.start_bits, spec.start_bits, final))
            continue
        kb = key_bits[i] if key_bits is not None else ranges.get(i, spec.bits)
        clip_key = kb == spec.bits
        vb = spec.bits
        if layer_bits is not None:
            kb, vb = layer_bits[i]
        out.append(LayerWidth(kb, vb, spec.bits if budgeted else None, clip_key))
    return tuple(out)
