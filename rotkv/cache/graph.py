"""Decode steps of a model over a :class:`~rotkv.cache.RotkvCache` captured in one CUDA graph.

How (gpt-fast's and the serving engines' recipe): the pools are sized up front for
``max_len`` tokens per row (:meth:`StaticDecode.reserve`), so their addresses never change; each
step's page tables and write slots (split into page and offset, once for every layer) are copied
into fixed buffers sized for that capacity; the kernels' grids are sized by the capacity (rows shorter than it exit early). Per step, on the
host: plan the step (``PageState.plan``), copy its tables into the buffers, replay the graph,
then, on a step where pages leave the window (every ``page_size`` steps per row), replay the
*flush graph*: every layer's quantize-on-write of the leaving pages, captured once per bucket of
pages (powers of two up to ``rows``: rows that flush on different steps, as in continuous batching,
flush a few pages a step; a step that flushes fewer than its bucket repeats its last page: writing
the same page twice stores the same bytes). It takes the flush's launches (every layer's gather, writes and range check) off
the host (where the host launches the eager flush while the GPU still runs the replay, the two take
the same time: docs/kernel-notes.md). ``flush_graph=False`` flushes eagerly. Inside
the graphs nothing syncs with the host: the NaN check is off, and the e4m3 range flags are ORed in
place on the device. Each layer's
kernel is its decode plan's (``rotkv.kernels.plan.plan_decode``) for the capacity: the graph
captures that launch, and a layer no kernel reads is refused before the capture.

``compile_layers=True`` captures the model's own layers compiled (:mod:`rotkv.cache.compiled`:
norms, RoPE, activations and residuals fused; rotkv's cache calls untouched): the warm-up step
compiles them, once per layer, and the capture takes the compiled kernels.

Use it through :func:`rotkv.generation.generate_batch` (``cuda_graph=True``) or
``rotkv generate --cuda-graph``.
"""

from __future__ import annotations

import contextlib
import inspect

import numpy as np
import torch

from rotkv.cache.layer import HybridLayer
from rotkv.cache.plan import Step
from rotkv.cache.tiers import graph_flags
from rotkv.kernels.plan import check_graph


