"""The methods an evaluation compares: every rotkv preset and the peers, behind one small interface.

A :class:`Method` builds a fresh cache for a model and measures what that cache holds. rotkv presets take
the run's ``--sink``/``--window`` overrides (so methods compare at equal measured bits) and, for
presets with a calibrated rotation, the artifact of the preset's calibration method,
``<artifact_dir>/<method>.safetensors`` (rotkv.config.artifact_file: ``oscar-int2`` reads ``oscar.safetensors``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rotkv.config import PRESETS, artifact_file, artifact_kind, calibration_method, calibration_preset
from rotkv.contract import make_command
from rotkv.eval import peers
from rotkv.hf.geometry import model_geometry

NOMINAL_BITS = {"bf16": 16.0}


@dataclass
class Method:
    name: str
    kind: str  # "rotkv" or "peer"
    bpe_nominal: float
    overrides: dict = field(default_factory=dict)
    artifact: str | None = None

    def build(self, model, context_length: int | None = None):
        """A fresh, empty cache for ``model``; ``context_length`` (tokens per row the unit reaches) picks the
        key fit of an artifact with several (``RotkvCache``'s argument; peers take none)."""
        if self.kind == "peer":
            return peers.make_peer(self.name, model)
        from rotkv.cache import RotkvCache

        # the finiteness check costs a host sync per layer and call: off on a GPU, where it would dominate
        # a decode step of a small model (a NaN still shows in the scores)
        check = next(model.parameters()).device.type == "cpu"
        return RotkvCache(model, self.name, self.artifact, check_finite=check, context_length=context_length,
                          **self.overrides)

    def measure(self, cache, model, rows: int = 1) -> dict:
        """Resident bytes of ``cache`` as it is now, and its element count (2 * tokens * kv_heads * D * layers),
        per row of a cache that holds ``rows`` equally long rows (the rotations and key maps: per model)."""
        if self.kind == "rotkv":
            st = cache.stats()
            # scratch: what a per-row (budgeted) layer's reference reader keeps beside its tiers (paged layers: 0)
            return {"kv_bytes": int(st["kv_bytes"]) // rows, "kv_bytes_at_bf16": int(st["kv_bytes"]) // rows,
                    "elements": int(st["elements"]) // rows, "rotation_bytes": int(st["rotation_bytes"]),
                    "key_map_bytes": int(st.get("key_map_bytes", 0)),
                    "scratch_bytes": int(st.get("scratch_bytes", 0)) // rows}
        out = {k: v // rows for k, v in peers.resident_bytes(cache.layers).items()}
        layers, kv_heads, head_dim = model_geometry(model.config)
        out["elements"] = 2 * cache.get_seq_length() * kv_heads * head_dim * layers  # one row's
        out["rotation_bytes"] = 0
        return out


def nominal_bits(name: str) -> float:
    if name in peers.PEERS:
        return float(peers.PEERS[name].bits)
    spec = PRESETS[name]
    return 16.0 if spec.bits is None else float(spec.bits)


def known_methods() -> list[str]:
    """Every method an evaluation can name: the rotkv presets, then the peers."""
    return list(PRESETS) + list(peers.PEERS)


def main_methods() -> list[str]:
    """The methods of the full profile: every preset of fixed width (progressive presets are compared in
    their own benchmark, studies/pmkvq_equal_memory.py), then every peer."""
    return [name for name, spec in PRESETS.items() if spec.start_bits is None] + list(peers.PEERS)


def cached_method(name: str, sink: int | None, window: int | None, window_share: float | None = None) -> Method:
    """The method as its cached records name it, for reading them back where it cannot run (``rotkv eval
    --report-only`` without its artifact or its peer's library): no artifact, no availability check. The cache
    then matches its records by their recorded settings (:func:`rotkv.eval.run.collect`'s ``unverified``)."""
    if name in peers.PEERS:
        return Method(name, "peer", nominal_bits(name))
    if name not in PRESETS:
        raise ValueError(f"unknown method {name!r}; available: {known_methods()}")
    overrides = {k: v for k, v in (("sink", sink), ("window", window), ("window_share", window_share))
                 if v is not None and v != "preset"}
    return Method(name, "rotkv", nominal_bits(name), overrides)


def resolve(name: str, sink: int | None, window: int | None, artifact_dir: str | None,
            calibrate=None, window_share: float | None = None) -> tuple[Method | None, str | None]:
    """(Method, None) or (None, why it is unavailable). ``calibrate(method, path)`` makes a missing artifact;
    ``sink``, ``window``, ``window_share``: overrides of every rotkv preset (None or ``"preset"`` keeps the preset's)."""
    if name in peers.PEERS:
        why = peers.unavailable(name)
        return (None, why) if why else (cached_method(name, sink, window, window_share), None)
    m = cached_method(name, sink, window, window_share)  # the preset with its overrides; its artifact next
    if PRESETS[name].needs_artifact:
        if artifact_dir is None:
            return None, f"needs a calibration artifact: pass --artifact-dir (holding {artifact_file(name, base=True)})"
        path = os.path.join(artifact_dir, artifact_file(name))
        if PRESETS[name].k_bits == "artifact":  # its own artifact: the base rotation plus per-layer key widths
            if not os.path.exists(path):
                if "+" in artifact_kind(name):  # made from another artifact (--base-artifact): not here
                    return None, f"artifact {path} is missing: make it with `{make_command(artifact_kind(name))}`"
                if calibrate is None:
                    return None, (f"artifact {path} is missing: make it with `rotkv calibrate --method "
                                  f"{calibration_preset(name)} --out {path}`")
                why = calibrate(calibration_preset(name), path)  # the base artifact beside it is made (or reused) first
                if why:
                    return None, why
            m.artifact = path
            return m, None
        if not os.path.exists(path):
            kind = artifact_kind(name)
            if calibrate is None or kind != calibration_method(name):  # made from another artifact: not here
                return None, f"artifact {path} is missing: make it with `{make_command(kind)}`"
            why = calibrate(calibration_method(name), path)
            if why:
                return None, why
        m.artifact = path
    return m, None
