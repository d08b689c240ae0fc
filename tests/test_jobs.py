"""Continuous batching on rotkv's pools (rotkv.jobs): rows freed and refilled mid-batch, every request's
greedy tokens equal to its own run alone; the page state's release and adopt."""

import numpy as np
import pytest
import torch

from rotkv.cache import RotkvCache
from rotkv.cache.plan import PageState
from rotkv.generation import generate_batch
from rotkv.jobs import Request, reservation, run_job
from rotkv_testing import make_tiny_llama

# small pages, window and chunk: a request of a few dozen tokens flushes pages in its prefill and its decode
SPECS = {
    "quarot-int2": dict(sink=4, window=8, page_size=4, prefill_chunk=16),
    "refine": dict(sink=4, window=8, page_size=4, prefill_chunk=16, refine_tokens=12, refine_values=True,
                   refine_every=2),
    "bf16": dict(sink=4, window=8, page_size=4, prefill_chunk=16),
}


def _preset(name):
    return "quarot-int2" if name == "refine" else name


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(seed=3, layers=2)


def _requests(vocab, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(3, vocab, (p,), generator=g), t) for p, t in lengths]


def _alone(model, name, req):
    """The request's greedy tokens run alone (rotkv.generation.generate_batch, eager)."""
    cache = RotkvCache(model, _preset(name), check_finite=False, **SPECS[name])
    return generate_batch(model, req.ids[None], cache, req.new_tokens).tokens[0]


@pytest.mark.parametrize("name", list(SPECS))
def test_job_matches_each_request_alone(model, name):
    # 6 requests through 3 rows; pools that hold two long requests at once (so the third row waits for
    # pages at times): rows are freed and refilled mid-batch, at different steps
    reqs = _requests(model.config.vocab_size, [(21, 30), (9, 12), (30, 25), (14, 40), (5, 7), (17, 19)])
    spec = SPECS[name]
    st = PageState.from_spec(RotkvCache(model, _preset(name), **spec).spec)
    t_need = max(reservation(st, r.length)[0] for r in reqs)
    b_need = sorted(reservation(st, r.length)[1] for r in reqs)
    tier = 3 + (2 * t_need if st.quantized else sum(sorted(reservation(st, r.length)[0] for r in reqs)[-2:]))
    body = max(1, sum(b_need[-2:]))
    make = lambda: RotkvCache(model, _preset(name), check_finite=False, **spec)  # noqa: E731
    run = run_job(model, make, reqs, rows=3, tier_pages=tier, body_pages=body, prefill_rows=2)
    assert run.complete and all(t is not None for t in run.tokens)
    for i, r in enumerate(reqs):
        assert run.tokens[i].shape == (r.new_tokens,)
        assert torch.equal(run.tokens[i], _alone(model, name, r)), f"request {i}"
    # admission: in order, never more than the rows, a request waits while the pools cannot hold it
    assert run.admitted_step == sorted(run.admitted_step)
    assert max(run.active) <= 3 and run.steps >= max(r.new_tokens for r in reqs) - 1
    assert run.admitted_step[-1] > 0  # the later requests entered mid-batch
    for i, r in enumerate(reqs):
        assert run.finished_step[i] - run.admitted_step[i] == r.new_tokens - 1
    assert run.generated == sum(r.new_tokens for r in reqs)
    assert 0 < run.mean_batch <= 3 and run.tpot_ms > 0
    # the admission's parts (the group's cache, the model calls, the adoption) lie inside its time
    assert sorted(run.admit_s) == ["adopt", "cache", "model"] and min(run.admit_s.values()) > 0
    assert sum(run.admit_s.values()) <= run.prefill_s


def test_job_rejects_a_request_the_pools_cannot_hold(model):
    reqs = _requests(model.config.vocab_size, [(20, 40)])
    make = lambda: RotkvCache(model, "quarot-int2", check_finite=False, **SPECS["quarot-int2"])  # noqa: E731
    with pytest.raises(ValueError, match="body_pages"):
        run_job(model, make, reqs, rows=2, tier_pages=20, body_pages=4)


def test_job_stops_at_max_seconds(model):
    reqs = _requests(model.config.vocab_size, [(8, 400)] * 3)
    make = lambda: RotkvCache(model, "quarot-int2", check_finite=False, **SPECS["quarot-int2"])  # noqa: E731
    run = run_job(model, make, reqs, rows=2, tier_pages=20, body_pages=400, max_seconds=0.0)
    assert not run.complete and run.tokens == [None] * 3 and run.generated == 2  # the two prefills' tokens


