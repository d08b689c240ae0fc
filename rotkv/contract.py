"""The artifact contract: which artifact a CacheSpec reads, checked against what the artifact says it is.

A preset names the kind of artifact it reads (``CacheSpec.artifact_kind``: the ``rotkv calibrate --method``
that makes it); an artifact records its kind (``kind``, or inferred for older files: ``Artifact.kind``), the
artifact it was made from (``base_artifact``) and the presets it serves (``presets``, written from
:func:`presets_served`). :func:`check_contract` refuses an artifact of another kind, or one fitted for other
bits or group size, in one line naming the file, what it is and the command that makes the right one;
:func:`validate_artifact` adds the model (geometry and weights' fingerprint).
"""

from __future__ import annotations

from rotkv.config import DEFAULT_PRESET, PRESETS, RECOMMENDED_PRESET, CacheSpec, artifact_kind
from rotkv.rotations.artifact import Artifact, ArtifactMismatch, base_method, check_model

CONTRACT_META = ("kind", "method", "bits", "group_size")  # what a preset checks (check_contract)


def kind_serves(have: str, need: str) -> bool:
    """Whether an artifact of kind ``have`` serves a spec that reads kind ``need``: the same kind, or one made
    from it that keeps its rotations, key means and clip ratios and adds a table the spec does not read
    (``oscar-mix``: per-layer key widths; ``oscar+pmkvq``: final widths) serves ``oscar``, and one with
    inter-layer key maps (``oscar-mix-long+aqua``) serves its base's kind. A refitted key side
    (``oscar-mix-long``) serves only its own kind."""
    return have == need or have in (f"{need}-mix", f"{need}+pmkvq", f"{need}+aqua")


def presets_served(kind: str) -> list[str]:
    """The presets an artifact of ``kind`` serves: those reading that kind first, then those it serves too."""
    own = [n for n, s in PRESETS.items() if s.artifact_kind == kind]
    return own + [n for n, s in PRESETS.items()
                  if s.artifact_kind not in (None, kind) and kind_serves(kind, s.artifact_kind)]


def kind_meta(kind: str, base: Artifact | None = None) -> dict[str, str]:
    """The metadata that says what a new artifact is: ``kind``, ``presets`` and, when it was made from
    another artifact, ``base_artifact`` ("KIND ID" of that one)."""
    meta = {"kind": kind, "presets": ",".join(presets_served(kind))}  # empty: a kind no preset reads
    if base is not None:
        meta["base_artifact"] = f"{base.kind} {base.identity}"
    return meta


def base_kind(kind: str) -> str | None:
    """The kind an artifact of ``kind`` is made from (``--base-artifact``); None for a fit from scratch."""
    if "+" in kind:
        return kind.split("+")[0]
    if kind.endswith("-long"):
        return kind[: -len("-long")]
    for sep in ("-mix",):
        if sep in kind:
            return kind.split(sep)[0]
    return None


def make_command(kind: str, have: Artifact | None = None) -> str:
    """The ``rotkv calibrate`` command that makes an artifact of ``kind``; from ``have`` when that is a
    kind the new one can be made from (its base, or the base's base)."""
    base = base_kind(kind)
    method = kind.split("+")[1] if "+" in kind else kind
    cmd = f"rotkv calibrate --method {method}"
    if "+" in kind and have is not None and have.path and have.kind == base:
        cmd += f" --base-artifact {have.path}"
    elif base is not None and have is not None and have.path and kind_serves(have.kind, base_kind(base) or base):
        cmd += f" --base-artifact {have.path}"
    elif "+" in kind:
        cmd += f" --base-artifact {base}.safetensors"
    return f"{cmd} --out {kind}.safetensors"


def kind_diff(artifact: Artifact, spec: CacheSpec) -> str | None:
    """Why ``artifact`` is not the kind ``spec`` reads (one sentence with the command that makes the right
    one), or None. A spec without ``artifact_kind`` compares ``method`` (None: any)."""
    need = spec.artifact_kind
    if need is None:
        if spec.method is None or base_method(artifact) == spec.method:
            return None
        return (f"it holds {artifact.meta.get('method')!r} rotations and preset {spec.name!r} reads {spec.method!r} "
                f"ones (method: artifact {artifact.meta.get('method')!r} vs preset {spec.method!r}); make one with "
                f"`rotkv calibrate --method {spec.method}`")
    if kind_serves(artifact.kind, need):
        return None
    return f"preset {spec.name!r} reads {_article(need)} {need} artifact; make one with `{make_command(need, artifact)}`"