class StaticDecode:
    """Fixed device buffers that a captured decode step reads: write slots and page tables."""

    def __init__(self, cache, rows: int, max_len: int, reserve: bool = True):
        st = cache.state
        if st.rows != rows:
            raise ValueError(f"the cache holds {st.rows} rows, not {rows}")
        self.layers = [layer for layer in cache.layers if isinstance(layer, HybridLayer)]
        if len(self.layers) != len(cache.layers):
            raise ValueError("CUDA-graph decode needs every layer in rotkv's paged pools (no sliding-window "
                             "or budgeted layers); run without cuda_graph")
        if cache.spec.predict_keys:
            raise ValueError(f"preset {cache.spec.name!r} predicts each layer's keys from the previous layer's "
                             "(`predict_keys`), which the decode kernels do not read; run without cuda_graph")
        check_graph(**graph_flags(cache.spec))
        dev = self.layers[0].device
        p = st.page
        self.body_pages = -(-max_len // p) if st.quantized else 0
        self.tier_pages = st.tier_pages_for(max_len)
        # capacity: every row at max_len (a prefill chunk may have left more tier pages than that);
        # reserve=False keeps the pools as they are (continuous batching sizes them by memory, and
        # admits a request only where its pages are free: rotkv.jobs)
        if reserve:
            st.tier_free.grow(max(st.tier_free.capacity, rows * self.tier_pages))
            st.body_free.grow(max(st.body_free.capacity, rows * self.body_pages + 1))
        for layer in self.layers:
            layer.pools.fit(st.tier_free.capacity, st.body_free.capacity)
            # the tiers at the size a row of max_len needs: the captured graph keeps their tensors
            layer.pools.grow_tiers(st.body_count, self.body_pages)
        # every buffer a step reads is a view of one int64 and one int32 device buffer, each loaded by one
        # copy from its host mirror per step (:meth:`load`; before, eight host-to-device and six
        # device-to-device copies)
        strides = {l.pools.tier_k.stride() for l in self.layers}
        self.tier_strides = strides.pop() if len(strides) == 1 else None
        self._host64 = np.zeros(3 * rows if self.tier_strides else 2 * rows, dtype=np.int64)
        self._dev64 = torch.zeros(len(self._host64), dtype=torch.int64, device=dev)
        self.slot_at = self._dev64[: 2 * rows].view(2, rows)  # each row's write slot: (page, offset)
        # ... and as an element offset into every layer's tier pool [pages, H, P, D], where the rotation
        # kernel writes the new key and value (LayerRotation.rotate_into); None unless all share one layout
        self.tier_rows = self._dev64[2 * rows:] if self.tier_strides else None
        # the page tables (kv_indptr, kv_indices, kv_last_page_len) of the body and the tier
        self._sizes32 = (rows + 1, max(1, rows * self.body_pages), rows, rows + 1, max(1, rows * self.tier_pages), rows)
        self._host32 = np.zeros(sum(self._sizes32), dtype=np.int32)
        self._dev32 = torch.zeros(len(self._host32), dtype=torch.int32, device=dev)
        views = torch.split(self._dev32, self._sizes32)
        self.body, self.tier = tuple(views[:3]), tuple(views[3:])
        self.body_max = self.body_pages * p
        self.tier_max = self.tier_pages * p
        self.state, self.rows, self.max_len = st, rows, max_len

    def load(self, step: Step) -> None:
        """Copy a decode step's slots and tables into the buffers."""
        if not step.decode:
            raise ValueError("only decode steps (one new token per row) run in the CUDA graph")
        if int(self.state.lengths().max()) > self.max_len:
            raise ValueError(f"a row is longer than the graph's capacity of {self.max_len} tokens")
        rows, slots, p = self.rows, np.asarray(step.write_slots, dtype=np.int64), self.state.page
        h64 = self._host64
        h64[:rows], h64[rows:2 * rows] = slots // p, slots % p
        if self.tier_rows is not None:
            s0, _, s2, _ = self.tier_strides
            h64[2 * rows:] = h64[:rows] * s0 + h64[rows:2 * rows] * s2
        (body, _), (tier, _) = self.state.host_tables(step)
        at = 0
        for a, size in zip(body + tier, self._sizes32):
            if len(a) > size:
                raise ValueError(f"a page table of {len(a)} entries exceeds the graph's buffer of {size}")
            self._host32[at: at + len(a)] = a
            at += size
        # from pageable host memory an asynchronous copy returns once it has staged its source (no wait
        # for the stream's work), so the mirrors can be refilled for the next step
        self._dev64.copy_(torch.from_numpy(h64), non_blocking=True)
        self._dev32.copy_(torch.from_numpy(self._host32), non_blocking=True)


class GraphDecoder:
    """One greedy decode step of ``model`` over ``cache``, replayed from a CUDA graph.

    Build it after the prefill; :meth:`step` takes the last tokens ``[B]`` and their positions
    ``[B]`` and returns the logits ``[B, vocab]`` of the next token.
    """

    def __init__(self, model, cache, max_len: int, cache_kwarg: str = "past_key_values", flush_graph: bool = True,
                 compile_layers: bool = False, reserve: bool = True):
        if not torch.cuda.is_available() or model.device.type != "cuda":
            raise ValueError("cuda_graph needs the model on a CUDA device")
        self.model, self.cache, self.kw = model, cache, cache_kwarg
        rows = cache.state.rows
        self.static = StaticDecode(cache, rows, max_len, reserve)
        dev = model.device
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(rows, 1, dtype=torch.long, device=dev)
        self.takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters
        self.cache_position = torch.zeros(1, dtype=torch.long, device=dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        # the flush graph's (tier page, body page, row, index in the row's body) per row (the last two for
        # the tiers: rotkv.cache.tiers); flush_graph=False flushes eagerly
        self.flush_graph = flush_graph
        self.flush_pages = torch.zeros(4, rows, dtype=torch.int64, device=dev)
        # one flush graph per bucket of pages (powers of two up to rows): rows that flush on different
        # steps (continuous batching) flush a few pages a step, not the batch's worth
        self._flush_captured: dict[int, torch.cuda.CUDAGraph] = {}
        self.compile_layers = compile_layers

    def _forward(self) -> torch.Tensor:
        extra = {"cache_position": self.cache_position} if self.takes_cache_position else {}
        out = self.model(input_ids=self.ids, position_ids=self.pos, use_cache=True, **extra,
                         **{self.kw: self.cache})
        return out.logits[:, -1]

    def _run_static(self, fn):
        for layer in self.static.layers:
            layer.static = self.static
        try:
            return fn()
        finally:
            for layer in self.static.layers:
                layer.static = None

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        st = self.cache.state
        step = st.plan(1, np.ones(st.rows, dtype=np.int64))[0]
        self.static.load(step)
        self.ids.copy_(tokens.view(-1, 1))
        self.pos.copy_(positions.view(-1, 1))
        self.cache_position.fill_(st.seen - 1)
        if self.graph is None:
            # the first step runs eagerly on a side stream (it compiles and warms every kernel) and
            # is a real step; the graph is captured after it
            if self.compile_layers:
                from rotkv.cache.compiled import compiled_layers

                layers = compiled_layers(self.model)
            else:
                layers = contextlib.nullcontext()
            with layers:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    logits = self._run_static(self._forward).clone()
                torch.cuda.current_stream().wait_stream(s)
                self._flush(step)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    self.logits = self._run_static(self._forward)
            self.graph = g  # only a capture that finished is replayed
            return logits
        self.graph.replay()
        self._flush(step)
        return self.logits

    def _flush_layers(self, src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor, index: torch.Tensor) -> None:
        """Flush every layer's pages ``src`` into ``dst``, the ``index``-th body pages of batch rows ``rows``
        (for the tiers; a decode step flushes at most one page per row)."""
        for layer in self.static.layers:
            layer.pools.flush(src, dst, (rows, index))

    def _flush(self, step: Step) -> None:
        n = len(step.flush)
        if n == 0:
            return
        rows = self.flush_pages.shape[1]
        if not self.flush_graph or n > rows:  # at most one page per row leaves in a decode step
            dev = self.model.device
            self._flush_layers(*step.device_flush(dev), *step.device_flush_rows(dev))
            return
        # a step that flushes fewer pages than its bucket repeats its last page (the same bytes written twice)
        size = flush_bucket(n, rows)
        pairs = np.empty((4, size), dtype=np.int64)
        for i, pages in enumerate((step.flush.src, step.flush.dst, step.flush.rows, step.flush.index)):
            pairs[i, :n], pairs[i, n:] = pages, pages[-1]
        buf = self.flush_pages[:, :size]
        buf.copy_(torch.from_numpy(pairs))
        g = self._flush_captured.get(size)
        if g is not None:
            g.replay()
            return
        # a bucket's first flush runs eagerly (it is real, and warms every write kernel); then it is captured
        self._flush_layers(*buf)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._flush_layers(*buf)
        self._flush_captured[size] = g


def flush_bucket(n: int, rows: int) -> int:
    """Pages a flush graph of a step that flushes ``n`` pages covers: the next power of two, at most ``rows``."""
    return min(rows, 1 << max(0, int(n) - 1).bit_length())
