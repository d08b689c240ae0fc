"""Continuous batching on a rotkv cache: a job of requests decoded in a batch of fixed rows whose
finished requests free their pages and whose empty rows take the next request.

The cache is one batch of ``rows`` rows over pools sized once (:meth:`RotkvCache.open_rows`), so a
decode step keeps its shapes and can stay captured in a CUDA graph (``rotkv.cache.graph``, the
pools never grow). A request is admitted when a row is empty and the pools hold its pages: the
pages of its prompt and of every token it will generate (``prompt + new_tokens``, reserved at
admission, so a running request never waits for a page). It is prefilled in a cache of its own
(:func:`rotkv.generation.prefill`, in groups of ``prefill_rows`` of the requests admitted at the same step,
those of like prompt lengths together, left padded)
and moved into its row (:meth:`RotkvCache.adopt_rows`); its first token comes from the prefill's
logits, the others from the batch's decode steps (greedy). When it has its tokens, its pages go
back to the free lists (:meth:`RotkvCache.release_rows`). An empty row still runs in the step (the
graph's shapes are fixed): it writes one dummy token per step, which is freed after the step.

    run = run_job(model, lambda: RotkvCache(model, "oscar-refine", artifact), requests, rows=64,
                  tier_pages=..., body_pages=..., cuda_graph=True)
    run.tokens[i]          # request i's greedy tokens [new_tokens]
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from rotkv.generation import prefill
from rotkv.hf.compat import cache_kwarg


@dataclass
class Request:
    """A prompt ``ids [L]`` (token ids) and how many tokens to generate (greedy, no stop token)."""

    ids: torch.Tensor
    new_tokens: int

    def __post_init__(self):
        if self.ids.dim() != 1 or len(self.ids) < 1:
            raise ValueError(f"a request's ids have to be one prompt [L >= 1], got shape {tuple(self.ids.shape)}")
        if self.new_tokens < 1:
            raise ValueError(f"a request's new_tokens has to be >= 1, got {self.new_tokens}")

    @property
    def length(self) -> int:
        """Tokens the request holds when done: prompt and new tokens (the last one is never stored)."""
        return len(self.ids) + self.new_tokens


@dataclass
class JobRun:
    """What :func:`run_job` did. Times in seconds from the job's start (device-synchronized).

    tokens: per request its greedy tokens ``[new_tokens]`` on the CPU (None: not finished, a job cut
    by ``max_seconds``). admitted_step / finished_step: the decode step at which each request entered
    (its prefill ran before that step) and left. first_s / done_s: when its first and last token were
    ready. active: requests in the batch at every decode step; flushed and step_s: the pages each step
    flushed into the body (every row one page in P steps) and its time. prefill_s: time in admissions
    (prefills and page copies), and admit_s its parts: ``cache`` (making each group's own cache),
    ``model`` (the prefill's model calls, the cache's writes in them) and ``adopt`` (moving the group's pages
    into the batch's rows), group_s each group's; decode_s: time in decode steps; wall_s: the whole job.
    """

    tokens: list
    admitted_step: list
    finished_step: list
    first_s: list
    done_s: list
    active: list = field(default_factory=list)
    flushed: list = field(default_factory=list)  # pages each decode step moved from the windows to the body
    step_s: list = field(default_factory=list)  # each decode step's time
    prefill_s: float = 0.0
    admit_s: dict = field(default_factory=dict)  # prefill_s by part: cache, model, adopt
    group_s: list = field(default_factory=list)  # each prefill group's time (its cache, model calls, adoption)
    decode_s: float = 0.0
    wall_s: float = 0.0
    generated: int = 0  # tokens generated, the unfinished requests' included
    complete: bool = True

    @property
    def steps(self) -> int:
        return len(self.active)

    @property
    def tok_per_s(self) -> float:
        """Generated tokens over the whole job's time (prefills included)."""
        return self.generated / self.wall_s if self.wall_s else 0.0

    @property
    def mean_batch(self) -> float:
        """Requests in the batch, averaged over the decode steps: the batch the job sustained."""
        return float(np.mean(self.active)) if self.active else 0.0

    def step_ms(self, flushing: bool | None = None) -> float:
        """Median decode step, ms: of every step (None), of the steps that flushed pages (True) or not (False)."""
        t = [s for s, f in zip(self.step_s, self.flushed) if flushing is None or bool(f) == flushing]
        return 1e3 * float(np.median(t)) if t else float("nan")

    @property
    def tpot_ms(self) -> float:
        """Time per output token after the first, averaged over the finished requests (their decode
        time, admissions of others included, over their tokens after the first)."""
        per = [1e3 * (d - f) / (len(t) - 1) for t, f, d in zip(self.tokens, self.first_s, self.done_s)
               if t is not None and len(t) > 1]
        return float(np.mean(per)) if per else 0.0


def reservation(state, length: int) -> tuple[int, int]:
    """(tier pages, body pages) a request of ``length`` tokens may hold at most in a cache of page
    state ``state``: its tier (sink, window and one page; every token unquantized) and its body."""
    tier = state.tier_pages_for(length)
    body = -(-length // state.page) if state.quantized else 0
    return tier, body


ADMIT_PARTS = ("cache", "model", "adopt")  # an admission group's parts (JobRun.admit_s)


def left_padded(requests: list[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' prompts as one batch ``[n, longest]``, left padded with zeros, and its attention mask."""
    longest = max(len(r.ids) for r in requests)
    ids = torch.zeros(len(requests), longest, dtype=torch.long)
    mask = torch.zeros(len(requests), longest, dtype=torch.long)
    for j, r in enumerate(requests):
        ids[j, longest - len(r.ids):], mask[j, longest - len(r.ids):] = r.ids, 1
    return ids, mask


class _Clock:
    """Marks on the device's stream (CUDA events) or the host clock, read after the job (one sync)."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> int:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())
        return len(self.marks) - 1

    def seconds(self) -> list[float]:
        if not self.marks:
            return []
        if self.cuda:
            torch.cuda.synchronize()
            return [self.marks[0].elapsed_time(e) / 1e3 for e in self.marks]
        return [t - self.marks[0] for t in self.marks]


@torch.no_grad()
def run_job(model, make_cache, requests: list[Request], rows: int, tier_pages: int, body_pages: int,
            cuda_graph: bool = False, compile_layers: bool = False, prefill_rows: int = 8,
            max_seconds: float | None = None) -> JobRun:
    """Run ``requests`` (in order) through one batch of ``rows`` rows of ``make_cache()`` (a fresh
    RotkvCache each call; the same spec every time) over pools of ``tier_pages`` and ``body_pages``
    pages (see the module docstring). Requests admitted at one step are prefilled ``prefill_rows`` at
    a time. ``cuda_graph``: the decode step in a CUDA graph (``compile_layers``: the model's layers
    compiled into it). ``max_seconds``: stop admitting and decoding once the job has run this long
    (host clock; the run is then ``complete=False`` and counts the tokens generated so far)."""
    if rows < 1 or prefill_rows < 1:
        raise ValueError(f"rows and prefill_rows have to be >= 1, got {rows} and {prefill_rows}")
    if compile_layers and not cuda_graph:
        raise ValueError("compile_layers compiles the captured decode step: pass cuda_graph=True too")
    dev = model.device
    kw = cache_kwarg(model)
    cache = make_cache()
    cache.open_rows(rows, tier_pages, body_pages, dev)
    st = cache.state
    pools = (st.tier_free.capacity, st.body_free.capacity)
    # every row keeps a tier page: an empty row's dummy token takes one each step
    capacity = np.array([pools[0] - rows, pools[1]], dtype=np.int64)
    need = [np.array(reservation(st, r.length), dtype=np.int64) for r in requests]
    for i, (t, b) in enumerate(need):
        if t > capacity[0] or b > capacity[1]:
            raise ValueError(f"request {i} needs {t} tier and {b} body pages, the pools hold {capacity[0]} and "
                             f"{capacity[1]}: raise tier_pages / body_pages")
    max_len = max(r.length for r in requests)
    n = len(requests)
    run = JobRun([None] * n, [None] * n, [None] * n, [None] * n, [None] * n)
    firsts, dones = [None] * n, [None] * n
    clock = _Clock(dev)
    start = clock.mark()
    t_host = time.perf_counter()
    owner = np.full(rows, -1, dtype=np.int64)  # the request in each row (-1: empty)
    left = np.zeros(rows, dtype=np.int64)  # tokens each row's request still needs
    reserved = np.zeros(2, dtype=np.int64)
    tok = torch.zeros(rows, dtype=torch.long, device=dev)
    pos = torch.zeros(rows, dtype=torch.long, device=dev)
    width = max(r.new_tokens for r in requests)
    out = torch.zeros(rows, width, dtype=torch.long, device=dev)  # each row's tokens so far
    col = torch.zeros(rows, dtype=torch.long, device=dev)
    ar = torch.arange(rows, device=dev)
    graph = None
    nxt, step, spans = 0, 0, {k: [] for k in ("prefill", "decode", *ADMIT_PARTS)}

    def finish(row: int) -> None:
        i = int(owner[row])
        run.tokens[i] = out[row, : requests[i].new_tokens].clone()
        run.finished_step[i], dones[i] = step, clock.mark()
        reserved[:] -= need[i]
        owner[row] = -1

    def admit() -> None:
        nonlocal nxt
        free = np.flatnonzero(owner < 0)
        take = []
        for row in free:
            if nxt >= n or (reserved + need[nxt] > capacity).any():
                break  # in order: a request that does not fit waits for pages, and the others behind it
            take.append((int(row), nxt))
            reserved[:] += need[nxt]
            nxt += 1
        if not take:
            return
        t0 = clock.mark()
        # prefilled in groups of like prompt lengths: the least left padding (computed for nothing) per group
        take.sort(key=lambda t: len(requests[t[1]].ids))
        for g in range(0, len(take), prefill_rows):
            group = take[g: g + prefill_rows]
            reqs = [requests[i] for _, i in group]
            ids, mask = left_padded(reqs)
            m0 = clock.mark()
            side = make_cache()
            m1 = clock.mark()
            logits = prefill(model, ids, side, mask if not bool(mask.all()) else None)
            m2 = clock.mark()
            cache.adopt_rows([row for row, _ in group], side, list(range(len(reqs))))
            del side
            for part, span in zip(ADMIT_PARTS, ((m0, m1), (m1, m2), (m2, clock.mark()))):
                spans[part].append(span)
            rws = torch.tensor([row for row, _ in group], device=dev)
            first = logits.argmax(-1)
            tok[rws], out[rws, 0], col[rws] = first, first, 1
            pos[rws] = torch.tensor([len(r.ids) for r in reqs], device=dev)
            for row, i in group:
                owner[row], left[row] = i, requests[i].new_tokens - 1
                run.admitted_step[i] = step
        mark = clock.mark()
        for _, i in take:
            firsts[i] = mark
        spans["prefill"].append((t0, mark))
        for row, i in take:  # a request of one token is done at its prefill
            if left[row] == 0:
                finish(row)

    admit()
    while (owner >= 0).any():
        if max_seconds is not None and time.perf_counter() - t_host > max_seconds:
            run.complete = False
            break
        t0 = clock.mark()
        if cuda_graph:
            if graph is None:
                from rotkv.cache.graph import GraphDecoder

                graph = GraphDecoder(model, cache, max_len, kw, compile_layers=compile_layers, reserve=False)
            logits = graph.step(tok, pos)
        else:
            logits = model(input_ids=tok[:, None], position_ids=pos[:, None], use_cache=True,
                           **{kw: cache}).logits[:, -1]
        active = owner >= 0
        run.active.append(int(active.sum()))
        tok = logits.argmax(-1)
        live = torch.from_numpy(active).to(dev, non_blocking=True)
        out[ar, col.clamp(max=width - 1)] = torch.where(live, tok, out[ar, col.clamp(max=width - 1)])
        col += live.long()
        pos += 1
        step += 1
        spans["decode"].append((t0, clock.mark()))
        run.flushed.append(len(st.plan_steps[0].flush) if st.plan_steps else 0)
        left[active] -= 1
        for row in np.flatnonzero(active & (left == 0)):
            finish(int(row))
        empty = np.flatnonzero(owner < 0)
        if len(empty):
            cache.release_rows(empty)  # finished requests' pages, and the empty rows' dummy tokens
            pos[torch.from_numpy(empty).to(dev)] = 0
        if max_seconds is None or time.perf_counter() - t_host <= max_seconds:
            admit()
    end = clock.mark()
    if (st.tier_free.capacity, st.body_free.capacity) != pools:
        raise RuntimeError("the pools grew during the job: the admission's page reservation is wrong")
    secs = clock.seconds()
    run.wall_s = secs[end] - secs[start]
    run.prefill_s = sum(secs[b] - secs[a] for a, b in spans["prefill"])
    run.admit_s = {k: sum(secs[b] - secs[a] for a, b in spans[k]) for k in ADMIT_PARTS}
    run.group_s = [secs[b] - secs[a] for (a, _), (_, b) in zip(spans["cache"], spans["adopt"])]
    run.step_s = [secs[b] - secs[a] for a, b in spans["decode"]]
    run.decode_s = sum(run.step_s)
    run.first_s = [secs[m] if m is not None else None for m in firsts]
    run.done_s = [secs[m] if m is not None else None for m in dones]
    run.tokens = [t.cpu() if t is not None else None for t in run.tokens]
    done = sum(r.new_tokens for r, t in zip(requests, run.tokens) if t is not None)
    running = int(col[torch.from_numpy(owner >= 0).to(dev)].sum()) if (owner >= 0).any() else 0
    run.generated = done + running
    cache.check_metadata_range()
    return run