def contract_diffs(artifact: Artifact, spec: CacheSpec) -> list[str]:
    """What in ``artifact`` does not fit ``spec``: its kind (:func:`kind_diff`), and the fields its clip
    ratios and key widths were fitted for:

    - bits: not compared for an unquantized spec, nor for a progressive spec (``start_bits``) reading
      per-layer widths from the artifact's ``bits`` tensor;
    - group_size: compared to ``spec.resolved_group(head_dim)``; not for an unquantized spec;
    - k_bits: a spec reading per-layer key widths from the artifact (``k_bits="artifact"``) needs them.

    A field the artifact does not record (hand-made files) is not compared.
    """
    diffs = []
    if why := kind_diff(artifact, spec):
        diffs.append(f"kind: {why}")
    if spec.quantized:
        progressive_widths = spec.start_bits is not None and "bits" in artifact.tensors
        if "bits" in artifact.meta and not progressive_widths and int(artifact.meta["bits"]) != spec.bits:
            diffs.append(f"bits: artifact {artifact.meta['bits']} vs preset {spec.bits}")
        want = spec.resolved_group(int(artifact.meta["head_dim"]))
        if "group_size" in artifact.meta and int(artifact.meta["group_size"]) != want:
            diffs.append(f"group_size: artifact {artifact.meta['group_size']} vs preset {want}")
    if spec.k_bits == "artifact" and "k_bits" not in artifact.tensors and not diffs:
        diffs.append(f"k_bits: preset {spec.name!r} reads per-layer key widths from the artifact, which has none; "
                     f"make them with `{make_command(artifact_kind(spec), artifact)}`")
    return diffs


def check_contract(artifact: Artifact, spec: CacheSpec) -> None:
    """Refuse an artifact that is not what ``spec`` reads, in one line: the file, what it is, what differs
    and the command that makes the right one.

    Clip ratios fitted for 4 bits at G = 32 are wrong at 2 bits and G = 64, OptR rotations are not OSCAR's,
    and a key side refitted on long sequences is not its base's. The deliberate overrides: re-fit the clip
    ratios for the new settings (``rotkv calibrate --refit-clip``), or pass a spec with ``artifact_kind=None``
    and ``method=None`` to take any artifact.
    """
    diffs = contract_diffs(artifact, spec)
    if not diffs:
        return
    fields = [d for d in diffs if d.startswith(("bits", "group_size"))]
    if fields:
        g = spec.resolved_group(int(artifact.meta["head_dim"]))
        diffs.append(f"re-fit its clip ratios with `rotkv calibrate --refit-clip {artifact.path or 'ARTIFACT'} "
                     f"--bits {spec.bits} --group-size {g} --out NEW.safetensors`")
    raise ArtifactMismatch(f"artifact {artifact.path} is {artifact.describe()} and does not fit preset {spec.name!r}: "
                           + "; ".join(diffs))


def validate_artifact(artifact: Artifact, model, spec: CacheSpec | None = None) -> None:
    """Refuse an artifact made for another model (geometry, weights' fingerprint), naming every field that
    differs; with ``spec``, also one that is not what the spec reads (:func:`check_contract`)."""
    from rotkv.hf.fingerprint import weights_fingerprint
    from rotkv.hf.geometry import model_geometry

    check_model(artifact, model_geometry(model.config), lambda: weights_fingerprint(model))
    if spec is not None:
        check_contract(artifact, spec)


def default_preset(artifact: Artifact | None) -> str:
    """The preset a caller gets without naming one: :data:`RECOMMENDED_PRESET` where ``artifact`` serves it,
    else the first preset it serves (``oscar-mix`` for an oscar-mix artifact), or without an artifact
    :data:`DEFAULT_PRESET`."""
    if artifact is None:
        return DEFAULT_PRESET
    served = presets_served(artifact.kind)
    if not served:
        kind = PRESETS[RECOMMENDED_PRESET].artifact_kind
        raise ArtifactMismatch(f"artifact {artifact.path} is {artifact.describe()}, which no preset reads; name a "
                               f"preset, or make one for the recommended preset with `{make_command(kind)}`")
    return RECOMMENDED_PRESET if RECOMMENDED_PRESET in served else served[0]


def default_note() -> str:
    """The one line said when the default preset runs without an artifact."""
    kind = PRESETS[RECOMMENDED_PRESET].artifact_kind
    return (f"no preset named and no artifact given: using {DEFAULT_PRESET} (4-bit, no calibration); for the "
            f"recommended 2-bit {RECOMMENDED_PRESET}, calibrate once with `rotkv calibrate --method {kind} "
            f"--out {kind}.safetensors` and pass it as the artifact")


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"

