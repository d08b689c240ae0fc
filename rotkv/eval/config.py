"""The evaluation configuration: one dataclass, two named profiles, validated at construction."""

from __future__ import annotations

import dataclasses
import glob
import os
from dataclasses import dataclass, field

from rotkv.eval.methods import known_methods, main_methods
from rotkv.eval.niah import VARIANTS

TASKS = ("nll", "attn-error", "niah")
DEVICES = ("cpu", "cuda")
DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")


def builtin_eval_texts() -> list[str]:
    """The evaluation texts shipped in rotkv/data (never used for calibration)."""
    return sorted(glob.glob(os.path.join(DATA_DIR, "eval_*.txt")))


@dataclass
class EvalConfig:
    """What one ``rotkv eval`` run measures.

    lengths: per task, the context lengths (tokens). nll_windows: windows at 2048 tokens; longer contexts
    get proportionally fewer (at least one), so every length costs about the same number of tokens, unless
    nll_scale_windows is False (``rotkv eval --suite``: the same windows at every length).
    niah_depths: needle depths of the single-needle variants (one haystack per depth and sample);
    niah_multi_depths: the depths of the needles of one multikey / multivalue haystack;
    niah_variant_lengths: lengths of some variants when they differ from ``lengths["niah"]``.
    sink, window, window_share: override every rotkv preset (None keeps the profile's, ``"preset"`` (sink and
        window) each preset's own; window_share: None keeps the presets' own).
    device: where the model (float32, also the KL reference) and the caches run: cpu, cuda or cuda:N.
    """

    profile: str = "smoke"
    model: str | None = None
    methods: list[str] = field(default_factory=lambda: ["bf16", "naive-int2", "quarot-int2"])
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lengths: dict[str, list[int]] = field(default_factory=lambda: {"nll": [256], "attn-error": [256], "niah": [384]})
    texts: list[str] = field(default_factory=builtin_eval_texts)
    haystacks: list[str] = field(default_factory=builtin_eval_texts)
    artifact_dir: str | None = None
    sink: int | str | None = 16
    window: int | str | None = 32
    window_share: float | None = None
    chunk: int = 128
    nll_windows: int = 1
    nll_scale_windows: bool = True
    new_tokens: int = 8
    window_batch: int = 1
    attn_queries: int = 16
    niah_variants: list[str] = field(default_factory=lambda: list(VARIANTS))
    niah_depths: list[float] = field(default_factory=lambda: [0.5])
    niah_multi_depths: list[float] = field(default_factory=lambda: [0.25, 0.75])
    niah_samples: int = 1
    niah_variant_lengths: dict[str, list[int]] = field(default_factory=dict)
    max_answer_tokens: int = 12
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        known = known_methods()
        for m in self.methods:
            if m not in known:
                raise ValueError(f"`methods` has to be a list from {known} but got {m!r}")
        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"`tasks` has to be a list from {list(TASKS)} but got {t!r}")
        for v in self.niah_variants:
            if v not in VARIANTS:
                raise ValueError(f"`niah_variants` has to be a list from {list(VARIANTS)} but got {v!r}")
        for d in self.niah_depths + self.niah_multi_depths:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"needle depths have to be in [0, 1] but got {d}")
        for task in self.tasks:
            if not self.lengths.get(task):
                raise ValueError(f"`lengths` has no context length for task {task!r}")
        for f in self.texts + self.haystacks:
            if not os.path.isfile(f):
                raise FileNotFoundError(f"text file {f} not found")
        if not self.texts:
            raise ValueError("no evaluation text: pass --text FILE (rotkv/data has no eval_*.txt)")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"`device` has to be cpu, cuda or cuda:N but got {self.device!r}")
        for name in ("chunk", "nll_windows", "new_tokens", "window_batch", "attn_queries", "niah_samples",
                     "max_answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` has to be >= 1 but got {getattr(self, name)}")
        if self.seed < 0:
            raise ValueError(f"`seed` has to be >= 0 but got {self.seed}")

    def niah_lengths(self, variant: str) -> list[int]:
        return sorted(self.niah_variant_lengths.get(variant, self.lengths.get("niah", [])))

    def windows_at(self, length: int) -> int:
        if not self.nll_scale_windows:
            return self.nll_windows
        return max(1, round(self.nll_windows * 2048 / max(length, 2048)))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


PROFILES: dict[str, dict] = {
    # CI: a few minutes on 2 CPU cores, three rotkv presets, every task and variant at tiny sizes.
    "smoke": {},
    # Every method at SmolLM2's lengths, sized for a 2-core CPU.
    "full": dict(
        methods=main_methods,  # called when the config is made: every preset and peer known then
        lengths={"nll": [2048, 8192], "attn-error": [1024], "niah": [1024, 2048, 3072]},
        sink=16, window=64, chunk=512, nll_windows=2, new_tokens=32, attn_queries=64,
        niah_depths=[0.5], niah_multi_depths=[0.1, 0.5, 0.9], niah_samples=1, max_answer_tokens=12,
        niah_variant_lengths={"noise": [2048], "multivalue": [2048]},
    ),
}


def _here(path: str) -> str:
    """A text file recorded by a run on another machine: the path itself where it exists, else rotkv's own
    copy of the same name (the built-in texts or the suite's), else the path unchanged (the config's check names it)."""
    if os.path.isfile(path):
        return path
    for folder in (DATA_DIR, os.path.join(DATA_DIR, "suite")):  # the built-in texts, then the suite's
        mine = os.path.join(folder, os.path.basename(path))
        if os.path.isfile(mine):
            return mine
    return path


def from_run(out_dir: str, **overrides) -> EvalConfig:
    """The configuration an earlier run recorded in ``out_dir/config.json``, for rebuilding its report
    (``rotkv eval --report-only``), with overrides (None values are ignored). Text files recorded on
    another machine (a GPU host) are found again among rotkv's built-in texts by name."""
    import json

    path = os.path.join(out_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: --report-only rebuilds a run's report from its folder")
    with open(path) as f:
        kw = json.load(f)["config"]
    names = {f.name for f in dataclasses.fields(EvalConfig)}
    kw = {k: v for k, v in kw.items() if k in names}
    kw["texts"] = [_here(t) for t in kw.get("texts", [])]
    kw["haystacks"] = [_here(t) for t in kw.get("haystacks", [])]
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return EvalConfig(**kw)


def make_config(profile: str = "smoke", **overrides) -> EvalConfig:
    """A profile with overrides (None values are ignored). NIAH lengths given in ``lengths`` hold for
    every variant: they replace the profile's per-variant lengths too (``niah_variant_lengths``)."""
    if profile not in PROFILES:
        raise ValueError(f"`profile` has to be one of {list(PROFILES)} but got {profile!r}")
    kw = {k: v() if callable(v) else v for k, v in PROFILES[profile].items()}
    if (overrides.get("lengths") or {}).get("niah") and overrides.get("niah_variant_lengths") is None:
        kw["niah_variant_lengths"] = {}
    kw.update({k: v for k, v in overrides.items() if v is not None})
    return EvalConfig(profile=profile, **kw)
