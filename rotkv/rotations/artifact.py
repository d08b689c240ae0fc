"""Calibration artifacts: rotations, key means, clip ratios (and later bit widths) in safetensors.

Layout (all tensors float32 unless noted; ``l`` is the layer index, ``H`` KV heads, ``D`` head_dim):

- ``R_K.{l}``: ``[H, D, D]`` or ``[1, D, D]`` (one matrix for the whole layer);
- ``R_V.{l}``: same, absent when values are not rotated at run time (identity or folded);
- ``k_mean.{l}``: ``[H, D]``, the post-RoPE key mean in the unrotated basis;
- ``clip_k``, ``clip_v``: ``[L]`` per-layer clipping ratios;
- ``bits``: ``[L]`` int32 final widths (progressive precision), optional;
- ``k_scale.{l}``: ``[H, D, D]`` or ``[1, D, D]``, optional: a key scaling ``S`` before R_K (keys stored
  ``(k - mu) S R_K``, queries read ``q S^-T R_K``; :mod:`rotkv.rotations.keyscale`), part of the key-side fit;
- ``R_K@{n}.{l}``, ``k_mean@{n}.{l}`` (and ``k_scale@{n}.{l}``): extra key-side fits, one per length ``n`` of ``key_fit_lengths`` but the
  first (``rotkv calibrate --method oscar-mix-long --long-seq-len 4096,8192``); the plain ``R_K.{l}`` and
  ``k_mean.{l}`` are the first length's fit. A cache picks one by its expected context length
  (:func:`pick_key_fit`, :meth:`Artifact.for_context`);
- any other tensor a method needs, under its own prefix.

String metadata: ``format_version``, ``method``, ``model_id``, ``config_hash``,
``weights_fingerprint``, ``num_layers``, ``kv_heads``, ``head_dim``, ``bits``, ``group_size``,
``clip_k``, ``clip_v``, ``calib_tokens``, ``date``, ``values_folded`` ("0" or "1"); optional
``key_fit_lengths`` ("4096,8192": the calibration sequence lengths of the key-side fits, the primary first).
Never pickle.

What an artifact was made for (:attr:`Artifact.kind`): ``kind`` is the ``rotkv calibrate --method`` that
made it (``oscar``, ``optr``, ``pmkvq``, ``oscar+pmkvq``, ``oscar-mix``, ``oscar-mix-long``); ``base_artifact``
("KIND ID") names the artifact it was made from, ``ID`` being that file's :func:`artifact_id`; ``presets``
lists the presets it serves (rotkv.contract, where a preset states the kind it reads, checks them). A file
without ``kind`` (made before these fields) has its kind inferred from what it holds (:func:`infer_kind`).

Format versions: this rotkv writes and reads ``format_version`` 1. A file without the field
predates versioning and loads as version 1 (same layout); a higher version is refused with "upgrade
rotkv". Loading also refuses unreadable (truncated) files, shapes that do not fit the declared
geometry, non-finite values and non-orthogonal rotations.

The contract: ``kind``, ``method``, ``bits`` and ``group_size`` say what the rotations and clip ratios
were fitted for; rotkv.contract checks them against a CacheSpec. This module reads and writes the format
alone: the model it is checked against comes in as its geometry and fingerprint (:func:`check_model`).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rotkv.quant.widths import KEY_WIDTHS, WIDTHS
from rotkv.rotations.base import LayerRotation

FORMAT_VERSION = "1"  # written by this rotkv; a file without one predates versioning and reads as 1
FORMAT_VERSION_INT = int(FORMAT_VERSION)
REQUIRED_META = ("format_version", "method", "num_layers", "kv_heads", "head_dim", "weights_fingerprint")
ORTHO_TOL = 1e-3  # max |R^T R - I| of a sound rotation (fp32 calibrations reach ~1e-6)
KEY_FIT_SIDE = ("R_K", "k_mean", "k_scale")  # the per-layer tensors of one key-side fit (extra fits: ``R_K@8192.{l}``, ...)
NAME = re.compile(r"[a-z0-9][a-z0-9+._-]{0,63}")  # a kind or preset name
ID = re.compile(r"[0-9a-f]{16}")  # an artifact_id


class ArtifactMismatch(ValueError):
    """The artifact was made for another model (or is malformed)."""


@dataclass
class Artifact:
    tensors: dict[str, torch.Tensor]
    meta: dict[str, str]
    path: str | None = None
    nbytes: int = field(default=0)

    @property
    def num_layers(self) -> int:
        return int(self.meta["num_layers"])

    @property
    def values_folded(self) -> bool:
        return self.meta.get("values_folded", "0") == "1"

    @property
    def kind(self) -> str:
        """What the artifact is: its ``kind`` field, else the kind its contents show (:func:`infer_kind`)."""
        return self.meta.get("kind") or infer_kind(self.tensors, self.meta)

    @property
    def kind_inferred(self) -> bool:
        """True for a file without a ``kind`` field (made before it was recorded)."""
        return not self.meta.get("kind")

    @property
    def identity(self) -> str:
        """:func:`artifact_id` of the tensors (computed once)."""
        if "_identity" not in self.__dict__:
            self.__dict__["_identity"] = artifact_id(self.tensors)
        return self.__dict__["_identity"]

    @property
    def presets(self) -> list[str]:
        """The presets the artifact says it serves (``presets``); [] when not recorded."""
        return [p for p in self.meta.get("presets", "").split(",") if p]

    def describe(self) -> str:
        """``"an oscar-mix artifact (serves oscar-mix, oscar-int2)"``: what the artifact is, for messages."""
        kind = self.kind or "unknown"
        extra = [f"serves {', '.join(self.presets)}"] if self.presets else []
        if self.kind_inferred:
            extra.append("kind inferred: made before rotkv recorded it")
        article = "an" if kind[0] in "aeiou" else "a"
        return f"{article} {kind} artifact" + (f" ({'; '.join(extra)})" if extra else "")

    @property
    def key_fit_lengths(self) -> list[int]:
        """The calibration sequence lengths of the key-side fits, the primary's first; [] for one unnamed fit."""
        raw = self.meta.get("key_fit_lengths")
        return parse_fit_lengths(raw) if raw else []

    def with_key_fit(self, length: int) -> "Artifact":
        """This artifact with the fit of ``length`` (one of :attr:`key_fit_lengths`) as its primary key side.

        The chosen fit's ``R_K@n``/``k_mean@n`` become ``R_K``/``k_mean`` and the old primary moves to its own
        ``@length`` keys, so the result is still a valid multi-fit artifact (its ``key_fit_lengths`` start with
        ``length``) and picking again is a no-op. Every other tensor (R_V, clips, key widths) is the same object.
        """
        lengths = self.key_fit_lengths
        if length not in lengths:
            raise ValueError(f"artifact {self.path} has no key fit for length {length}; its fits: {lengths or 'one, unnamed'}")
        if length == lengths[0]:
            return self
        old, tensors = lengths[0], dict(self.tensors)
        for name, t in self.tensors.items():
            prefix, _, idx = name.partition(".")
            if prefix in KEY_FIT_SIDE:
                tensors[f"{prefix}@{old}.{idx}"] = t
                tensors[name] = tensors.pop(f"{prefix}@{length}.{idx}")
        meta = dict(self.meta) | {"key_fit_lengths": ",".join(str(n) for n in [length] + [n for n in lengths if n != length])}
        if "longfit_seq_len" in meta:
            meta["longfit_seq_len"] = str(length)
        return Artifact(tensors, meta, self.path, self.nbytes)

    def for_context(self, context_length: int | None) -> "Artifact":
        """The artifact whose primary key side is the fit :func:`pick_key_fit` picks for ``context_length``
        tokens per row; itself without several fits or without a length."""
        if context_length is None:
            return self
        pick = pick_key_fit(self.key_fit_lengths, context_length)
        return self if pick is None else self.with_key_fit(pick)

    def layer_rotation(self, layer: int) -> LayerRotation:
        h, d = int(self.meta["kv_heads"]), int(self.meta["head_dim"])

        def mat(name: str) -> torch.Tensor | None:
            t = self.tensors.get(f"{name}.{layer}")
            return None if t is None else t.float().expand(h, d, d).contiguous()

        mean = self.tensors.get(f"k_mean.{layer}")
        clip_k = self.tensors.get("clip_k")
        clip_v = self.tensors.get("clip_v")
        r_k, r_q, scale = mat("R_K"), None, mat("k_scale")
        if scale is not None and r_k is not None:
            from rotkv.rotations.keyscale import scaled_pair

            r_k, r_q = scaled_pair(r_k, scale)
        return LayerRotation(
            R_K=r_k,
            R_V=None if self.values_folded else mat("R_V"),
            k_mean=None if mean is None else mean.float(),
            clip_k=None if clip_k is None else float(clip_k[layer]),
            clip_v=None if clip_v is None else float(clip_v[layer]),
            R_Q=r_q,
        )

    def summary(self) -> str:
        lines = [f"rotkv artifact {self.path or ''}".rstrip(), f"  is {self.describe()}, id {self.identity}"]
        for k in sorted(self.meta):
            if self.meta[k] != "":  # a field a method leaves empty (``cs`` of OptR-free methods) says nothing
                lines.append(f"  {k}: {self.meta[k]}")
        lines.append(f"  tensors: {len(self.tensors)} ({self.nbytes / 1e6:.2f} MB)")
        groups: dict[str, int] = {}
        for name in self.tensors:
            groups[name.split(".")[0]] = groups.get(name.split(".")[0], 0) + 1
        for g, n in sorted(groups.items()):
            shape = tuple(next(t for k, t in self.tensors.items() if k.split(".")[0] == g).shape)
            lines.append(f"    {g}: {n} tensor(s), e.g. shape {shape}")
        return "\n".join(lines)


