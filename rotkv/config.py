"""Cache configuration: one validated dataclass and the named presets.

A bad value fails at construction with the field name and the allowed values.
"""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

import numpy as np

from rotkv.quant.widths import KEY_WIDTHS, WIDTHS  # noqa: F401 (KEY_WIDTHS: the per-layer key widths, `k_bits`)
from rotkv.rotations import registry

META_NAMES = ("float16", "float8", "float32")
INT_MAX = 2**31 - 1  # token counts and sizes fit an int32 (the kernels' index type)


class RotkvWarning(UserWarning):
    """A value rotkv changed or ignored (the CLI prints it as ``rotkv <command>: warning: ...``)."""


# a CacheSpec's rotations: the registry's data-free ones, and "artifact" for every calibrated method
ROTATIONS = (*registry.data_free(), "artifact")
CODECS = ("token", "kivi")
TIER_DTYPES = ("bfloat16", "float16", "float32", "model")
KEY_TABLES = ("grid", "pq")  # calibrated key formats read from the artifact (rotkv.calibrate.grids)
KEY_MAP_CLASSES = ("dense", "rope", "rope-head")  # inter-layer key maps (--aqua-map; rotkv.cache.predict)
SHIFTS = ("equivalent", "rounded", "plain")  # progressive precision: how a body shrinks
ANCHORS = ("final", "start")  # progressive precision: whose step the stored scale is


def window_at(window: int, share: float, tokens):
    """``max(window, ceil(share * tokens))``: an int for a scalar ``tokens``, else an int64 array."""
    t = np.asarray(tokens, dtype=np.int64)
    out = np.maximum(window, np.ceil(t * share).astype(np.int64)) if share else np.full_like(t, window)
    return int(out) if t.ndim == 0 else out