def test_release_frees_pages_and_adopt_takes_them():
    src = PageState(sink=2, window=4, page_size=4, quantized=True, chunk=64)
    src.reset(1)
    src.plan(30, np.array([30]))
    dst = PageState(sink=2, window=4, page_size=4, quantized=True, chunk=64)
    dst.reset(2)
    dst.tier_free.grow(12), dst.body_free.grow(20)
    dst.plan(1, np.array([1, 1]))
    used = (dst.tier_free.used, dst.body_free.used)
    dst.release([0])
    assert dst.tier_tokens[0] == 0 and dst.tier_free.used == used[0] - 1
    ts, td, bs, bd = dst.adopt(0, src, 0)
    assert dst.lengths()[0] == src.lengths()[0] == 30 and len(bs) == len(bd) == src.body_count[0]
    assert len(ts) == len(td) == src.tier_used_pages()[0]
    assert set(td.tolist()).isdisjoint(dst.tier_pages[1, : dst.tier_used_pages()[1]].tolist())
    with pytest.raises(ValueError, match="release it first"):
        dst.adopt(0, src, 0)
    dst.release([0, 1])
    assert dst.tier_free.used == 0 and dst.body_free.used == 0 and (dst.lengths() == 0).all()


def test_reasoning_bench_writes_rows(tmp_path):
    """benchmarks/bench_job.py --workload reasoning on a tiny model on the CPU: one row per method, the
    INT2 job through continuous batching with every request finished."""
    import json

    from rotkv_testing import load_benchmark

    out = tmp_path / "jr.json"
    load_benchmark("bench_job").main(["--workload", "reasoning", "--tiny", "--device", "cpu", "--kv-gb", "0.0002",
                                      "--requests", "4", "--prompt-tokens", "16", "24", "--new-tokens", "10", "20",
                                      "--methods", "rotkv:quarot-int2", "rotkv:bf16", "hf-static-compile", "--no-warmup",
                                      "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["rotkv:quarot-int2", "rotkv:bf16", "hf-static-compile"]
    for r in rows:
        assert r["complete"] and r["finished"] == 4 and r["tok_per_s"] > 0 and 1 <= r["max_batch"] <= r["rows"], r
    for r in rows[:2]:
        assert 0 < r["prefill_model_s"] <= r["prefill_s"] and r["prefill_adopt_s"] >= 0 and r["prefill_cache_s"] >= 0
    assert rows[1]["job_speedup_vs_bf16"] == 1.0 and rows[2]["compiled"] is False  # StaticCache's waves, uncompiled here


def test_a_short_request_prefilled_beside_a_longer_one_keeps_its_refine_size_rule(model):
    """Admission prefills requests in groups: the group's longest row grows the side cache's refine rings to
    more slots than a short row of the group reads (one refined page per 2 body pages here). Adopting that
    row moves only the pages it reads; the job's tokens are each request's alone."""
    spec = dict(sink=4, window=8, page_size=4, prefill_chunk=64, refine_tokens=16, refine_values=True,
                refine_every=2)
    reqs = _requests(model.config.vocab_size, [(20, 10), (60, 6), (44, 8)], seed=4)
    make = lambda: RotkvCache(model, "quarot-int2", check_finite=False, **spec)  # noqa: E731
    run = run_job(model, make, reqs, rows=3, tier_pages=40, body_pages=60, prefill_rows=3)
    assert run.complete and run.admitted_step[:2] == [0, 0]  # the short request came first, in the long one's group
    for i, r in enumerate(reqs):
        cache = make()
        alone = generate_batch(model, r.ids[None], cache, r.new_tokens).tokens[0]
        assert torch.equal(run.tokens[i], alone), f"request {i}"


def test_admission_prefills_like_lengths_together(model, monkeypatch):
    """Requests admitted at one step are prefilled in groups of like prompt lengths (the least left padding);
    each request's tokens stay its own run's."""
    import rotkv.jobs as jobs

    widths = []
    real = jobs.prefill
    monkeypatch.setattr(jobs, "prefill", lambda m, ids, *a, **k: (widths.append(ids.shape[1]), real(m, ids, *a, **k))[1])
    reqs = _requests(model.config.vocab_size, [(30, 3), (5, 4), (28, 2), (6, 3)], seed=6)
    make = lambda: RotkvCache(model, "quarot-int2", check_finite=False, **SPECS["quarot-int2"])  # noqa: E731
    run = run_job(model, make, reqs, rows=4, tier_pages=40, body_pages=60, prefill_rows=2)
    assert sorted(widths) == [6, 30]  # {5, 6} and {28, 30}, not {30, 5} and {28, 6}
    for i, r in enumerate(reqs):
        assert torch.equal(run.tokens[i], _alone(model, "quarot-int2", r)), f"request {i}"


def test_adopt_rows_moves_several_rows_at_once_as_stored(model):
    """adopt_rows takes a group's rows in one copy per layer: each adopted row reads back (sink, dequantized
    body with its refine bits, window) exactly as its source row, rows of different lengths into rows that
    are not the sources' order; repeated rows are refused before anything moves."""
    from rotkv.generation import prefill

    spec = dict(sink=4, window=8, page_size=4, prefill_chunk=64, refine_tokens=16, refine_values=True, refine_every=2)
    make = lambda: RotkvCache(model, "quarot-int2", check_finite=False, **spec)  # noqa: E731
    reqs = _requests(model.config.vocab_size, [(41, 1), (23, 1), (57, 1)], seed=5)
    longest = max(len(r.ids) for r in reqs)
    ids = torch.zeros(3, longest, dtype=torch.long)
    mask = torch.zeros(3, longest, dtype=torch.long)
    for j, r in enumerate(reqs):
        ids[j, longest - len(r.ids):], mask[j, longest - len(r.ids):] = r.ids, 1
    side = make()
    prefill(model, ids, side, mask)
    cache = make()
    cache.open_rows(4, 20, 40, model.device)
    with pytest.raises(ValueError, match="distinct rows"):
        cache.adopt_rows([1, 1], side, [0, 1])
    assert cache.free_pages()["body_used"] == 0  # nothing moved
    cache.adopt_rows([3, 0, 2], side, [1, 2, 0])
    used = cache.free_pages()["body_used"]
    with pytest.raises(ValueError, match=r"rows \[2\] hold tokens"):
        cache.adopt_rows([1, 2], side, [0, 1])
    assert cache.free_pages()["body_used"] == used and int(cache.state.body_count[1]) == 0  # row 1 untouched
    for row, src_row in ((3, 1), (0, 2), (2, 0)):
        for mine, theirs in zip(cache.layers, side.layers):
            for a, b in zip(mine.read(row), theirs.read(src_row)):
                assert torch.equal(a, b), (row, src_row)
    assert int(cache.state.body_count[1]) == 0 and cache.state.lengths()[1] == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset, extra", [("quarot-int2", {}), ("bf16", {}),
                                           ("quarot-int2", dict(refine_tokens=64, refine_values=True, refine_every=2))])
