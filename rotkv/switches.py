"""Every environment variable rotkv reads, parsed once into one typed config (:class:`Switches`).

- :func:`get`: the switches of this process, read from the environment on first use and checked on
  any device (a bad value raises ValueError naming the variable; rotkv's commands and
  :class:`rotkv.cache.RotkvCache` read them first, so a typo fails before a model loads).
- :data:`VARIABLES`: the user-facing variables, one field each (docs/configuration.md is their table).
- ``ROTKV_TUNING``: the developers' knobs (benchmarks, A/B runs) as ``field=value,...``: the tuning
  fields of :class:`Switches` and the decode kernels' :class:`~rotkv.kernels.decode_config.DecodeConfig`
  fields. ``ROTKV_COMMIT``: the commit a benchmark records.
- :func:`configure` / :func:`override`: set fields from Python (tests, benchmarks); :func:`reload`
  reads the environment again (a test that changed it).

Variables that earlier versions read one by one (``ROTKV_DECODE_SCORE``, ``ROTKV_REFINE_KERNEL``,
...) are refused with the ``ROTKV_TUNING`` field that replaces them, so that none is ignored silently.
Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

from rotkv.kernels.decode_config import OPTIONAL_BOOL, OPTIONAL_INT, TUNABLE, DecodeConfig

BACKENDS = ("auto", "cuda", "triton")
SCORES = ("auto", "bf16", "int8")
OWN_BASES = ("gpu", "always", "never")
ROTATION_MATHS = ("auto", "fp32", "bf16x2")
REFINE_SPLITS = ("0", "1", "reference", "kernel", "auto")
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switches:
    """The switches of a process; see the module docstring and docs/configuration.md."""

    # user-facing: one environment variable each (VARIABLES)
    cache_dir: str | None = None  # ROTKV_CACHE_DIR: converted models and kernel builds; None: ~/.cache/rotkv
    model_cache: bool = True  # ROTKV_NO_MODEL_CACHE=1 sets False: a GGUF model is converted at each load
    nvcc: str | None = None  # ROTKV_NVCC: the CUDA compiler; None: nvcc on the PATH, then $CUDA_HOME/bin/nvcc
    debug: bool = False  # ROTKV_DEBUG: the commands print a failure's traceback
    kernels: bool = True  # ROTKV_KERNELS=0 sets False: the PyTorch reference everywhere, no GPU kernel
    decode_backend: str = "auto"  # ROTKV_DECODE_BACKEND: the decode body kernel
    write_backend: str = "auto"  # ROTKV_WRITE_BACKEND: the quantize-on-write kernel
    prefill_history_mb: int = 2048  # ROTKV_PREFILL_HISTORY_MB: one row group's dequantized prefill history
    # tuning (ROTKV_TUNING, configure, override)
    decode_score: str = "auto"  # the decode kernels' scores where the cache does not say (decode_score)
    fp8_kernels: bool = True  # the GPU kernels read and write e4m3 metadata (else those caches run PyTorch)
    cuda_write_fp8: bool = False  # the CUDA write kernel stores e4m3 metadata (else the Triton write does)
    refine_kernel: bool = True  # the Triton v1 decode kernel reads the refine tier (else the PyTorch path)
    # the CUDA decode kernel reads layers with INT4 keys and INT2 values (its ROTKV_K4 build; else Triton v1)
    cuda_key4: bool = True
    # the refine split (rotkv.kernels.refine_split): "1" the v1 kernel reads only the refined pages where the
    # body kernel is CUDA, "reference" everywhere with the PyTorch reference as the rest's kernel, "0" never;
    # "kernel": no split where the body kernel is CUDA, that kernel reads the refine tier itself in one launch
    # (its ROTKV_REFINE build; where its build cannot, as "1"), elsewhere v1 reads every page; "auto" (the
    # default): "kernel" at the head dims of rotkv.kernels.plan.AUTO_REFINE_HEAD_DIMS, "1" at the others
    refine_split: str = "auto"
    prefill_own_basis: str = "gpu"  # where a prefill chunk's own tokens attend in the model's basis
    rotation_math: str = "auto"  # auto: bf16x2 for bf16 CUDA tensors, else fp32; or always one of them
    # the vLLM backend's graphed decode step: q, k and v rotated in one launch, keys and values flushed in one
    graph_fusion: bool = True
    write_redux: int | None = None  # the CUDA write kernel's ROTKV_REDUX build macro (bench_write.py)
    write_fastdiv: int | None = None  # the CUDA write kernel's ROTKV_FASTDIV build macro
    decode: tuple = ()  # DecodeConfig fields ((name, value), ...): the decode kernels' tuning
    # provenance, and other tools' variables
    commit: str | None = None  # ROTKV_COMMIT: the commit a benchmark records (a copy without .git)
    cuda_home: str = "/usr/local/cuda"  # CUDA_HOME
    triton_interpret: bool = False  # TRITON_INTERPRET: Triton runs its interpreter (the CPU tests)
    _configs: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for name, choices in (("decode_backend", BACKENDS), ("write_backend", BACKENDS), ("decode_score", SCORES),
                              ("prefill_own_basis", OWN_BASES), ("rotation_math", ROTATION_MATHS),
                              ("refine_split", REFINE_SPLITS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{_name(name)} must be one of {list(choices)}, got {getattr(self, name)!r}")
        if not isinstance(self.prefill_history_mb, int) or self.prefill_history_mb < 1:
            raise ValueError(f"{_name('prefill_history_mb')} must be an integer >= 1, got {self.prefill_history_mb!r}")
        decode = dict(self.decode)
        unknown = sorted(set(decode) - set(TUNABLE))
        if unknown:
            raise ValueError(f"{_name('decode')}: {unknown} are not DecodeConfig fields; fields: {sorted(TUNABLE)}")
        DecodeConfig(**decode)  # the knobs' own checks
        object.__setattr__(self, "decode", tuple(sorted(decode.items())))

    def replace(self, **fields) -> "Switches":
        if "decode" in fields and isinstance(fields["decode"], dict):
            fields["decode"] = tuple(fields["decode"].items())
        return dataclasses.replace(self, **fields, _configs={})

    def decode_config(self, score: str | None = None) -> DecodeConfig:
        """The decode kernels' config: ``decode_backend``, the score (``score``, else ``decode_score``)
        and the ``decode`` overrides; one object per score, so that plans keyed by it are reused."""
        score = score or self.decode_score
        cfg = self._configs.get(score)
        if cfg is None:
            if score not in SCORES:
                raise ValueError(f"the decode score must be one of {list(SCORES)}, got {score!r}")
            cfg = self._configs[score] = DecodeConfig(backend=self.decode_backend, score=score, **dict(self.decode))
        return cfg


# ---- the environment ---------------------------------------------------------------------------
def _flag(var: str, raw: str, default: bool) -> bool:
    v = raw.strip().lower()
    if v == "":
        return default
    if v in _TRUE or v in _FALSE:
        return v in _TRUE
    raise ValueError(f"{var}={raw!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def _choice(var: str, raw: str, choices: tuple[str, ...]) -> str:
    v = raw.strip().lower() or choices[0]
    if v not in choices:
        raise ValueError(f"{var}={raw!r}: expected one of {', '.join(choices)}")
    return v


def _megabytes(var: str, raw: str) -> int:
    try:
        v = int(raw.strip() or "2048")
    except ValueError:
        raise ValueError(f"{var}={raw!r}: expected a whole number of MiB >= 1") from None
    if v < 1:
        raise ValueError(f"{var}={raw!r}: expected a whole number of MiB >= 1")
    return v


def _executable(var: str, raw: str) -> str | None:
    v = raw.strip()
    if not v:
        return None
    if not (os.path.isfile(v) and os.access(v, os.X_OK)):
        raise ValueError(f"{var}={raw!r}: not an executable file (unset it to use nvcc from the PATH or $CUDA_HOME)")
    return v


# the user-facing variables: name -> (field, parse(var, raw) -> value, what it does)
VARIABLES = {
    "ROTKV_CACHE_DIR": ("cache_dir", lambda var, raw: raw or None,
                        "folder of converted models and CUDA kernel builds (default ~/.cache/rotkv)"),
    "ROTKV_NO_MODEL_CACHE": ("model_cache", lambda var, raw: not _flag(var, raw, False),
                             "1: convert a GGUF model at each load instead of keeping a safetensors copy"),
    "ROTKV_NVCC": ("nvcc", _executable, "the CUDA compiler (default: nvcc on the PATH, then $CUDA_HOME/bin/nvcc)"),
    "ROTKV_DEBUG": ("debug", lambda var, raw: _flag(var, raw, False), "1: a failing command prints its traceback"),
    "ROTKV_KERNELS": ("kernels", lambda var, raw: _flag(var, raw, True),
                      "0: no GPU kernels, the PyTorch reference everywhere"),
    "ROTKV_DECODE_BACKEND": ("decode_backend", lambda var, raw: _choice(var, raw, BACKENDS),
                             "auto, cuda or triton: the decode attention's body kernel"),
    "ROTKV_WRITE_BACKEND": ("write_backend", lambda var, raw: _choice(var, raw, BACKENDS),
                            "auto, cuda or triton: the quantize-on-write kernel"),
    "ROTKV_PREFILL_HISTORY_MB": ("prefill_history_mb", _megabytes,
                                 "bound (MiB) of one row group's dequantized history in a prefill"),
}
TUNING = "ROTKV_TUNING"
COMMIT = "ROTKV_COMMIT"
# tuning fields of Switches (set by ROTKV_TUNING by name, next to the DecodeConfig fields)
TUNING_FIELDS = ("decode_score", "fp8_kernels", "cuda_write_fp8", "refine_kernel", "cuda_key4", "refine_split",
                 "prefill_own_basis", "rotation_math", "graph_fusion", "write_redux", "write_fastdiv")
# variables that earlier versions read: refused, naming their replacement
RETIRED = {
    "ROTKV_DECODE_SCORE": "decode_score=<auto|bf16|int8>",
    "ROTKV_DECODE_CONFIG": "<DecodeConfig field>=<value>,...",
    "ROTKV_FP8_KERNELS": "fp8_kernels=<0|1>",
    "ROTKV_CUDA_WRITE_FP8": "cuda_write_fp8=<0|1>",
    "ROTKV_REFINE_KERNEL": "refine_kernel=<0|1>",
    "ROTKV_REFINE_SPLIT": "refine_split=<0|1|reference|kernel|auto>",
    "ROTKV_PREFILL_OWN_BASIS": "prefill_own_basis=<gpu|always|never>",
    "ROTKV_ROTATION_MATH": "rotation_math=<auto|fp32|bf16x2>",
    "ROTKV_WRITE_REDUX": "write_redux=<0|1>",
    "ROTKV_WRITE_FASTDIV": "write_fastdiv=<0|1>",
}


def _name(f: str) -> str:
    """How a field is set, for error messages."""
    for var, (name, _, _) in VARIABLES.items():
        if name == f:
            return var
    return f"{TUNING} {f}" if f in TUNING_FIELDS or f == "decode" else f


def _tuning_value(name: str, raw: str, default):
    """``raw`` as the type of the field ``name`` (whose default is ``default``)."""
    v = raw.strip()
    if v.lower() == "none" and (default is None or name in OPTIONAL_INT + OPTIONAL_BOOL):
        return None
    if isinstance(default, bool) or name in OPTIONAL_BOOL:
        if v.lower() not in _TRUE + _FALSE:
            raise ValueError(v)
        return v.lower() in _TRUE
    if isinstance(default, str):
        return v
    return int(v)


def parse_tuning(text: str) -> dict:
    """``ROTKV_TUNING``'s ``"name=value,..."`` -> {Switches field: value, "decode": {DecodeConfig field:
    value}}; ValueError names an unknown field or a bad value."""
    defaults = {f.name: f.default for f in dataclasses.fields(Switches)}
    knobs = {f.name: f.default for f in dataclasses.fields(DecodeConfig)}
    out: dict = {}
    decode: dict = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, eq, raw = (s.strip() for s in item.partition("="))
        if not eq or (name not in TUNING_FIELDS and name not in TUNABLE):
            raise ValueError(f"{TUNING}: {item!r} is not name=value with a tuning field; fields: "
                             f"{list(TUNING_FIELDS)} and the DecodeConfig fields {sorted(TUNABLE)}")
        try:
            if name in TUNING_FIELDS:
                out[name] = _tuning_value(name, raw, defaults[name])
            else:
                decode[name] = _tuning_value(name, raw, knobs[name])
        except ValueError:
            raise ValueError(f"{TUNING}: bad value {raw!r} for {name}") from None
    if decode:
        out["decode"] = tuple(decode.items())
    return out


def from_environ(environ=None) -> Switches:
    """The switches that ``environ`` (default ``os.environ``) sets; ValueError names a bad variable."""
    env = os.environ if environ is None else environ
    for var, replacement in RETIRED.items():
        if var in env:
            raise ValueError(f"{var} is no longer read: set {TUNING}={replacement} instead (docs/configuration.md)")
    fields = {}
    for var, (name, parse, _) in VARIABLES.items():
        if var in env:
            fields[name] = parse(var, env[var])
    try:
        fields.update(parse_tuning(env.get(TUNING, "")))
        fields["commit"] = env.get(COMMIT) or None
        fields["cuda_home"] = env.get("CUDA_HOME") or "/usr/local/cuda"
        fields["triton_interpret"] = env.get("TRITON_INTERPRET", "0") not in ("", "0")
        return Switches(**fields)
    except ValueError as e:
        msg = str(e)
        raise ValueError(msg if msg.startswith(("ROTKV_", TUNING)) else f"{TUNING}: {msg}") from None


_current: Switches | None = None


def get() -> Switches:
    """The process's switches (the environment, read on the first call)."""
    global _current
    if _current is None:
        _current = from_environ()
    return _current


def reload() -> Switches:
    """Read the environment again (a test or a tool that changed it)."""
    global _current
    _current = None
    return get()


def configure(**fields) -> Switches:
    """Set switches for the rest of the process by field name (``decode``: a dict of DecodeConfig fields)."""
    global _current
    _current = get().replace(**fields)
    return _current


@contextmanager
def override(**fields):
    """Switches set by field name inside the ``with`` block (tests, benchmarks' A/B runs)."""
    global _current
    old = get()
    _current = old.replace(**fields)
    try:
        yield _current
    finally:
        _current = old


def tuning() -> dict:
    """The tuning fields' values now (``ROTKV_TUNING``'s or their defaults): what a benchmark's JSON records."""
    sw = get()
    return {f: getattr(sw, f) for f in TUNING_FIELDS}


def debug() -> bool:
    """``ROTKV_DEBUG``, also where another variable is bad (the error report asks for it)."""
    try:
        return get().debug
    except ValueError:
        return os.environ.get("ROTKV_DEBUG", "").strip().lower() in _TRUE