@dataclass(frozen=True)
class CacheSpec:
    """How one model's KV cache is stored.

    bits: width of the quantized body, or None for no quantization (the ``bf16`` preset).
    group_size: dims per quantization group of a token's head vector; None means head_dim.
    sink, window: tokens kept unquantized at the start (per row, first real tokens) and at the end.
    window_share: the window grows with the row: ``max(window, ceil(window_share * tokens))`` of its
        ``tokens`` stay unquantized (0: a fixed window). 1/64 keeps the share a 32-token window has at
        2K at every length; the error of a 2-bit cache grows with context mostly through the recent
        body's keys, and this holds that part constant at a constant cost in bits per element. Paged caches only (no ``budget_tokens``).
    refine_tokens: the newest body tokens of a row whose 2-bit keys keep 2 more bits (a refine tier):
        a key's 2-bit code ``h`` and its group's scale ``s`` and ``lo`` are the body's own, and 2 more
        bits ``j`` place it inside its bucket, read as ``lo + s * (h + (j - 1.5) / 4)`` (a 4-bit grid
        of step ``s / 4``). A page keeps them while it is one of its row's ``ceil(refine_tokens /
        page_size)`` newest body pages, then drops them: what remains is the 2-bit page the body holds
        anyway (``rotkv.cache.refine``). 2 bits per key element of those pages, no metadata. Keys at 2 bits
        only (layers whose keys are at 4 bits ignore it); the recent body's keys are where the INT2
        error of long contexts concentrates. 0: off.
    refine_values: the refine tier's pages keep 2 more bits for their 2-bit values too, the same nested
        grid. Read as the keys' tier is: the PyTorch paths,
        and the Triton v1 decode kernel (``ROTKV_TUNING=refine_kernel=0``: the PyTorch path alone).
    refine_every: the refine tier's size rule: a row of ``n`` body pages keeps ``min(ceil(refine_tokens /
        page_size), ceil(n / refine_every))`` pages refined, one per ``refine_every`` body pages, so that
        the tier's cost in bits per element stays constant at short contexts (at 1K, 224 refined tokens are a
        fifth of the body) and ``refine_tokens`` caps it at long ones. 0: always ``refine_tokens``.
    refine_salient: pages per row and KV head that the refine tier also refines beyond its newest: the body
        pages a prefill call's last queries read most (``rotkv.cache.salient``; a question at the end of a
        long prompt reads its answer's tokens). 0: none. Read by the PyTorch paths only: no decode kernel
        reads them, so a cache with them decodes on the PyTorch path and refuses CUDA graphs.
    page_size: tokens leave the window in blocks of this many (the GPU pool's page size).
    prefill_chunk: a prefill longer than this is processed in chunks, each attending to the
        quantized cache of the earlier ones (its own tokens at tier precision); also the tokens
        per row of each model call of rotkv's prefill (``rotkv.generation.prefill``), so that a
        call is one attention step and the stored history is dequantized once per layer and call.
        4096 by default (was 512; see docs/serving.md, "Prefill memory").
    rotation: one of ``ROTATIONS``: a data-free rotation of the registry (identity, hadamard, random)
        or artifact (calibrated: OSCAR, OptR, ...).
    rotate_values: rotate values as well as keys (by R_V on write, R_V^T on the output).
    clip_k, clip_v: per-row quantile clipping ratios (1.0 = none); an artifact may override.
    key_mean: subtract the calibrated per-(layer, KV head) key mean from every stored key.
    codec: token (per-token groups) or kivi (keys per channel over page_size-token groups).
    tier_dtype: dtype of the unquantized tiers; "model" stores them in the model's own dtype.
    start_bits: progressive precision (PM-KVQ, rotkv.cache.progressive): the body starts at 16 or
        8 bits and shrinks to its final width (`bits`, or an artifact's per-layer `bits`) to stay
        within the budget; None for a fixed width.
    budget_tokens: each layer's memory budget is what this many tokens of one sequence take at
        its final width (tiers included); with a fixed width, the oldest tokens after the sink are
        evicted to stay within it. None: no budget.
    shift, anchor: progressive only; see rotkv.quant.progressive.
    k_bits: per-layer key widths that differ from ``bits``, as ``"LAYERS:BITS"`` items joined by ``,``
        (``"15-24:4"``: the keys of layers 15 to 24 at 4 bits; values keep ``bits``), or ``"artifact"``:
        the artifact's ``k_bits`` tensor (``rotkv calibrate --method oscar-mix``). Key layers at a
        width other than ``bits`` are not clipped (clip ratios are fitted for ``bits``). None: every
        layer at ``bits``. Counted in the measured bits like everything else.
    k_table: a calibrated key format for the layers whose keys are at ``bits``, read from the artifact
        (``studies/key_tables.py``): ``grid`` (non-uniform per-head levels, ``k_grid``; the same
        bytes per token as the uniform codec) or ``pq`` (product-quantized keys: ``pq_book`` codebooks of
        4-dim sub-vectors and ``pq_sigma``; 2.25 bits per key element at head_dim 64). PyTorch path only.
        None: the uniform quantizer.
    predict_keys: inter-layer key prediction (``rotkv.cache.predict``): layer ``l >= 1`` stores the residual
        of its body keys against a prediction from layer ``l - 1``'s stored keys of the same tokens, through
        the artifact's per-layer maps (``aqua_map.{l}``: ``rotkv calibrate --method aqua``). Every layer of
        the cache reads the one before it within each forward, so it runs the eager PyTorch path only (no
        decode or write kernels, no CUDA graph, no vLLM backend).
    meta_k, meta_v: dtype of each key / value group's scale and lo: ``float16``, ``float8`` (e4m3,
        rounded towards covering the group) or ``float32``; None: fp16 for 2 and 4 bits, fp32 for 8.
    method: the calibration method an artifact must come from (``oscar``, ``optr``, ...; an artifact
        of ``oscar+pmkvq`` counts as ``oscar``); None accepts any. See rotkv.contract.check_contract.
    artifact_kind: the kind of artifact the spec reads: the ``rotkv calibrate --method`` that makes it
        (``oscar``, ``oscar-mix``, ``oscar-mix-long``, ``oscar+pmkvq``, ...; rotkv.contract.kind_serves says
        which kinds serve it). Every preset that reads an artifact names one. None: any artifact of
        ``method`` (with ``method=None`` too: any artifact at all, the deliberate override).

    Every field is type-checked: ``sink="16"`` fails naming `sink`, not deep inside the cache.
    """

    name: str = "custom"
    bits: int | None = 2
    group_size: int | None = 64
    sink: int = 64
    window: int = 256
    window_share: float = 0.0
    refine_tokens: int = 0
    refine_values: bool = False
    refine_every: int = 0
    refine_salient: int = 0
    page_size: int = 16
    prefill_chunk: int = 4096
    rotation: str = "identity"
    rotate_values: bool = True
    clip_k: float = 1.0
    clip_v: float = 1.0
    key_mean: bool = False
    codec: str = "token"
    tier_dtype: str = "bfloat16"
    seed: int = 0
    start_bits: int | None = None
    budget_tokens: int | None = None
    shift: str = "equivalent"
    anchor: str = "final"
    method: str | None = None
    k_bits: str | None = None
    meta_k: str | None = None
    meta_v: str | None = None
    k_table: str | None = None
    artifact_kind: str | None = None
    predict_keys: bool = False

    def __post_init__(self) -> None:
        self._check_types()
        for f in ("group_size", "sink", "window", "refine_tokens", "refine_every", "refine_salient", "page_size", "prefill_chunk",
                  "budget_tokens", "seed"):
            v = getattr(self, f)
            if v is not None and abs(v) > INT_MAX:
                raise ValueError(f"`{f}` has to be at most {INT_MAX} but got {v}")
        if self.bits is not None and self.bits not in WIDTHS:
            raise ValueError(f"`bits` has to be one of {list(WIDTHS)} or None (no quantization) but got {self.bits}")
        if self.group_size is not None and self.group_size <= 0:
            raise ValueError(f"`group_size` has to be a positive divisor of head_dim or None but got {self.group_size}")
        for field in ("sink", "window", "refine_tokens", "refine_every", "refine_salient"):
            if getattr(self, field) < 0:
                raise ValueError(f"`{field}` has to be >= 0 but got {getattr(self, field)}")
        if not 0.0 <= self.window_share < 1.0:
            raise ValueError(f"`window_share` has to be in [0, 1) but got {self.window_share}")
        if self.window_share and self.budget_tokens is not None:
            raise ValueError("`window_share` does not combine with `budget_tokens` (the budgeted layers keep a fixed window)")
        for field in ("page_size", "prefill_chunk"):
            if getattr(self, field) < 1:
                raise ValueError(f"`{field}` has to be >= 1 but got {getattr(self, field)}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"`rotation` has to be one of {list(ROTATIONS)} but got {self.rotation!r}")
        if self.codec not in CODECS:
            raise ValueError(f"`codec` has to be one of {list(CODECS)} but got {self.codec!r}")
        if self.tier_dtype not in TIER_DTYPES:
            raise ValueError(f"`tier_dtype` has to be one of {list(TIER_DTYPES)} but got {self.tier_dtype!r}")
        for field in ("clip_k", "clip_v"):
            v = getattr(self, field)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"`{field}` has to be in (0, 1] but got {v}")
        if self.codec == "kivi" and self.bits is not None and self.page_size % (8 // self.bits):
            raise ValueError(f"the kivi codec packs a page's tokens: `page_size` has to be a multiple of {8 // self.bits}")
        if self.codec == "kivi" and self.rotation != "identity":
            raise ValueError("the kivi codec runs without rotation: `rotation` has to be 'identity'")
        if self.k_bits is not None:
            if self.bits is None or self.codec != "token" or self.start_bits is not None:
                raise ValueError("`k_bits` needs a fixed-width token codec (`bits` set, `codec`='token', no `start_bits`)")
            if self.k_bits == "artifact":
                if self.rotation != "artifact":
                    raise ValueError("`k_bits`='artifact' reads the widths from a calibrated artifact: needs `rotation`='artifact'")
            else:
                parse_layer_bits(self.k_bits)
        for field in ("meta_k", "meta_v"):
            v = getattr(self, field)
            if v is None:
                continue
            if v not in META_NAMES:
                raise ValueError(f"`{field}` has to be one of {list(META_NAMES)} or None but got {v!r}")
            if self.codec != "token" or self.start_bits is not None:
                raise ValueError(f"`{field}` needs a fixed-width token codec (`codec`='token', no `start_bits`)")
        if self.k_table is not None:
            if self.k_table not in KEY_TABLES:
                raise ValueError(f"`k_table` has to be one of {list(KEY_TABLES)} or None but got {self.k_table!r}")
            if self.rotation != "artifact" or self.codec != "token" or self.start_bits is not None or self.bits != 2:
                raise ValueError("`k_table` reads calibrated tables from an artifact: needs `rotation`='artifact', "
                                 "`codec`='token', `bits`=2 and no `start_bits`")
        if self.refine_tokens and (self.bits != 2 or self.codec != "token" or self.start_bits is not None
                                   or self.budget_tokens is not None or self.k_table is not None):
            raise ValueError("`refine_tokens` refines 2-bit token-codec keys of a paged cache: needs `bits`=2, "
                             "`codec`='token', no `start_bits`, `budget_tokens` or `k_table`")
        if self.predict_keys and (self.rotation != "artifact" or self.codec != "token" or self.bits is None
                                  or self.start_bits is not None or self.budget_tokens is not None
                                  or self.k_table is not None):
            raise ValueError("`predict_keys` reads per-layer maps from an artifact and predicts token-codec keys of a "
                             "paged cache: needs `rotation`='artifact', `codec`='token', `bits` set, no `start_bits`, "
                             "`budget_tokens` or `k_table`")
        if self.refine_values and not self.refine_tokens:
            raise ValueError("`refine_values` refines the refine tier's values: needs `refine_tokens` > 0")
        if self.refine_every and not self.refine_tokens:
            raise ValueError("`refine_every` sizes the refine tier: needs `refine_tokens` > 0 (its cap)")
        if self.refine_salient and not self.refine_tokens:
            raise ValueError("`refine_salient` adds pages to the refine tier: needs `refine_tokens` > 0")
        if self.refine_salient and self.predict_keys:
            raise ValueError("`refine_salient` scores exact keys, and `predict_keys` stores residuals: use one of them")
        self._check_progressive()

    def window_at(self, tokens: int) -> int:
        """The window (unquantized recent tokens) of a row holding ``tokens`` tokens."""
        return window_at(self.window, self.window_share, tokens)

    def _check_types(self) -> None:
        for f in dataclasses.fields(self):
            v, kind = getattr(self, f.name), FIELD_TYPES[f.name]
            if v is None and f.name in NULLABLE:
                continue
            if kind is float:
                ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
            elif kind is int:
                ok = isinstance(v, numbers.Integral) and not isinstance(v, bool)
            else:
                ok = isinstance(v, kind)
            if not ok:
                what = {int: "an int", float: "a number", bool: "a bool", str: "a string"}[kind]
                none = " or None" if f.name in NULLABLE else ""
                raise TypeError(f"`{f.name}` has to be {what}{none} but got {v!r} ({type(v).__name__})")

    def _check_progressive(self) -> None:
        if self.budget_tokens is not None and self.budget_tokens < 1:
            raise ValueError(f"`budget_tokens` has to be >= 1 or None but got {self.budget_tokens}")
        if self.shift not in SHIFTS:
            raise ValueError(f"`shift` has to be one of {list(SHIFTS)} but got {self.shift!r}")
        if self.anchor not in ANCHORS:
            raise ValueError(f"`anchor` has to be one of {list(ANCHORS)} but got {self.anchor!r}")
        if self.start_bits is None:
            return
        if self.start_bits not in (16, 8):
            raise ValueError(f"`start_bits` has to be one of [16, 8] or None but got {self.start_bits}")
        if self.bits is None or self.bits > self.start_bits:
            raise ValueError(f"`bits` (the final width) has to be one of {list(WIDTHS)} and <= start_bits but got "
                             f"{self.bits}")
        if self.budget_tokens is None:
            raise ValueError("progressive precision (`start_bits`) needs `budget_tokens`")
        if self.codec != "token":
            raise ValueError(f"progressive precision needs `codec`='token' but got {self.codec!r}")
        if self.anchor == "final" and self.shift != "equivalent":
            raise ValueError(f"`anchor`='final' needs `shift`='equivalent'; the {self.shift} shift needs `anchor`='start'")

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    @property
    def needs_artifact(self) -> bool:
        return self.rotation == "artifact"

    def replace(self, **changes) -> "CacheSpec":
        """A copy with some fields changed, validated again.

        None means what the field's docstring says wherever a field can be None (``bits=None``: no
        quantization; ``group_size=None``: head_dim; ``method=None``: any artifact, ...): it is *not*
        ignored. For a field that cannot be None (``sink``, ``window``, ...) None means "not given" and
        keeps the current value, so optional CLI arguments can be passed straight through.
        """
        unknown = sorted(set(changes) - set(FIELD_TYPES))
        if unknown:
            raise ValueError(f"unknown CacheSpec field(s) {unknown}; fields: {sorted(FIELD_TYPES)}")
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if v is not None or k in NULLABLE})

    def resolved_group(self, head_dim: int) -> int:
        return head_dim if self.group_size is None else min(self.group_size, head_dim)