def test_job_in_a_cuda_graph_agrees_with_the_eager_job(preset, extra):
    """On the GPU: the job with its decode step in a CUDA graph (pools sized once, rows refilled, flush
    graphs per bucket of pages) gives the greedy tokens of the same job decoded eagerly by the same
    kernels (bf16: a near-tie may part them, so 90% of the tokens and every first token)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      intermediate_size=512, num_hidden_layers=2, vocab_size=512, pad_token_id=0)
    model = LlamaForCausalLM(cfg).cuda().bfloat16().eval()
    reqs = _requests(512, [(100, 90), (37, 60), (150, 120), (64, 40), (80, 100)], seed=1)
    spec = dict(sink=16, window=32, page_size=16, prefill_chunk=128, **extra)
    make = lambda: RotkvCache(model, preset, check_finite=False, **spec)  # noqa: E731
    runs = [run_job(model, make, reqs, rows=3, tier_pages=3 * 20 + 3 if preset != "bf16" else 40, body_pages=40,
                    cuda_graph=g) for g in (False, True)]
    same = [(a == b).float().mean().item() for a, b in zip(runs[0].tokens, runs[1].tokens)]
    assert all(a[0] == b[0] for a, b in zip(runs[0].tokens, runs[1].tokens))
    assert min(same) >= 0.9, same
    assert runs[1].admitted_step[-1] > 0 and runs[0].admitted_step == runs[1].admitted_step


def test_job_records_the_decode_time_flushes(model):
    """Every row flushes one window page into the body every page_size steps: the job's per-step record
    says which steps did and how many pages (a request's flushes: its decode tokens beyond the window)."""
    reqs = _requests(model.config.vocab_size, [(10, 41)])
    make = lambda: RotkvCache(model, "quarot-int2", check_finite=False, **SPECS["quarot-int2"])  # noqa: E731
    run = run_job(model, make, reqs, rows=1, tier_pages=10, body_pages=20)
    st = make().state
    p, window = st.page, SPECS["quarot-int2"]["window"]
    assert len(run.flushed) == len(run.step_s) == run.steps == 40
    # after the prefill of 10 tokens (sink 4, window 8 to 11), a page leaves on each step that fills the window + page
    assert sum(run.flushed) == (10 + 40 - 1 - 4 - window) // p
    assert all(f in (0, 1) for f in run.flushed) and run.step_ms(True) > 0 and run.step_ms(False) > 0


def test_rollback_undoes_a_plan_without_copies():
    """PageState.rollback after a decode plan that allocates and flushes pages (the free lists restored from
    their checkpoints, the tables from the arrays the plan replaced): the state plans the same step again."""
    from rotkv.cache.plan import FreeList

    st = PageState(sink=2, window=4, page_size=4, quantized=True, chunk=64)
    st.reset(3)
    st.plan(30, np.array([30, 21, 9]))
    for _ in range(8):  # up to a step that flushes a page (each row flushes one in every 4 steps)
        before = [a.copy() for a in (st.tier_tokens, st.body_count, st.tier_free._stack, st.body_free._stack)]
        tops = (st.tier_free._top, st.body_free._top)
        first = st.plan(1, np.ones(3, dtype=np.int64))[0]
        if len(first.flush):
            break
    assert len(first.flush)
    st.rollback()
    for a, b in zip(before, (st.tier_tokens, st.body_count, st.tier_free._stack, st.body_free._stack)):
        assert np.array_equal(a, b)
    assert (st.tier_free._top, st.body_free._top) == tops
    again = st.plan(1, np.ones(3, dtype=np.int64))[0]
    assert np.array_equal(again.write_slots, first.write_slots) and np.array_equal(again.flush.dst, first.flush.dst)
    fl = FreeList(4)
    fl.checkpoint()
    got = fl.alloc(3)
    fl.free(got[:1])
    fl.alloc(10)  # grows
    fl.restore()
    assert fl.capacity == 4 and np.array_equal(fl.alloc(4), np.arange(4))


@pytest.mark.parametrize("width", [7, 64, 65, 300])
def test_page_table_host_lists_every_rows_pages(width):
    """kv_indices: each row's first counts[b] pages in order, by the mask (narrow tables) or by row slices."""
    from rotkv.cache.plan import page_table_host

    rng = np.random.default_rng(width)
    pages = rng.integers(0, 10_000, (9, width))
    counts = rng.integers(0, width + 1, 9)
    counts[3] = 0
    indptr, indices, last = page_table_host(pages, counts, np.full(9, 4))
    want = np.concatenate([pages[b, :c] for b, c in enumerate(counts)])
    assert indptr.tolist() == [0, *np.cumsum(counts).tolist()] and indices.dtype == np.int32
    assert np.array_equal(indices[: len(want)], want) and len(indices) == max(len(want), 1)


def test_static_decode_keeps_pools_sized_by_memory(model):
    """The CUDA-graph decoder's buffers over a continuous batch (built on the CPU here; the graph itself needs a
    GPU): reserve=False leaves the pools at what open_rows gave them, and a step's tables load after rows were
    released and refilled. flush_bucket: the pages a flush graph covers."""
    from rotkv.cache.graph import StaticDecode, flush_bucket
    from rotkv.generation import prefill

    spec = SPECS["refine"]
    make = lambda: RotkvCache(model, "quarot-int2", check_finite=False, **spec)  # noqa: E731
    cache = make()
    cache.open_rows(3, 30, 24, torch.device("cpu"))
    side = make()
    prefill(model, torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(0)), side)
    cache.adopt_rows([0, 2], side, [0, 1])
    static = StaticDecode(cache, 3, 80, reserve=False)
    st = cache.state
    assert (st.tier_free.capacity, st.body_free.capacity) == (30, 24)
    assert cache.layers[0].pools.refine_pages == cache.layers[0].pools.refine.cap  # rings grown for 80 tokens
    for _ in range(2):
        step = st.plan(1, np.ones(3, dtype=np.int64))[0]
        static.load(step)
        (body, _), _ = st.host_tables(step)
        n = len(body[1])
        assert torch.equal(static.body[0], torch.from_numpy(body[0])) and torch.equal(static.body[1][:n], torch.from_numpy(body[1]))
        cache.release_rows([1])
    assert [flush_bucket(n, 64) for n in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64] and flush_bucket(9, 12) == 12


def test_synthetic_fill_refines_every_row_as_a_prefill_does(model):
    """benchmarks/bench_job.py's synthetic fill (profile_step.py's) writes a refined cache's rings for every row:
    they hold the rows, and each row's newest refined page holds codes (the fill once left the rings empty)."""
    from rotkv_testing import load_benchmark

    fill = load_benchmark("bench_job").fill_synthetic
    cache = RotkvCache(model, "quarot-int2", check_finite=False, **SPECS["refine"])
    fill(model, cache, rows=3, context=40, chunk=16)
    layer = cache.layers[0]
    counts = cache.state.body_count[:3]
    assert (counts > 0).all()
    for ring in layer.pools.refine_rings:
        assert ring.data.shape[0] == 3
        newest = ring.data[np.arange(3), (counts - 1) % ring.pages]
        assert all(bool(newest[r].any()) for r in range(3))
