"""One writer for benchmark results: ``benchmarks/results/<kind>-<YYYYMMDD-HHMM>[-<tag>].json``.

Every file it writes carries the same stamp: ``commit`` (``ROTKV_COMMIT`` first: the device copy's
.git is stale; else ``git rev-parse --short HEAD``; see ``rotkv.bench.commit``), ``gpu`` (the CUDA
device's name, ``cpu`` without one), ``cpu`` (the host CPU's model name) and ``utc`` (ISO time of the
write). A list of rows gets the stamp in every row (keys a row already has are kept); a dict gets it
at the top level. ``benchmarks/results_index.py`` reads ``commit`` and ``utc`` back for INDEX.md.

    from results_io import write_results          # a script in benchmarks/ (its folder is on sys.path)
    path = write_results("write", rows, tag="cuda-warps", out=args.out)
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
_KIND = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.]*(-[A-Za-z0-9_.]+)*$")


def cpu_name() -> str:
    """The host CPU's model name (``/proc/cpuinfo``, else ``platform.processor()``)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def gpu_name() -> str:
    """The current CUDA device's name, or ``cpu`` where there is none (torch imported only here)."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def stamp(now: datetime.datetime | None = None) -> dict:
    """``commit``, ``gpu``, ``cpu``, ``utc`` of this run."""
    from rotkv.bench import commit

    now = now or datetime.datetime.now(datetime.timezone.utc)
    return dict(commit=commit(), gpu=gpu_name(), cpu=cpu_name(), utc=now.strftime("%Y-%m-%dT%H:%M:%SZ"))


def results_path(kind: str, tag: str | None = None, now: datetime.datetime | None = None,
                 root: str | os.PathLike = RESULTS) -> Path:
    """``<root>/<kind>-<YYYYMMDD-HHMM>[-<tag>].json`` (UTC)."""
    for what, name in (("kind", kind), ("tag", tag)):
        if name is not None and not _KIND.match(name):
            raise ValueError(f"results {what} {name!r}: letters, digits, '_', '.' and '-' only")
    now = now or datetime.datetime.now(datetime.timezone.utc)
    name = f"{kind}-{now.strftime('%Y%m%d-%H%M')}" + (f"-{tag}" if tag else "")
    return Path(root) / f"{name}.json"


def write_results(kind: str, data: list | dict, tag: str | None = None, out: str | os.PathLike | None = None,
                  now: datetime.datetime | None = None, root: str | os.PathLike = RESULTS) -> Path:
    """Stamp ``data`` (a list of row dicts, or a dict) and write it as JSON; returns the path.

    ``out`` (a tool's ``--out``) replaces the default path ``results_path(kind, tag)``."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    s = stamp(now)
    if isinstance(data, list):
        if not all(isinstance(r, dict) for r in data):
            raise TypeError("write_results: a list of results must hold dicts (one per row)")
        data = [{**r, **{k: v for k, v in s.items() if k not in r}} for r in data]
    elif isinstance(data, dict):
        data = {**data, **{k: v for k, v in s.items() if k not in data}}
    else:
        raise TypeError(f"write_results: expected a list of rows or a dict, got {type(data).__name__}")
    path = Path(out) if out else results_path(kind, tag, now, root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    print(f"wrote {path}", flush=True)
    return path