def parse_layer_bits(text: str) -> dict[int, int]:
    """``"15-24:4,3:8"`` -> ``{15: 4, ..., 24: 4, 3: 8}``; a bad item raises naming `k_bits`."""
    out: dict[int, int] = {}
    for item in text.split(","):
        layers, sep, bits = item.strip().partition(":")
        a, _, b = layers.partition("-")
        try:
            lo, hi, width = int(a), int(b or a), int(bits)
        except ValueError:
            lo = hi = width = -1
        if not sep or lo < 0 or hi < lo or width not in KEY_WIDTHS:
            raise ValueError(f"`k_bits` items are LAYER[-LAYER]:BITS with BITS in {list(KEY_WIDTHS)} (e.g. '15-24:4') "
                             f"but got {item.strip()!r}")
        out.update({i: width for i in range(lo, hi + 1)})
    return out


# the type of every field (checked at construction) and the fields for which None is a value
FIELD_TYPES = {f.name: {"str": str, "int": int, "float": float, "bool": bool}[f.type.split(" |")[0]]
               for f in dataclasses.fields(CacheSpec)}
NULLABLE = frozenset(f.name for f in dataclasses.fields(CacheSpec) if "None" in f.type)

PRESETS: dict[str, CacheSpec] = {
    "bf16": CacheSpec(name="bf16", bits=None, rotation="identity", rotate_values=False),
    "int4": CacheSpec(name="int4", bits=4),
    "naive-int2": CacheSpec(name="naive-int2", bits=2),
    "quarot-int2": CacheSpec(name="quarot-int2", bits=2, rotation="hadamard"),
    "kivi-2": CacheSpec(
        name="kivi-2", bits=2, group_size=32, sink=0, window=128, page_size=32, codec="kivi"
    ),
    "oscar-int2": CacheSpec(
        name="oscar-int2", bits=2, rotation="artifact", clip_k=0.96, clip_v=0.92, key_mean=True, method="oscar",
        artifact_kind="oscar",
    ),
    "optr-int2": CacheSpec(
        name="optr-int2", bits=2, rotation="artifact", clip_k=0.96, clip_v=0.92, key_mean=True, method="optr",
        artifact_kind="optr",
    ),
    # OSCAR, with the keys of the most sensitive layers at 4 bits (the artifact's `k_bits`, rotkv calibrate
    # --method oscar-mix), fp8 value metadata and a 16-token sink + 32-token window to pay for them. The
    # window keeps 1/64 of each row (32 tokens at 2K, 128 at 8K): the recent body's keys are where the
    # error grows with context
    "oscar-mix": CacheSpec(
        name="oscar-mix", bits=2, sink=16, window=32, window_share=1 / 64, rotation="artifact", clip_k=0.96,
        clip_v=0.92, key_mean=True,
        method="oscar", k_bits="artifact", meta_v="float8", artifact_kind="oscar-mix",
    ),
    # oscar-mix with its key side (R_K, key means) refitted on 4K-token calibration sequences
    # (rotkv calibrate --method oscar-mix-long on top of oscar-mix's artifact): the same
    # storage format, bytes and kernels as oscar-mix; only the artifact differs
    "oscar-mix-long": CacheSpec(
        name="oscar-mix-long", bits=2, sink=16, window=32, window_share=1 / 64, rotation="artifact", clip_k=0.96,
        clip_v=0.92, key_mean=True, method="oscar", k_bits="artifact", meta_v="float8", artifact_kind="oscar-mix-long",
    ),
    # oscar-mix-long's artifact with a refine tier: 2 more bits for the keys and values of each row's newest
    # body pages, one per 19 body pages and at most 224 tokens (CacheSpec.refine_tokens, refine_values,
    # refine_every; rotkv.cache.refine), paid for by a 4-token sink instead of 16; the recommended preset.
    # On the GPU the Triton v1 decode kernel reads the tier (ROTKV_TUNING=refine_kernel=0: the PyTorch path,
    # no CUDA graph)
    "oscar-refine": CacheSpec(
        name="oscar-refine", bits=2, sink=4, window=32, window_share=1 / 64, refine_tokens=224, refine_values=True,
        refine_every=19, rotation="artifact", clip_k=0.96, clip_v=0.92, key_mean=True, method="oscar",
        k_bits="artifact", meta_v="float8", artifact_kind="oscar-mix-long",
    ),
    # oscar-refine with inter-layer key prediction (CacheSpec.predict_keys; rotkv.cache.predict): the same
    # bytes per token, the maps in the artifact (rotkv calibrate --method aqua --base-artifact
    # oscar-mix-long.safetensors); the eager PyTorch path only
    "oscar-aqua": CacheSpec(
        name="oscar-aqua", bits=2, sink=4, window=32, window_share=1 / 64, refine_tokens=224, refine_values=True,
        refine_every=19, rotation="artifact", clip_k=0.96, clip_v=0.92, key_mean=True, method="oscar",
        k_bits="artifact", meta_v="float8", artifact_kind="oscar-mix-long+aqua", predict_keys=True,
    ),
    # progressive precision: final widths from the artifact's `bits` (rotkv calibrate --method pmkvq),
    # else `bits` for every layer; each layer reaches its final width at budget_tokens
    "pmkvq": CacheSpec(name="pmkvq", bits=2, start_bits=16, budget_tokens=8192, artifact_kind="pmkvq"),
    "oscar-pmkvq": CacheSpec(
        name="oscar-pmkvq", bits=2, start_bits=16, budget_tokens=8192, rotation="artifact",
        clip_k=0.96, clip_v=0.92, key_mean=True, method="oscar", artifact_kind="oscar+pmkvq",
    ),
}


