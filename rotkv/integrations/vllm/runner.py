"""The request ids of the step vLLM's model runner is building, on the host, for the side pool's slot table.

vLLM's attention metadata (``CommonAttentionMetadata``) names no request. The model runner knows them: both of
vLLM's GPU model runners hold, per step, the request ids of the batch's rows in row order (the V2 runner,
``vllm.v1.worker.gpu.model_runner``: ``InputBatch.req_ids`` of ``prepare_inputs``; the V1 runner,
``vllm.v1.worker.gpu_model_runner``: its persistent ``input_batch.req_ids`` after ``_prepare_inputs``), and every
step's ``SchedulerOutput`` names the requests that finished (and, for the V2 runner, those preempted) since the
last step. :func:`install_runner_hooks` wraps those methods of the runner classes this process has imported, so
that :data:`STEP` tells the metadata builder, with no read from the device:

- ``mode == "step"``: a real step; ``keys`` the ids of its rows (rows past them are vLLM's padding rows of a
  full graph);
- ``mode == "dummy"``: a dummy, profiling or capture run (``_dummy_run``, ``capture_model``, ``execute_model(...,
  dummy_run=True)``): no row is a live request;
- ``mode is None``: no hooked runner method is running (a runner these hooks do not know, or a test driving the
  builder alone): the builder then keys requests by their first block id, read from the device (its fallback).

``released``: ids of requests that finished or were preempted, gathered from every step's scheduler output until
the builder frees their side-pool slots.
"""

from __future__ import annotations

import functools
import inspect
import sys
from contextlib import contextmanager


class StepRows:
    """What the hooked model runner says about the step being built (see the module docstring)."""

    def __init__(self):
        self._modes: list = []  # innermost hooked call last
        self.keys: list | None = None
        self.released: set = set()

    @property
    def mode(self) -> str | None:
        return self._modes[-1] if self._modes else None

    @contextmanager
    def scope(self, mode: str, released=()):
        """A hooked runner call of ``mode`` ("step" or "dummy"); a "step" clears the previous step's keys and adds
        ``released`` (request ids whose state is gone)."""
        self._modes.append(mode)
        keys = self.keys
        if mode == "step":
            self.keys = None
            self.released.update(released)
        try:
            yield self
        finally:
            self._modes.pop()
            if mode == "step" or not self._modes:
                self.keys = None
            else:
                self.keys = keys

    def set_keys(self, keys) -> None:
        """The request ids of the step's rows, in row order (called by the hooks once the runner has ordered them)."""
        if self.mode == "step":
            self.keys = list(keys)

    def take_released(self) -> set:
        out, self.released = self.released, set()
        return out


STEP = StepRows()


def _gone(scheduler_output) -> set:
    """Ids of the requests a scheduler output says finished or were preempted (their side-pool state is dead)."""
    out = set(getattr(scheduler_output, "finished_req_ids", None) or ())
    out.update(getattr(scheduler_output, "preempted_req_ids", None) or ())
    return out


def _wrap_execute(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def execute_model(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        dummy = bool(bound.arguments.get("dummy_run", False))
        so = bound.arguments.get("scheduler_output")
        with STEP.scope("dummy" if dummy else "step", () if dummy else _gone(so)):
            return orig(self, *args, **kwargs)
    return execute_model


def _wrap_dummy(orig):
    @functools.wraps(orig)
    def run(self, *args, **kwargs):
        with STEP.scope("dummy"):
            return orig(self, *args, **kwargs)
    return run


def _wrap_v2_prepare_inputs(orig):
    @functools.wraps(orig)
    def prepare_inputs(self, *args, **kwargs):
        batch = orig(self, *args, **kwargs)
        STEP.set_keys(batch.req_ids[:batch.num_reqs])
        return batch
    return prepare_inputs


def _wrap_v1_prepare_inputs(orig):
    @functools.wraps(orig)
    def _prepare_inputs(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        batch = self.input_batch  # condensed and ordered by now: rows 0 .. num_reqs - 1 are the step's
        STEP.set_keys(batch.req_ids[:batch.num_reqs])
        return out
    return _prepare_inputs


# module -> (method, wrapper) of the runner classes the hooks know
RUNNERS = {
    "vllm.v1.worker.gpu.model_runner": (("execute_model", _wrap_execute), ("prepare_inputs", _wrap_v2_prepare_inputs),
                                        ("_dummy_run", _wrap_dummy), ("capture_model", _wrap_dummy)),
    "vllm.v1.worker.gpu_model_runner": (("execute_model", _wrap_execute), ("_prepare_inputs", _wrap_v1_prepare_inputs),
                                        ("_dummy_run", _wrap_dummy), ("capture_model", _wrap_dummy)),
}


def hook_runner_class(cls, methods) -> bool:
    """Wrap ``methods`` ((name, wrapper) pairs) of ``cls`` once; False (nothing changed) if one is missing."""
    if any(not callable(getattr(cls, name, None)) for name, _ in methods):
        return False
    for name, wrap in methods:
        fn = getattr(cls, name)
        if not getattr(fn, "_rotkv_rows", False):
            new = wrap(fn)
            new._rotkv_rows = True
            setattr(cls, name, new)
    return True


def install_runner_hooks() -> list[str]:
    """Wrap the known runner classes (``GPUModelRunner``) of the modules this process has imported (the metadata
    builder calls this from the runner's KV-cache set-up, after the runner's module is loaded); returns the
    modules hooked."""
    done = []
    for name, methods in RUNNERS.items():
        cls = getattr(sys.modules.get(name), "GPUModelRunner", None)
        if cls is not None and hook_runner_class(cls, methods):
            done.append(name)
    return done
