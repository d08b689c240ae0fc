"""The one list of methods: name -> :class:`RotationMethod`. Everything that names methods derives from it:
``rotkv calibrate --method`` choices, the calibration driver (rotkv.calibrate.run), the data-free
rotations of a CacheSpec (:func:`build_rotations`, ``rotkv.config.ROTATIONS``), the artifact file an
evaluation looks for (``rotkv.config.artifact_file``), and the tests that run every method.

Adding a method touches three places: its own file here (``rotkv/rotations/<name>.py`` with ``fit``
and/or ``build``), one :func:`register` line below, and its preset in ``rotkv.config.PRESETS``
(``method="<name>"``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Union

Ref = Union[Callable, str, None]  # a function, or "module:function" imported when first used


@dataclass(frozen=True)
class FitOptions:
    """What a fit reads besides the statistics: head_dim, one rotation per layer or per KV head, and
    OSCAR's value-covariance form."""

    head_dim: int
    granularity: str = "layer"
    cs: str = "exact"


@dataclass(frozen=True)
class RotationMethod:
    """One rotation method (or lever) and how the rest of rotkv uses it.

    fit, build and refine are functions or ``"module:function"`` strings (so listing the methods, as the
    command line does, imports no torch); :meth:`fn` resolves them.

    fit: ``(layer stats, FitOptions) -> (R_K, R_V [H, D, D], extra tensors)``, a rotation from
        calibration statistics (rotkv.calibrate.stats.LayerStats); None: not fitted.
    build: ``(head_dim, layer, seed) -> R [D, D] or None (identity)``, a data-free rotation usable as
        ``CacheSpec.rotation=<name>`` with no artifact; None: needs an artifact.
    refine: trains the rotations of a ``base`` method against held-out data (OptR's
        ``optimize_layer`` signature); its artifact starts from the base's fit.
    widths: allocates per-layer bit widths (no rotations); run by its own calibration driver.
    granularity: the default of ``rotkv calibrate --granularity``.
    uses_cs: the fit reads OSCAR's value-covariance form (``--cs``; recorded in the metadata).
    base: can be the starting rotation of a refining method (``rotkv calibrate --base``).
    preset: the preset that reads this method's artifact (documentation, the tests check it).
    """

    name: str
    summary: str
    fit: Ref = None
    build: Ref = None
    refine: Ref = None
    widths: bool = False
    granularity: str = "layer"
    uses_cs: bool = False
    base: bool = False
    preset: str | None = None

    @property
    def needs_calibration(self) -> bool:
        """``rotkv calibrate --method <name>`` makes an artifact for it."""
        return self.fit is not None or self.refine is not None or self.widths

    def fn(self, role: str) -> Callable | None:
        """The ``fit``, ``build`` or ``refine`` function (imported on first use), or None."""
        ref = getattr(self, role)
        if isinstance(ref, str):
            module, _, name = ref.partition(":")
            return getattr(importlib.import_module(module), name)
        return ref


METHODS: dict[str, RotationMethod] = {}
DEFAULT_METHOD = "oscar"  # the calibration rotkv recommends: `rotkv calibrate --base`, CalibConfig, hints


def register(method: RotationMethod) -> RotationMethod:
    """Add ``method`` (or replace the one of the same name); returns it."""
    METHODS[method.name] = method
    return method


def unregister(name: str) -> None:
    METHODS.pop(name, None)


def get(name: str) -> RotationMethod:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; registered: {list(METHODS)}")
    return METHODS[name]


def calibrated() -> list[str]:
    """Every method ``rotkv calibrate --method`` accepts, in registration order."""
    return [m.name for m in METHODS.values() if m.needs_calibration]


def rotation_fits() -> list[str]:
    """The methods the rotation driver (rotkv.calibrate.run) fits: a fit or a refinement, no widths."""
    return [m.name for m in METHODS.values() if (m.fit or m.refine) and not m.widths]


def bases() -> list[str]:
    return [m.name for m in METHODS.values() if m.base]


def data_free() -> list[str]:
    """The rotations a CacheSpec builds without an artifact (``CacheSpec.rotation``)."""
    return [m.name for m in METHODS.values() if m.build is not None]


def build_rotations(kind: str, num_layers: int, kv_heads: int, head_dim: int, seed: int = 0,
                    rotate_values: bool = True) -> list:
    """Data-free rotations for every layer (``kind`` one of :func:`data_free`)."""
    from rotkv.rotations.base import LayerRotation

    if kind not in data_free():
        raise ValueError(f"`rotation` has to be one of {data_free()} here but got {kind!r}")
    build = METHODS[kind].fn("build")
    out = []
    for layer in range(num_layers):
        r = build(head_dim, layer, seed)
        if r is None:
            out.append(LayerRotation())
            continue
        r = r.expand(kv_heads, head_dim, head_dim).contiguous()
        out.append(LayerRotation(R_K=r, R_V=r if rotate_values else None))
    return out


# ---- the methods, in the order the command line lists them ---------------------------------------------
_R = "rotkv.rotations."
register(RotationMethod("identity", "no rotation (naive INT2)", build=_R + "identity:build", preset="naive-int2"))
register(RotationMethod("hadamard", "R = H, data-oblivious (QuaRot)", fit=_R + "hadamard:fit", build=_R + "hadamard:build",
                        base=True, preset="quarot-int2"))
register(RotationMethod("random", "a seeded Haar-random rotation per layer", build=_R + "identity:build_random"))
register(RotationMethod("oscar", "R = U H P_br from the query / attention-output covariances", fit=_R + "oscar:fit",
                        uses_cs=True, base=True, preset="oscar-int2"))
register(RotationMethod("optr", "R = R_base expm(A - A^T), learned per KV head against the error after W_O",
                        refine=_R + "optr:optimize_layer", granularity="kv-head", uses_cs=True, preset="optr-int2"))
register(RotationMethod("pairwise", "RoPE-aligned SO(2) rotations of the channel pairs", fit=_R + "pairwise:fit"))
register(RotationMethod("pmkvq", "per-layer final widths for progressive precision (PM-KVQ; rotkv.rotations.pmkvq)",
                        widths=True, preset="pmkvq"))