# presets that read another preset's artifact (the same calibration, another storage format)
SHARED_ARTIFACTS = {n: s.artifact_kind for n, s in PRESETS.items()
                    if s.k_bits == "artifact" and s.artifact_kind not in (None, n)}

DEFAULT_PRESET = "int4"  # the cache a caller gets without naming one and without an artifact: keeps the answer
RECOMMENDED_PRESET = "oscar-refine"  # the INT2 preset to calibrate for (rotkv calibrate --method oscar-mix-long)


def calibration_method(spec: CacheSpec | str) -> str:
    """The calibration method whose artifact ``spec`` (a CacheSpec or a preset name) reads: its ``method``;
    else its name without the width suffix when that names a registered method (``pmkvq``); else the
    registry's default method (``registry.DEFAULT_METHOD``)."""
    spec = get_preset(spec) if isinstance(spec, str) else spec
    if spec.method is not None:
        return spec.method
    stem = spec.name.rsplit("-", 1)[0]
    return next((n for n in (spec.name, stem) if n in registry.METHODS), registry.DEFAULT_METHOD)


def artifact_kind(spec: CacheSpec | str) -> str:
    """The kind of artifact ``spec`` (a CacheSpec or a preset name) reads: its ``artifact_kind``, else its
    own name for a preset with per-layer key widths from its artifact, else :func:`calibration_method`."""
    spec = get_preset(spec) if isinstance(spec, str) else spec
    if spec.artifact_kind is not None:
        return spec.artifact_kind
    return spec.name if spec.k_bits == "artifact" else calibration_method(spec)


def artifact_file(spec: CacheSpec | str, base: bool = False) -> str:
    """The file name an artifact folder (``--artifact-dir``) holds for ``spec`` (a CacheSpec or a preset name):
    ``<kind>.safetensors`` of the kind it reads (:func:`artifact_kind`: ``oscar-int2`` reads
    ``oscar.safetensors``, ``oscar-refine`` ``oscar-mix-long.safetensors``); ``base=True``: the file of its
    calibration method (:func:`calibration_method`), which the others are made from.
    """
    return f"{calibration_method(spec) if base else artifact_kind(spec)}.safetensors"


def calibration_preset(spec: CacheSpec | str) -> str:
    """The ``rotkv calibrate --method`` that makes the artifact ``spec`` reads (:func:`artifact_kind`)."""
    return artifact_kind(spec)


def get_preset(name: str, **overrides) -> CacheSpec:
    """A preset by name, with optional field overrides (``sink=16, window=64, group_size=32``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