def parse_fit_lengths(text: str, what: str = "key_fit_lengths") -> list[int]:
    """``"4096,8192"`` -> ``[4096, 8192]``: positive, distinct integers in the order given (the first is the primary fit)."""
    out = []
    for item in str(text).split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"`{what}` has to be a comma list of positive integers (e.g. 4096,8192) but got {text!r}")
        if int(item) in out:
            raise ValueError(f"`{what}` names {int(item)} twice: {text!r}")
        out.append(int(item))
    return out


def pick_key_fit(lengths, context_length: int) -> int | None:
    """The fit length for a context of ``context_length`` tokens: the nearest in log distance
    (``max(n, c) / min(n, c)`` smallest), a tie going to the longer fit; None when there are no fits (the
    primary serves). A fit refitted on sequences of n tokens is best near n tokens of context: 2K context
    takes a 4K fit over an 8K one, 6K takes the 8K."""
    from fractions import Fraction

    if isinstance(context_length, bool) or not isinstance(context_length, int) or context_length < 1:
        raise ValueError(f"`context_length` has to be a positive int (tokens per row) but got {context_length!r}")
    if not lengths:
        return None
    return min(lengths, key=lambda n: (Fraction(max(n, context_length), min(n, context_length)), -n))


def without_key_fits(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> tuple[dict, dict]:
    """(tensors, meta) without the extra key fits and ``key_fit_lengths``: for a refit that replaces the key side."""
    return ({k: v for k, v in tensors.items() if "@" not in k.partition(".")[0]},
            {k: v for k, v in meta.items() if k != "key_fit_lengths"})


def artifact_id(tensors: dict[str, torch.Tensor]) -> str:
    """A short hash of an artifact's tensors (names, dtypes, shapes, bytes): the ``ID`` of ``base_artifact``
    ("KIND ID"); the same for a file and its copies, whatever the metadata."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def infer_kind(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> str:
    """The kind of a file without a ``kind`` field, from what it holds; the rule each calibration follows:

    - per-layer key widths (``k_bits``): ``<method>-mix``, ``-long`` added when its key side was refitted on
      long sequences (``longfit_seq_len`` or ``key_fit_lengths``): ``oscar-mix``, ``oscar-mix-long``; ``+aqua``
      added when it holds inter-layer key maps (``aqua_map.{l}``);
    - a long key-side refit without key widths: ``<method>-long``;
    - else its ``method`` (``oscar``, ``optr``, ``pmkvq``, ``oscar+pmkvq``, ...).
    """
    method = meta.get("method", "")
    long = "longfit_seq_len" in meta or "key_fit_lengths" in meta
    if "k_bits" in tensors:
        maps = any(name.partition(".")[0] == "aqua_map" for name in tensors)  # rotkv calibrate --method aqua
        return f"{method.split('+')[0]}-mix" + ("-long" if long else "") + ("+aqua" if maps else "")
    return f"{method}-long" if long else method


def save_artifact(path: str, tensors: dict[str, torch.Tensor], meta: dict[str, object]) -> None:
    """Write tensors (made contiguous, on the CPU) and string metadata to ``path``."""
    missing = [k for k in REQUIRED_META if k not in meta]
    if missing:
        raise ValueError(f"artifact metadata is missing {missing}")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path,
              metadata={k: str(v) for k, v in meta.items()})


def _parse_version(path: str, meta: dict[str, str]) -> int:
    """The artifact's format version; a file without one predates versioning and is version 1."""
    raw = meta.setdefault("format_version", "1")
    try:
        version = int(raw)
    except ValueError:
        raise ArtifactMismatch(f"{path}: `format_version` has to be an integer but got {raw!r}") from None
    if version > FORMAT_VERSION_INT:
        raise ArtifactMismatch(f"{path} has format_version {version}, made by a newer rotkv; this rotkv reads "
                               f"versions 1 to {FORMAT_VERSION_INT}: upgrade rotkv")
    if version < 1:
        raise ArtifactMismatch(f"{path} has format_version {version}; this rotkv reads versions 1 to {FORMAT_VERSION_INT}")
    return version


def check_structure(tensors: dict[str, torch.Tensor], meta: dict[str, str], where: str = "artifact") -> None:
    """Refuse an artifact whose metadata or tensor shapes and dtypes do not fit its declared geometry.

    This is what makes a malformed file fail at load, naming the tensor, instead of inside the cache.
    """
    geo = {}
    for k in ("num_layers", "kv_heads", "head_dim"):
        try:
            geo[k] = int(meta[k])
        except ValueError:
            raise ArtifactMismatch(f"{where}: metadata `{k}` has to be an integer but got {meta[k]!r}") from None
        if not 1 <= geo[k] <= 1 << 16:
            raise ArtifactMismatch(f"{where}: metadata `{k}` has to be in [1, 65536] but got {geo[k]}")
    for k in ("bits", "group_size"):
        if k in meta and not meta[k].strip().isdigit():
            raise ArtifactMismatch(f"{where}: metadata `{k}` has to be an integer but got {meta[k]!r}")
    check_kind_fields(meta, where)
    layers, h, d = geo["num_layers"], geo["kv_heads"], geo["head_dim"]
    fits = _extra_fits(tensors, meta, where)
    per_layer = {"R_K": None, "R_V": None, "k_mean": None, "k_scale": None} | {f"{p}@{n}": None for n in fits
                                                                               for p in KEY_FIT_SIDE}
    for name, t in tensors.items():
        prefix, _, idx = name.partition(".")
        if prefix in per_layer:
            if not idx.isdigit() or int(idx) >= layers:
                raise ArtifactMismatch(f"{where}: tensor {name!r} names no layer of {layers}")
            want = [(h, d)] if prefix.startswith("k_mean") else [(h, d, d), (1, d, d)]
            if tuple(t.shape) not in want:
                raise ArtifactMismatch(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected "
                                       + " or ".join(str(w) for w in want))
            per_layer[prefix] = (per_layer[prefix] or set()) | {int(idx)}
        elif name in ("clip_k", "clip_v", "bits", "k_bits", "k_gain") and tuple(t.shape) != (layers,):
            raise ArtifactMismatch(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, expected ({layers},)")
        if prefix in per_layer or name in ("clip_k", "clip_v", "k_gain"):
            if not t.dtype.is_floating_point:
                raise ArtifactMismatch(f"{where}: tensor {name!r} has dtype {t.dtype}, expected a floating point dtype")
        elif name in ("bits", "k_bits") and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
            raise ArtifactMismatch(f"{where}: tensor {name!r} has dtype {t.dtype}, expected an integer dtype")
    for prefix, present in per_layer.items():
        if present is not None and len(present) != layers:
            missing = sorted(set(range(layers)) - present)
            raise ArtifactMismatch(f"{where}: {prefix} is given for some layers but missing for layers {missing[:8]}")
    for n in fits:  # an extra fit replaces the primary key side whole: the same tensors, every layer
        for p in KEY_FIT_SIDE:
            if (per_layer[p] is None) != (per_layer[f"{p}@{n}"] is None):
                have, lack = (f"{p}@{n}", p) if per_layer[p] is None else (p, f"{p}@{n}")
                raise ArtifactMismatch(f"{where}: the key fit for length {n} (key_fit_lengths) is incomplete: "
                                       f"{have} is given but {lack} is missing for every layer")


def check_kind_fields(meta: dict[str, str], where: str = "artifact") -> None:
    """Refuse malformed ``kind`` (a name), ``presets`` (names joined by ``,``) and ``base_artifact``
    ("KIND ID", ID 16 hex digits)."""
    if "kind" in meta and not NAME.fullmatch(meta["kind"]):
        raise ArtifactMismatch(f"{where}: metadata `kind` has to be a method name (e.g. oscar-mix) but got {meta['kind']!r}")
    if meta.get("presets") and not all(NAME.fullmatch(p) for p in meta["presets"].split(",")):
        raise ArtifactMismatch(f"{where}: metadata `presets` has to be preset names joined by ',' but got {meta['presets']!r}")
    if "base_artifact" in meta:
        kind, _, ident = meta["base_artifact"].partition(" ")
        if not (NAME.fullmatch(kind) and ID.fullmatch(ident)):
            raise ArtifactMismatch(f"{where}: metadata `base_artifact` has to be 'KIND ID' (e.g. 'oscar 0123456789abcdef') "
                                   f"but got {meta['base_artifact']!r}")


def _extra_fits(tensors: dict[str, torch.Tensor], meta: dict[str, str], where: str) -> list[int]:
    """The lengths of the extra key fits (``key_fit_lengths`` but its first); refuses a malformed list and a
    tensor ``R_K@n.l``/``k_mean@n.l`` whose ``n`` is not one of them."""
    try:
        fits = parse_fit_lengths(meta["key_fit_lengths"])[1:] if "key_fit_lengths" in meta else []
    except ValueError as e:
        raise ArtifactMismatch(f"{where}: metadata {e}") from None
    for name in tensors:
        prefix = name.partition(".")[0]
        if "@" in prefix:
            side, _, n = prefix.partition("@")
            if side not in KEY_FIT_SIDE or not n.isdigit() or int(n) not in fits:
                raise ArtifactMismatch(f"{where}: tensor {name!r} is no extra key fit: those are {'/'.join(KEY_FIT_SIDE)}@n "
                                       f"for n in key_fit_lengths but the first ({meta.get('key_fit_lengths', 'absent')})")
    return fits


def value_problems(artifact: "Artifact", tol: float = ORTHO_TOL) -> list[str]:
    """What is wrong with the artifact's values: non-finite entries, rotations that are not orthogonal
    (``max |R^T R - I| > tol``), clip ratios outside (0, 1], widths outside ``rotkv.quant.widths``. Empty when sound."""
    problems = []
    for name, t in sorted(artifact.tensors.items()):
        if t.dtype.is_floating_point and not torch.isfinite(t).all():
            problems.append(f"{name} has {int((~torch.isfinite(t)).sum())} non-finite value(s)")
    err = orthogonality_error(artifact)
    bad = {k: e for k, e in err.items() if not e <= tol}  # NaN counts as bad
    if bad:
        worst = max(bad, key=lambda k: bad[k] if bad[k] == bad[k] else float("inf"))
        problems.append(f"{len(bad)} rotation(s) are not orthogonal, worst {worst}: max |R^T R - I| = {bad[worst]:.2e} > {tol:g}")
    for name in ("clip_k", "clip_v"):
        t = artifact.tensors.get(name)
        if t is not None and not ((t > 0) & (t <= 1)).all():
            problems.append(f"{name} has ratios outside (0, 1]: {t.tolist()}")
    for name, ok in (("bits", WIDTHS), ("k_bits", KEY_WIDTHS)):
        b = artifact.tensors.get(name)
        if b is not None and not all(int(x) in ok for x in b.tolist()):
            problems.append(f"{name} has widths outside {list(ok)}: {b.tolist()}")
    return problems


def orthogonality_error(artifact: "Artifact") -> dict[str, float]:
    """``max |R^T R - I|`` of every rotation tensor (``R_K.l``, ``R_V.l``, extra fits' ``R_K@n.l``)."""
    out = {}
    for name, t in artifact.tensors.items():
        if name.startswith(("R_K.", "R_V.", "R_K@")):
            m = t.double()
            eye = torch.eye(m.shape[-1], dtype=torch.float64, device=m.device)
            out[name] = (m.transpose(-1, -2) @ m - eye).abs().max().item()
    return out


def load_artifact(path: str, check: bool = True) -> Artifact:
    """Read an artifact; refuse (ArtifactMismatch, a ValueError) anything that is not a sound one.

    A file that cannot be read (truncated, not safetensors), lacks rotkv metadata, has a format
    version this rotkv does not read, or whose tensors do not fit its geometry is refused, naming the
    reason. With ``check`` (the default), so are non-finite values and non-orthogonal rotations
    (:func:`value_problems`); ``rotkv inspect --check`` loads with check=False to report them all.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"artifact file not found: {path}")
    if os.path.isdir(path):
        raise ArtifactMismatch(f"artifact {path} is a directory, not a .safetensors file")
    try:
        with safe_open(path, framework="pt") as f:
            meta = dict(f.metadata() or {})
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except (OSError, MemoryError) as e:
        raise ArtifactMismatch(f"cannot read artifact {path}: {e}") from e
    except Exception as e:  # safetensors_rust.SafetensorError (truncated or not safetensors), ...
        raise ArtifactMismatch(f"cannot read artifact {path}: {type(e).__name__}: {e} "
                               "(truncated, or not a safetensors file)") from e
    missing = [k for k in REQUIRED_META if k not in meta and k != "format_version"]
    if missing:
        raise ArtifactMismatch(f"{path} is not a rotkv artifact: metadata is missing {missing}")
    _parse_version(path, meta)
    check_structure(tensors, meta, where=f"artifact {path}")
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    art = Artifact(tensors, meta, path, nbytes)
    if check and (problems := value_problems(art)):
        raise ArtifactMismatch(f"artifact {path} is unsound: " + "; ".join(problems))
    return art


def base_method(artifact: Artifact) -> str:
    """The calibration method the rotations come from: ``oscar+pmkvq`` -> ``oscar``."""
    return artifact.meta.get("method", "").split("+")[0]


def check_model(artifact: Artifact, geometry: tuple[int, int, int], fingerprint=None) -> None:
    """Refuse an artifact made for another model, naming every field that differs: ``geometry`` is the
    model's (num_layers, kv_heads, head_dim); ``fingerprint`` its weights' fingerprint (a string, or a
    callable that computes it, called only once the geometry matches; None: not compared)."""
    want = dict(zip(("num_layers", "kv_heads", "head_dim"), geometry))
    diffs = [f"{k}: artifact {artifact.meta[k]} vs model {v}" for k, v in want.items() if int(artifact.meta[k]) != v]
    if not diffs and fingerprint is not None:
        fp = fingerprint() if callable(fingerprint) else fingerprint
        if artifact.meta["weights_fingerprint"] != fp:
            diffs.append(f"weights_fingerprint: artifact {artifact.meta['weights_fingerprint']} vs model {fp}")
    if diffs:
        made_for = artifact.meta.get("model_id", "?")
        raise ArtifactMismatch(f"artifact {artifact.path} was made for another model ({made_for}): " + "; ".join(diffs)
                               + "; calibrate one for this model with `rotkv calibrate`")
