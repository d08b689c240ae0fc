"""rotkv's vLLM backend on the CPU: block layout and sizes, settings, tensor-parallel sharding, the step planner
and one layer's attention + cache update against rotkv's own paged cache (HybridLayer), over vLLM-style
metadata (query_start_loc, seq_lens, block_table) with mixed prefill/decode batches and window flushes.
The vLLM classes themselves are tested where vLLM imports (skipped otherwise)."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from rotkv.cache.codecs import make_codecs
from rotkv.config import CacheSpec, get_preset
from rotkv.integrations.vllm.attention import layer_step, slot_rings
from rotkv.integrations.vllm.config import check_spec, layer_codecs, parse_settings
from rotkv.integrations.vllm.layout import BlockLayout, blocks_in, group_page_bytes
from rotkv.integrations.vllm.state import Geometry, SlotTable, plan_step
from rotkv.integrations.vllm.tp import local_heads, shard_heads, shard_rotation
from rotkv.kernels.body import PagedBody
from rotkv.rotations.base import LayerRotation

P = 16


# ---- layout ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,meta_v", [((2, 2), None), ((4, 2), "float8"), ((2, 4), None)])
def test_block_bytes_and_byte_view_round_trip(bits, meta_v):
    """One block = one page of K and V: its bytes are codes + scale + lo of both sides, and the part views over
    a flat uint8 buffer hold exactly what rotkv's separate codes/scale/lo tensors hold (and nothing overlaps)."""
    h, d, g, nblocks = 3, 64, 32, 7
    kc, vc = make_codecs("token", 2, g, 1.0, 1.0, key_bits=bits[0], meta_v=meta_v)
    vc.bits = bits[1]
    layout = BlockLayout.of(h, d, P, kc, vc)
    msz_v = 1 if meta_v == "float8" else 2
    per_token = (d * bits[0] // 8 + 2 * (d // g) * 2) + (d * bits[1] // 8 + 2 * (d // g) * msz_v)
    assert layout.slot_bytes() == per_token
    assert layout.page_bytes() == P * h * per_token
    buf = torch.zeros(nblocks * layout.page_bytes(), dtype=torch.uint8)
    assert blocks_in(buf, layout.page_bytes()) == nblocks
    body = layout.body(buf, nblocks)
    ref = PagedBody.zeros(nblocks, h, P, d, bits, g)  # rotkv's own separate tensors (fp16 metadata)
    gen = torch.Generator().manual_seed(0)
    for mine, theirs in zip(body.tensors(), ref.tensors()):
        if theirs.dtype == torch.uint8:
            theirs.copy_(torch.randint(0, 256, theirs.shape, generator=gen, dtype=torch.uint8))
        else:
            theirs.copy_(torch.randn(theirs.shape, generator=gen).to(theirs.dtype))
        assert mine.shape == theirs.shape and mine.is_contiguous() and mine.data_ptr() % 16 == 0
        mine.copy_(theirs.to(mine.dtype))
    for mine, theirs in zip(body.tensors(), ref.tensors()):  # every part still reads back: no overlap
        assert torch.equal(mine.float(), theirs.to(mine.dtype).float())
    # the views share the buffer: a byte written through the buffer shows in the view
    again = layout.body(buf, nblocks)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(again.tensors(), body.tensors()))
    assert sum(t.numel() * t.element_size() for t in body.tensors()) == buf.numel()


def test_int2_block_is_much_smaller_than_bf16():
    """The capacity vLLM's accounting sees: INT2 K and V with fp16 metadata (G = 64, D = 128) take 80 bytes per
    token and head against bf16's 512: 6.4x the tokens at the same memory."""
    kc, vc = make_codecs("token", 2, 64, 1.0, 1.0)
    layout = BlockLayout.of(8, 128, P, kc, vc)
    assert layout.slot_bytes() == 80
    assert 2 * 128 * 2 / layout.slot_bytes() == pytest.approx(6.4)
    k4, v4 = make_codecs("token", 2, 64, 1.0, 1.0, key_bits=4)
    assert group_page_bytes([layout, BlockLayout.of(8, 128, P, k4, v4)]) == P * 8 * (80 + 32)


# ---- settings ----------------------------------------------------------------------------------------------
def test_settings_from_additional_config(tmp_path):
    s = parse_settings({"rotkv": {"preset": "quarot-int2", "sink": 32, "window": 64}})
    assert (s.spec.name, s.spec.sink, s.spec.window, s.artifact) == ("quarot-int2", 32, 64, None)
    assert parse_settings({}).spec.name == "int4"  # no preset, no artifact: 4 bits, no calibration
    assert parse_settings({"rotkv": "naive-int2"}).spec.name == "naive-int2"
    assert parse_settings({"rotkv": '{"preset": "naive-int2", "window": 48}'}).spec.window == 48
    with pytest.raises(ValueError, match=r'additional_config\["rotkv"\] must hold a JSON object'):
        parse_settings({"rotkv": "{not json"})


def test_without_a_preset_the_artifact_names_it(tmp_path):
    """No preset: the preset rotkv picks (rotkv.contract.default_preset): the recommended oscar-refine for
    oscar-mix-long's artifact, else the first preset the artifact serves."""
    from rotkv.contract import kind_meta
    from rotkv_testing import make_tiny_llama, write_artifact

    model = make_tiny_llama()
    widths = {"k_bits": torch.tensor([4, 2], dtype=torch.int32), "k_gain": torch.tensor([0.1, 0.0])}
    for kind, extra in (("oscar", {}), ("oscar-mix", {}), ("oscar-mix-long", {"longfit_seq_len": "4096"})):
        path = write_artifact(model, tmp_path / f"{kind}.safetensors", tensors=widths if "mix" in kind else None,
                              **extra, **kind_meta(kind))
        want = {"oscar": "oscar-int2", "oscar-mix-long": "oscar-refine"}.get(kind, kind)
        assert parse_settings({"rotkv": {"artifact": path}}).spec.name == want
        from rotkv.contract import default_preset
        from rotkv.rotations.artifact import load_artifact

        assert want == default_preset(load_artifact(path))


@pytest.mark.parametrize("raw,match", [
    ({"presett": "quarot-int2"}, r"unknown key\(s\) \['presett'\]"),
    ({"preset": "nope"}, "unknown preset"),
    ({"preset": "bf16"}, "unquantized"),
    ({"preset": "kivi-2"}, "codec 'kivi'"),
    ({"preset": "quarot-int2", "refine_values": True}, "`refine_values` refines the refine tier's values"),
    ({"preset": "pmkvq"}, "progressive"),
    ({"preset": "quarot-int2", "page_size": 32}, "page_size=32"),
    ({"preset": "oscar-mix"}, r'needs a calibration artifact: set additional_config\["rotkv"\]\["artifact"\]'),
    ({"preset": "oscar-mix", "artifact": "/no/such.safetensors"}, "no such file"),
    ({"preset": "quarot-int2", "sink": "16"}, "`sink` has to be an int"),
    ({"preset": "quarot-int2", "context_length": 0}, "context_length"),
    ({"preset": "quarot-int2", "spare_slots": -1}, "spare_slots"),
])
def test_settings_errors_name_the_key(raw, match):
    with pytest.raises(ValueError, match=match):
        parse_settings({"rotkv": raw})


def test_layer_codecs_follow_the_spec():
    spec = get_preset("quarot-int2", k_bits="1:4", meta_v="float8")
    rot = LayerRotation(clip_k=0.9)
    kc, vc = layer_codecs(spec, 0, 64, rot, num_layers=2)
    assert (kc.bits, vc.bits, kc.clip, vc.meta) == (2, 2, 0.9, "float8")
    kc, _ = layer_codecs(spec, 1, 64, LayerRotation(), num_layers=2)
    assert kc.bits == 4 and kc.clip == 1.0
    with pytest.raises(ValueError, match="names layers"):
        layer_codecs(get_preset("quarot-int2", k_bits="5:4"), 0, 64, rot, num_layers=2)


def test_artifact_settings_check_the_geometry(tmp_path):
    from rotkv.integrations.vllm.config import load_rotations
    from rotkv_testing import make_tiny_llama, write_artifact

    model = make_tiny_llama()
    path = write_artifact(model, tmp_path / "a.safetensors")
    s = parse_settings({"rotkv": {"preset": "oscar-int2", "artifact": str(path)}})
    rots, art = load_rotations(s, 2, 2, 16)
    assert len(rots) == 2 and rots[0].R_K.shape == (2, 16, 16) and art is not None
    with pytest.raises(ValueError, match="made for another model"):
        load_rotations(s, 3, 2, 16)


# ---- tensor parallelism ------------------------------------------------------------------------------------
def test_tp_sharding_of_per_head_rotations():
    h, d = 8, 4
    rk = torch.randn(h, d, d)
    mean = torch.randn(h, d)
    assert list(local_heads(8, 4, 1)) == [2, 3]
    assert list(local_heads(2, 8, 5)) == [1]  # replication: ranks 4..7 hold head 1
    rot = LayerRotation(R_K=rk, R_V=rk.flip(0), k_mean=mean, clip_k=0.9)
    parts = [shard_rotation(rot, h, 4, r) for r in range(4)]
    assert torch.equal(torch.cat([p.R_K for p in parts]), rk)
    assert torch.equal(torch.cat([p.k_mean for p in parts]), mean)
    assert torch.equal(parts[3].R_V, rk.flip(0)[6:8]) and parts[2].clip_k == 0.9
    shared = torch.randn(1, d, d)
    assert shard_heads(shared, h, 4, 2) is shared
    rep = [shard_heads(rk[:2], 2, 8, r) for r in range(8)]
    assert all(torch.equal(rep[r], rk[r // 4:r // 4 + 1]) for r in range(8))
    with pytest.raises(ValueError, match="do not split"):
        local_heads(6, 4, 0)
    with pytest.raises(ValueError, match="out of range"):
        local_heads(8, 4, 4)


# ---- slots and the planner ---------------------------------------------------------------------------------
def test_slot_table_keys_requests():
    t = SlotTable(2)
    a = t.assign(["r5", "r9"], np.array([0, 0]))
    assert sorted(a.tolist()) == [0, 1]
    assert t.assign(["r9", "r5"], np.array([3, 3])).tolist() == [a[1], a[0]]  # reordered rows keep their slots
    assert t.assign([None], np.array([7])).tolist() == [2]  # a row of no request: the scratch slot
    b = t.assign(["r5", "r11"], np.array([4, 0]))  # r9 unseen longest: its slot goes to the new request
    assert b.tolist() == [a[0], a[1]]
    with pytest.raises(RuntimeError, match="spare_slots"):
        t.assign(["r9"], np.array([5]))  # r9's state is gone: an error, not a wrong answer


def test_slot_table_gives_back_the_slots_of_finished_requests():
    """A live request left out of a few steps (vLLM's token budget) keeps its slot when another finishes and a new
    one arrives: the finished request's slot is freed (released), so the new one need not evict the oldest."""
    t = SlotTable(2)
    x, y = t.assign(["x", "y"], np.array([0, 0])).tolist()
    t.assign(["x"], np.array([5]))  # y not scheduled: now the least recently seen
    t.release(["x", "never-seen"])  # x finished (unknown ids are ignored)
    assert t.assign(["w"], np.array([0])).tolist() == [x]
    assert t.assign(["y", "w"], np.array([9, 3])).tolist() == [y, x]
    u = SlotTable(2)  # the same steps without the release: w evicts y, and y's next step fails
    u.assign(["x", "y"], np.array([0, 0]))
    u.assign(["x"], np.array([5]))
    u.assign(["w"], np.array([0]))
    with pytest.raises(RuntimeError, match="no side-pool slot"):
        u.assign(["y", "w"], np.array([9, 3]))


class HostReadGuard(torch.Tensor):
    """A tensor whose host reads (``.cpu()``, ``.numpy()``, ``.tolist()``, ``.item()``, ``int()``, ...) raise
    while ``armed``: on a GPU each would copy the device tensor to the host and wait for the stream."""

    armed = False
    HOST = {"cpu", "numpy", "tolist", "item", "__int__", "__index__", "__float__", "__bool__", "__array__"}

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(str(a) == "cpu" for a in list(args[1:]) + list(kwargs.values()))
        if cls.armed and (name in cls.HOST or to_host):
            raise AssertionError(f"a host read of the block table: Tensor.{name}")
        return super().__torch_function__(func, types, args, kwargs)


def test_row_keys_from_the_runner_without_reading_the_block_table():
    pytest.importorskip("vllm.v1.attention.backend")
    from rotkv.integrations.vllm.backend import row_keys
    from rotkv.integrations.vllm.runner import STEP

    table = torch.tensor([[7, 8], [3, 4], [0, 0]], dtype=torch.int32).as_subclass(HostReadGuard)
    n = np.array([1, 5, 0])  # the last row: vLLM's padding row of a full graph
    HostReadGuard.armed = True
    try:
        with STEP.scope("step"):
            STEP.set_keys(["a", "b"])
            assert row_keys(table, n) == ["a", "b", None]
            STEP.set_keys(["a", "b", "c", "d"])  # more requests than metadata rows: vLLM's micro-batches
            with pytest.raises(RuntimeError, match="enable-dbo"):
                row_keys(table, n)
            with STEP.scope("dummy"):  # a dummy run inside a step: no live request
                assert row_keys(table, n) == [None] * 3
            assert STEP.keys == ["a", "b", "c", "d"]
        assert STEP.keys is None and STEP.mode is None
        with STEP.scope("dummy"):
            assert row_keys(table, np.array([1, 1, 1])) == [None] * 3
        with pytest.raises(AssertionError, match="host read"):  # the fallback reads the first blocks
            row_keys(table, n)
    finally:
        HostReadGuard.armed = False
    assert row_keys(table, n) == [7, 3, None]  # the fallback: first block ids, block 0 none


@pytest.mark.parametrize("share", [0.0, 1 / 8])
def test_body_pages_match_rotkv_flush_rule(share):
    """body_pages(L) is rotkv's page count whatever the chunking (PageState flushes the same pages)."""
    from rotkv.cache.plan import PageState

    geo = Geometry(sink=5, window=20, window_share=share, page=P, max_len=4096)
    rng = np.random.default_rng(0)
    for _ in range(3):
        st = PageState(5, 20, P, True, 4096, share)
        st.reset(1)
        total = 0
        for _ in range(30):
            n = int(rng.integers(1, 40))
            st.plan(n, np.array([n]))
            total += n
            assert st.body_count[0] == geo.body_pages(total)


# ---- one layer against rotkv's own cache ---------------------------------------------------------------------
def _rotation(h, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = lambda: torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]  # noqa: E731
    return LayerRotation(R_K=q(), R_V=q(), k_mean=torch.randn(h, d, generator=g) * 0.5)


class VllmSim:
    """A tiny stand-in for vLLM's scheduler side: blocks per request from a shuffled free list (block 0 is the
    null block), the block table, the slot table, and one layer's INT2 body + side pool (+ refine rings)."""

    def __init__(self, spec, rot, h, hq, d, nblocks=64, slots=4, side_dtype=torch.float32, device="cpu", max_len=1024):
        self.geo = Geometry(spec.sink, spec.window, spec.window_share, P, max_len, -(-spec.refine_tokens // P),
                            spec.refine_every)
        self.codecs = make_codecs("token", spec.bits, spec.resolved_group(d), spec.clip_k, spec.clip_v)
        self.layout = BlockLayout.of(h, d, P, *self.codecs)
        self.buf = torch.zeros(nblocks * self.layout.page_bytes(), dtype=torch.uint8, device=device)
        self.body = self.layout.body(self.buf, nblocks)
        pages = (slots + 1) * self.geo.slot_pages
        self.side_k = torch.zeros(pages, h, P, d, dtype=side_dtype, device=device)
        self.side_v = torch.zeros_like(self.side_k)
        self.free = list(np.random.default_rng(1).permutation(np.arange(1, nblocks)))
        self.blocks: dict[str, list[int]] = {}
        self.slots = SlotTable(slots)
        self.refine = slot_rings(spec, self.codecs, self.geo, h, d, slots + 1, device)
        self.rot, self.hq, self.d = rot, hq, d

    def grow(self, reqs, lengths):
        """Blocks for ``lengths`` tokens of every request (from the free list, in batch order)."""
        for r, L in zip(reqs, lengths):
            have = self.blocks.setdefault(r, [])
            while len(have) * P < L:
                have.append(int(self.free.pop()))

    def table(self, reqs, rows=None):
        """vLLM's block table of ``reqs`` (rows beyond them: 0, as vLLM pads a graphed batch), fixed width."""
        table = torch.zeros(rows or len(reqs), 24, dtype=torch.int32)
        for i, r in enumerate(reqs):
            table[i, :len(self.blocks[r])] = torch.tensor(self.blocks[r])
        return table.to(self.buf.device)

    def step(self, reqs, lengths, q, k, v):
        """``reqs``: names in batch order; ``lengths``: tokens after the step; q/k/v: the step's new tokens."""
        self.grow(reqs, lengths)
        table = self.table(reqs)
        cols = table.shape[1]
        qs = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum([x.shape[0] for x in q], out=qs[1:])
        lengths = np.array(lengths)
        computed = lengths - (qs[1:] - qs[:-1])
        slots = self.slots.assign(reqs, computed)  # keyed by request, as the hooked runner names the rows
        plan = plan_step(self.geo, qs, lengths, slots, cols)
        qq, kk, vv = (torch.cat(x) for x in (q, k, v))
        out = torch.zeros_like(qq)
        layer_step(plan, self.geo, qq, kk, vv, self.body, self.side_k, self.side_v, table, self.rot, self.codecs,
                   self.d ** -0.5, out, self.refine)
        return [out[qs[i]:qs[i + 1]] for i in range(len(reqs))], plan


# refine tiers (refine_tokens, refine_values, refine_every) as oscar-refine's: keys; keys and values with a size
# rule; rings of 2 and 3 pages, which the requests' bodies (up to 7 pages) wrap
REFINES = [(32, False, 0), (48, True, 2), (32, True, 0)]


def _check_rings(sim, refs, lens, at_least=2):
    """The refine bits of every request's refined pages equal rotkv's (its ring slot ``i % K`` there and here)."""
    from rotkv.cache.refine import newest_pages

    checked = 0
    for r, layer in refs.items():
        (theirs,) = layer.pools.tiers
        nb = sim.geo.body_pages(lens[r])
        _, idx = newest_pages(np.array([nb]), sim.geo.refine_pages, sim.geo.refine_every)
        slot = sim.slots._of[r]
        assert len(theirs.rings) == len(sim.refine.rings)
        checked += len(idx) > 0
        for mine, ring in zip(sim.refine.rings, theirs.rings):
            assert torch.equal(mine.data[slot, idx % mine.pages], ring.data[0, idx % ring.pages]), r
            assert not len(idx) or mine.data[slot, idx % mine.pages].any()
    assert checked >= at_least


@pytest.mark.parametrize("sink,window,share,refine", [(4, 16, 0.0, None), (16, 32, 0.0, None), (0, 20, 1 / 16, None),
                                                      (4, 16, 0.0, REFINES[0]), (0, 20, 1 / 16, REFINES[1]),
                                                      (16, 32, 0.0, REFINES[2])])
def test_layer_step_matches_rotkv_cache_on_mixed_batches(sink, window, share, refine):
    """Requests arriving at different steps, chunked prefills next to decodes, window flushes, a long prompt
    flushed at once: every output of the vLLM-style step equals rotkv's own paged cache (one HybridLayer per
    request), and the INT2 bytes in the vLLM blocks (and the refine bits in the slots' rings) equal rotkv's."""
    from rotkv.cache.layer import HybridLayer

    h, hq, d = 2, 4, 32
    rt, rv, re = refine or (0, False, 0)
    spec = CacheSpec(bits=2, group_size=32, sink=sink, window=window, window_share=share, page_size=P,
                     tier_dtype="float32", rotation="identity", clip_k=0.96, clip_v=0.92, refine_tokens=rt,
                     refine_values=rv, refine_every=re)
    rot = _rotation(h, d, 0)
    sim = VllmSim(spec, rot, h, hq, d)
    refs = {}
    gen = torch.Generator().manual_seed(0)
    # (request, new tokens) per step: A prefills in two chunks, B joins, C is a one-token prompt, all decode
    steps = [[("A", 40)], [("A", 37), ("B", 1)], [("A", 1), ("B", 50)], [("C", 1), ("A", 1), ("B", 1)]]
    steps += [[("A", 1), ("B", 1), ("C", 1)]] * 20 + [[("B", 1), ("C", 30)], [("C", 1), ("B", 1)]]
    # D's prompt flushes 5 to 7 pages at once (more than a refine ring holds); A's chunk reads a wrapped ring
    steps += [[("D", 120), ("A", 1)], [("A", 25), ("D", 1)]] + [[("D", 1), ("A", 1)]] * 3
    lens: dict[str, int] = {}
    for step in steps:
        names = [r for r, _ in step]
        q = [torch.randn(n, hq, d, generator=gen) for _, n in step]
        k = [torch.randn(n, h, d, generator=gen) * 2 + 0.5 for _, n in step]
        v = [torch.randn(n, h, d, generator=gen) for _, n in step]
        for r, n in step:
            lens[r] = lens.get(r, 0) + n
        outs, _ = sim.step(names, [lens[r] for r in names], q, k, v)
        for i, r in enumerate(names):
            if r not in refs:
                refs[r] = HybridLayer(spec, rot, d, h, 0, sim.codecs)
            layer = refs[r]
            layer.update(k[i].transpose(0, 1)[None], v[i].transpose(0, 1)[None])
            want = layer.attend(q[i].transpose(0, 1)[None], None, d ** -0.5)[0]  # [n, Hq, D]
            torch.testing.assert_close(outs[i], want, atol=2e-5, rtol=1e-4)
    assert all(sim.geo.body_pages(lens[r]) >= 1 for r in "AB")  # pages were flushed
    for r, layer in refs.items():  # the body bytes: vLLM block ceil(S/P) + i is rotkv's body page i
        nb = int(layer.state.body_count[0])
        assert nb == sim.geo.body_pages(lens[r])
        theirs = layer.state.body_pages[0, :nb]
        mine = torch.tensor(sim.blocks[r][sim.geo.block_offset:sim.geo.block_offset + nb], dtype=torch.long)
        for side, part in enumerate(sim.body.parts):
            for name, t in zip(("codes", "scale", "lo"), part.tensors):
                assert torch.equal(t[mine], layer.pools.body[side][name][theirs]), (r, side, name)
    if refine:
        assert max(sim.geo.body_pages(n) for n in lens.values()) > sim.geo.refine_pages  # the rings wrapped
        _check_rings(sim, refs, lens)
    else:
        assert sim.refine is None


@pytest.mark.parametrize("refine", [None, REFINES[1]])
def test_merged_prefill_path_matches_rotkv_cache(monkeypatch, refine):
    """The CUDA prefill's arithmetic (history and own tokens apart, merged by log-sum-exp), run on the CPU."""
    from rotkv.integrations.vllm import attention

    monkeypatch.setattr(attention, "MERGED_PREFILL", True)
    test_layer_step_matches_rotkv_cache_on_mixed_batches(4, 16, 0.0, refine)


# a step of several prefill rows over bodies of 3, 4, 5, 11 and 17 pages, a first chunk and a decode row beside
# them; at 8 KV heads of 128 dims in float32 a body page's K and V take 128 KiB: ROTKV_PREFILL_HISTORY_MB=1 reads 8
# pages a launch, so rows F and H share a launch, C has one of its own, B is read in 2 page ranges and A in 3 (its
# refined pages in two of them: 15 and 16 with a refine tier of 2 pages, 14 to 16 with 3)
PREFILL_ROWS_STEPS = [[("E", 30), ("F", 70), ("H", 90), ("C", 100), ("B", 200), ("A", 300)],
                      [("F", 20), ("H", 9), ("C", 30), ("B", 25), ("A", 40), ("D", 50), ("E", 1)],
                      [("A", 1), ("B", 1), ("C", 1), ("D", 1), ("E", 1), ("F", 1), ("H", 1)]]


def _prefill_rows_run(spec, rot, data, h, hq, d, budget):
    """PREFILL_ROWS_STEPS (``data``: each step's q, k, v) through one VllmSim layer under ``budget`` MiB of
    ``ROTKV_PREFILL_HISTORY_MB`` (None: the default): (every step's outputs, the launches the prefill step took,
    the key lengths attended at once in the merged prefill but the own tokens', the sim, the lengths)."""
    from rotkv import switches
    from rotkv.cache import layer as cache_layer
    from rotkv.integrations.vllm import attention

    lse, history_launches, keys, launches = cache_layer.attention_lse, attention.history_launches, [], []

    def attention_lse(q, k, v, causal, scale):
        if not causal:
            keys.append(k.shape[2])
        return lse(q, k, v, causal, scale)
    sim = VllmSim(spec, rot, h, hq, d, nblocks=128, slots=8)
    lens, outs = {}, []
    cache_layer.attention_lse = attention_lse
    attention.history_launches = lambda *a: launches.append(history_launches(*a)) or launches[-1]
    try:
        with switches.override(**({"prefill_history_mb": budget} if budget else {})):
            for step, (q, k, v) in zip(PREFILL_ROWS_STEPS, data):
                for r, n in step:
                    lens[r] = lens.get(r, 0) + n
                outs.append(sim.step([r for r, _ in step], [lens[r] for r, _ in step], q, k, v)[0])
    finally:
        cache_layer.attention_lse, attention.history_launches = lse, history_launches
    assert len(launches) == 1  # the one step whose prefill rows have a body
    return outs, launches[0], keys, sim, lens


def _prefill_rows_check(refine, merged: bool, kernel: bool = False):
    """The steps of PREFILL_ROWS_STEPS with ROTKV_PREFILL_HISTORY_MB=1 (the prefill rows' body read in several
    launches: groups of whole rows, and page ranges of one row) give the outputs of the default budget (one launch
    for every row) and of rotkv's own cache, with the reference prefill or the merged one (``merged``: every
    history piece attended apart and merged by log-sum-exp, as on CUDA, none longer than a launch's page range);
    ``kernel``: the body dequantized by rotkv's Triton dequantizer (run under TRITON_INTERPRET=1 by the test
    below; the caller restores ``MERGED_PREFILL``)."""
    from rotkv.cache.layer import HybridLayer
    from rotkv.integrations.vllm import attention

    attention.MERGED_PREFILL = merged
    launched = []
    if kernel:
        attention.dequant_kernel_reads = lambda body, t: True
        dequant_launch = attention.dequant_launch
        attention.dequant_launch = lambda *a: launched.append(a[1]) or dequant_launch(*a)
    h, hq, d = 8, 16, 128
    rt, rv, re = refine or (0, False, 0)
    spec = CacheSpec(bits=2, group_size=32, sink=4, window=16, page_size=P, tier_dtype="float32",
                     rotation="identity", clip_k=0.96, clip_v=0.92, refine_tokens=rt, refine_values=rv,
                     refine_every=re)
    rot = _rotation(h, d, 5)
    gen = torch.Generator().manual_seed(5)
    data = [[[torch.randn(n, m, d, generator=gen) * (2 if m == h else 1) for _, n in step] for m in (hq, h, h)]
            for step in PREFILL_ROWS_STEPS]
    want, launches, _, _, _ = _prefill_rows_run(spec, rot, data, h, hq, d, None)
    assert launches == [(0, 5, 0, 17)]
    got, launches, keys, sim, lens = _prefill_rows_run(spec, rot, data, h, hq, d, 1)
    assert launches == [(0, 2, 0, 4), (2, 3, 0, 5), (3, 4, 0, 8), (3, 4, 8, 11), (4, 5, 0, 8), (4, 5, 8, 16),
                        (4, 5, 16, 17)]
    assert (launches[-1] in launched) == kernel
    if merged:  # no history longer than a launch's page range attended at once (no copy of the pieces together)
        assert max(keys) == 8 * P
    for a, b in zip(want, got):  # the small budget's outputs are the default's (the reference's: the same
        for x, y in zip(a, b):  # history; the merged one's: merged in more parts)
            assert torch.equal(x, y) if not merged else torch.allclose(x, y, atol=1e-5, rtol=1e-4)
    refs = {}
    for step, (q, k, v), o in zip(PREFILL_ROWS_STEPS, data, got):  # and rotkv's cache's
        for i, (r, _) in enumerate(step):
            layer = refs.setdefault(r, HybridLayer(spec, rot, d, h, 0, sim.codecs))
            layer.update(k[i].transpose(0, 1)[None], v[i].transpose(0, 1)[None])
            ref = layer.attend(q[i].transpose(0, 1)[None], None, d ** -0.5)[0]
            torch.testing.assert_close(o[i], ref, atol=2e-5, rtol=1e-4)
    if refine:
        _check_rings(sim, refs, lens, at_least=5)
    print("prefill rows ok")


@pytest.mark.parametrize("refine", [None, REFINES[1], REFINES[2]])
@pytest.mark.parametrize("merged", [False, True])
def test_prefill_rows_in_budget_launches_match_rotkv_cache(monkeypatch, refine, merged):
    """Several prefill rows of different body lengths in one step, their body read in launches within a 1 MiB
    ``ROTKV_PREFILL_HISTORY_MB`` (groups of whole rows; a row over it in page ranges; the refined pages added to
    the range that holds them): the outputs of the default budget and of rotkv's own cache."""
    from rotkv.integrations.vllm import attention

    monkeypatch.setattr(attention, "MERGED_PREFILL", merged)
    _prefill_rows_check(refine, merged)


@pytest.mark.parametrize("refine", [{}, {"refine_tokens": 32, "refine_values": True, "refine_every": 2}])
def test_layer_step_bf16_side_pool_matches_rotkv_bf16_tier(refine):
    """With rotkv's default bf16 tier (the side pool in bf16): the same outputs as rotkv's cache (with a
    refine tier too, whose bits are chosen from the bf16 tokens)."""
    from rotkv.cache.layer import HybridLayer

    h, hq, d = 2, 2, 64
    spec = get_preset("quarot-int2", sink=8, window=16, **refine)
    from rotkv.rotations.registry import build_rotations

    rot = build_rotations("hadamard", 1, h, d)[0]
    sim = VllmSim(spec, rot, h, hq, d, side_dtype=torch.bfloat16)
    ref = HybridLayer(spec, rot, d, h, 0, sim.codecs)
    gen = torch.Generator().manual_seed(1)
    total = 0
    for n in [50, 1, 1, 1, 20] + [1] * 20 + [40, 1, 1]:
        q, k, v = (torch.randn(n, m, d, generator=gen) for m in (hq, h, h))
        total += n
        (out,), _ = sim.step(["A"], [total], [q], [k], [v])
        ref.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None])
        want = ref.attend(q.transpose(0, 1)[None], None, d ** -0.5)[0]
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-3)
    assert sim.geo.body_pages(total) > 2
    if refine:
        _check_rings(sim, {"A": ref}, {"A": total}, at_least=1)


@pytest.mark.parametrize("sink,window,share,refine", [(4, 16, 0.0, None), (0, 20, 1 / 16, None), (16, 32, 0.0, None),
                                                      (4, 16, 0.0, REFINES[0]), (0, 20, 1 / 16, REFINES[1])])
def test_graphed_decode_step_equals_the_general_step(sink, window, share, refine):
    """The fixed-buffer decode step (vLLM's full CUDA graphs), with vLLM's padding rows (no token, block table
    0, seq_len 0) after the real rows: the same outputs, side pools, body bytes (and refine rings) as the general
    step, over decode steps that flush pages (one buffer set loaded again every step, as a graph replays it)."""
    _graphed_check(sink, window, share, refine)


def _graphed_check(sink, window, share, refine, d=32, tol=1e-6, steps=72, prompts=(40, 23, 1), max_len=1024,
                   tier_dtype="float32"):
    """:func:`test_graphed_decode_step_equals_the_general_step` (``tol``: the outputs' atol, 10x as rtol;
    ``steps`` decode steps after prompts of ``prompts`` tokens, in a model of ``max_len`` tokens). Returns the
    number of pages the decode steps flushed."""
    from rotkv.integrations.vllm.graph import StaticDecode, is_static_batch, static_plan, static_step

    h, hq = 2, 4
    rt, rv, re = refine or (0, False, 0)
    spec = CacheSpec(bits=2, group_size=d, sink=sink, window=window, window_share=share, page_size=P,
                     tier_dtype=tier_dtype, rotation="identity", clip_k=0.96, clip_v=0.92, refine_tokens=rt,
                     refine_values=rv, refine_every=re)
    rot = _rotation(h, d, 3)
    dt = torch.bfloat16 if tier_dtype == "bfloat16" else torch.float32  # vLLM's bf16 q, k, v beside a bf16 tier
    eager, graphed = (VllmSim(spec, rot, h, hq, d, max_len=max_len, side_dtype=dt) for _ in range(2))
    st = StaticDecode(graphed.geo, rows=6, scratch=graphed.slots.scratch, device="cpu", kv_heads=h, head_dim=d)
    gen = torch.Generator().manual_seed(2)
    lens = dict(zip("ABC", prompts))
    for r, n in lens.items():  # the prompts: the general step in both
        q, k, v = (torch.randn(n, m, d, generator=gen).to(dt) for m in (hq, h, h))
        for sim in (eager, graphed):
            sim.step([r], [n], [q], [k], [v])
    flushed = 0
    for i in range(steps):
        names = ["A", "B", "C"] if i % 7 else ["B", "A"]  # 3 or 2 real rows, then padding to 5 rows
        for r in names:
            lens[r] += 1
        q, k, v = ([torch.randn(1, m, d, generator=gen).to(dt) for _ in names] for m in (hq, h, h))
        want, plan = eager.step(names, [lens[r] for r in names], q, k, v)
        flushed += len(plan.flush_pos)
        b = 5
        qq, kk, vv = (torch.cat(x + [torch.randn(b - len(names), x[0].shape[1], d, generator=gen).to(dt)])
                      for x in (q, k, v))
        graphed.grow(names, [lens[r] for r in names])
        table = graphed.table(names, b)
        n_tok = np.array([1] * len(names) + [0] * (b - len(names)))
        lengths = np.array([lens[r] for r in names] + [0] * (b - len(names)))
        assert is_static_batch(n_tok, qq.shape[0])
        slots = graphed.slots.assign(names + [None] * (b - len(names)), lengths - n_tok)
        st.load(static_plan(graphed.geo, lengths, slots, n_tok, graphed.slots.scratch, table.shape[1]), table)
        out = torch.zeros_like(qq)
        static_step(st, b, qq, kk, vv, graphed.body, graphed.side_k, graphed.side_v, rot, graphed.codecs,
                    d ** -0.5, out, graphed.refine)
        torch.testing.assert_close(out[:len(names)], torch.cat(want), atol=tol, rtol=10 * tol)
        t = st.tables(b)  # the rotation kernel's element offsets of the rows' slots (on the GPU)
        assert t["wrow"].tolist() == (t["wpage"] * graphed.side_k.stride(0) + t["woff"] * graphed.side_k.stride(2)).tolist()
    assert flushed >= min(4, steps // 8)
    if refine:  # the requests' ring rows (the scratch row aside) hold the same bits
        assert max(eager.geo.body_pages(n) for n in lens.values()) > eager.geo.refine_pages  # the rings wrapped
        for mine, theirs in zip(graphed.refine.rings, eager.refine.rings):
            assert theirs.data[:-1].any() and torch.equal(mine.data[:-1], theirs.data[:-1])
    for r in lens:  # the requests' body blocks and their side-pool slots hold the same bytes
        blocks = torch.tensor(eager.blocks[r], dtype=torch.long)
        for mine, theirs in zip(graphed.body.parts, eager.body.parts):
            for a, b_ in zip(mine.tensors, theirs.tensors):
                assert torch.equal(a[blocks], b_[blocks]), r
        s = eager.slots._of[r] * eager.geo.slot_pages
        pages = slice(s, s + eager.geo.slot_pages)
        # (the rotation's GEMM over 5 rows instead of 3 may round the last bit differently)
        torch.testing.assert_close(graphed.side_k[pages], eager.side_k[pages], atol=1e-5, rtol=0)
        torch.testing.assert_close(graphed.side_v[pages], eager.side_v[pages], atol=1e-5, rtol=0)
    return flushed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("refine", [{}, {"refine_tokens": 48, "refine_values": True, "refine_every": 2}])
def test_graphed_decode_step_replays_in_a_cuda_graph(refine):
    """On the GPU, with rotkv's kernels and a bf16 side pool at head_dim 128: the graphed decode step captured
    once in a CUDA graph and replayed over decode steps that flush pages, against the general step run eagerly
    (with a refine tier of keys and values too, whose rings the bodies wrap)."""
    from rotkv.integrations.vllm.graph import StaticDecode, static_plan, static_step
    from rotkv.rotations.registry import build_rotations

    dev, h, hq, d, b = torch.device("cuda"), 8, 32, 128, 4
    spec = get_preset("quarot-int2", sink=16, window=32, **refine)
    rot = build_rotations("hadamard", 1, h, d)[0].to(dev)
    eager, graphed = (VllmSim(spec, rot, h, hq, d, nblocks=128, side_dtype=torch.bfloat16, device=dev)
                      for _ in range(2))
    st = StaticDecode(graphed.geo, rows=b, scratch=graphed.slots.scratch, device=dev, kv_heads=h, head_dim=d)
    gen = torch.Generator(device=dev).manual_seed(5)
    rnd = lambda n, m: torch.randn(n, m, d, generator=gen, device=dev, dtype=torch.bfloat16)  # noqa: E731
    lens = {"A": 300, "B": 170, "C": 45}
    for r, n in lens.items():
        q, k, v = rnd(n, hq), rnd(n, h), rnd(n, h)
        for sim in (eager, graphed):
            sim.step([r], [n], [q], [k], [v])
    names = list(lens)
    qin, kin, vin = rnd(b, hq), rnd(b, h), rnd(b, h)  # the graph's input and output buffers (3 rows + padding)
    out = torch.zeros(b, hq, d, device=dev, dtype=torch.bfloat16)
    graph, flushed = None, 0
    for i in range(40):
        for r in names:
            lens[r] += 1
        q, k, v = ([x[j:j + 1].clone() for j in range(3)] for x in (rnd(b, hq), rnd(b, h), rnd(b, h)))
        want, plan = eager.step(names, [lens[r] for r in names], q, k, v)
        flushed += len(plan.flush_pos)
        graphed.grow(names, [lens[r] for r in names])
        table = graphed.table(names, b)
        n_tok = np.array([1, 1, 1, 0])
        lengths = np.array([lens[r] for r in names] + [0])
        slots = graphed.slots.assign(names + [None], lengths - n_tok)
        st.load(static_plan(graphed.geo, lengths, slots, n_tok, graphed.slots.scratch, table.shape[1]), table)
        for buf, x in zip((qin, kin, vin), (q, k, v)):
            buf[:3].copy_(torch.cat(x))
        run = lambda: static_step(st, b, qin, kin, vin, graphed.body, graphed.side_k, graphed.side_v, rot,  # noqa
                                  graphed.codecs, d ** -0.5, out, graphed.refine)
        if graph is None:  # the first step eagerly (it compiles the kernels), then the capture
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
        else:
            graph.replay()
        torch.testing.assert_close(out[:3].float(), torch.cat(want).float(), atol=3e-2, rtol=3e-2)
    torch.cuda.synchronize()
    assert flushed >= 3
    for r in names:  # the flushed pages: (nearly) the same codes (bf16 rounding may tip a code)
        blocks = torch.tensor(eager.blocks[r][graphed.geo.block_offset:][:graphed.geo.body_pages(lens[r])], device=dev)
        same = (graphed.body.k.codes[blocks] == eager.body.k.codes[blocks]).float().mean().item()
        assert same > 0.99, (r, same)
    if refine:  # the rings wrapped; the requests' ring rows hold (nearly) the same bits
        assert graphed.geo.body_pages(lens["A"]) > graphed.geo.refine_pages
        for mine, theirs in zip(graphed.refine.rings, eager.refine.rings):
            same = (mine.data[:-1] == theirs.data[:-1]).float().mean().item()
            assert theirs.data[:-1].any() and same > 0.99, same


def test_decode_rows_reference_turns_the_output_back():
    """``decode_rows`` on the PyTorch reference (kernels off on the CPU) with ``out_rotation``: the reference's
    output turned back by the split matrix's PyTorch form, written into ``out``."""
    from rotkv.integrations.vllm.attention import decode_rows
    from rotkv.rotations import base

    h, hq, d, b = 2, 4, 32, 3
    gen = torch.Generator().manual_seed(4)
    side_k, side_v = (torch.randn(4, h, P, d, generator=gen) for _ in range(2))
    tier = (torch.tensor([0, 1, 2, 3], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
            torch.tensor([5, 9, 16], dtype=torch.int32))
    qr = torch.randn(b, hq, d, generator=gen)
    a = base.bf16x2_matrix(_rotation(h, d, 5).R_V.transpose(-1, -2))
    plain = decode_rows(qr, None, None, 0, side_k, side_v, tier, 2 * P, 0, d ** -0.5)
    out = torch.empty(b, hq, d, dtype=torch.bfloat16)
    assert decode_rows(qr, None, None, 0, side_k, side_v, tier, 2 * P, 0, d ** -0.5, out=out, out_rotation=a) is out
    want = base._rotate_bf16x2_bmm(plain.to(torch.bfloat16).transpose(0, 1)[None], a, None)[0].transpose(0, 1)
    assert torch.equal(out, want)


def test_static_batch_rule():
    from rotkv.integrations.vllm.graph import is_static_batch

    assert is_static_batch(np.array([1, 1, 0]), 3) and is_static_batch(np.array([1]), 4)
    assert not is_static_batch(np.array([1, 2]), 3)  # a prefill row
    assert not is_static_batch(np.array([1, 0, 1]), 3)  # padding before a real row
    assert not is_static_batch(np.array([1, 1, 0]), 2)  # no call token for the padding row


def test_plan_flush_sources_and_block_positions():
    """A decode step that crosses a page boundary flushes one page, read wholly from the side pool, into the
    request's block ceil(S/P) + i; a prefill's leaving tokens come from the call."""
    geo = Geometry(sink=4, window=16, window_share=0.0, page=P, max_len=256)
    # a decode row at L = 4 + 16 + 16 = 36 tokens: body 0 -> 1 page
    plan = plan_step(geo, np.array([0, 1]), np.array([36]), np.array([0]), 10)
    assert plan.body_before.tolist() == [0] and plan.body_after.tolist() == [1]
    assert plan.flush_pos.tolist() == [geo.block_offset] and len(plan.flush_from_call) == 0
    plan = plan_step(geo, np.array([0, 60]), np.array([60]), np.array([1]), 10)  # a 60-token prompt
    assert plan.body_after.tolist() == [2] and len(plan.flush_from_side) == 0
    assert plan.flush_call_tok.tolist() == list(range(4, 36))
    assert plan.pwrite_tok.tolist() == [0, 1, 2, 3] + list(range(36, 60))


def test_plan_refine_ring_writes():
    """The flush's refine-ring writes: a prompt that flushes more pages than the ring holds writes its K newest
    (rotkv's ring_writes), a decode row its one page, each at its request's slot; decode rows read their slots'
    rings. Without a refine tier every flushed page is listed (and none is written)."""
    from dataclasses import replace

    geo = Geometry(sink=4, window=16, window_share=0.0, page=P, max_len=512, refine_pages=2)
    # row 0: a 120-token prompt (body pages 0..5), row 1: a decode step at 36 tokens (body page 0)
    plan = plan_step(geo, np.array([0, 120, 121]), np.array([120, 36]), np.array([3, 1]), 10)
    assert plan.body_after.tolist() == [6, 1]
    assert plan.rwrite_sel.tolist() == [4, 5, 6]  # the flush: row 0's pages 0..5, then row 1's page 0
    assert plan.rwrite_slot.tolist() == [3, 3, 1] and plan.rwrite_index.tolist() == [4, 5, 0]
    assert plan.dslots.tolist() == [1]
    plan = plan_step(replace(geo, refine_pages=0), np.array([0, 120, 121]), np.array([120, 36]), np.array([3, 1]), 10)
    assert plan.rwrite_sel is None and plan.rwrite_index.tolist() == [0, 1, 2, 3, 4, 5, 0]


def test_plan_device_arrays_are_one_upload_of_the_host_arrays():
    """Every array the layers read on the device equals its host array, dtype included (the step's one packed
    upload); ``dbody_last`` is a page for a decode row with a body and 0 without; ``*_pos`` arrays turn into the
    block ids they point at."""
    from rotkv.integrations.vllm.state import DEVICE_ARRAYS

    geo = Geometry(sink=4, window=16, window_share=0.0, page=P, max_len=512, refine_pages=2)
    # row 0: a 120-token prompt, row 1: a decode step at 36 tokens (a body), row 2: a decode step at 10 (none)
    plan = plan_step(geo, np.array([0, 120, 121, 122]), np.array([120, 37, 10]), np.array([3, 1, 0]), 10)
    assert plan.dbody_last.tolist() == [P, 0] and plan.dbody_last.dtype == np.int32
    table = torch.arange(30, dtype=torch.int32).reshape(3, 10) + 100
    names = [n for n in DEVICE_ARRAYS if getattr(plan, n) is not None]
    for n in names:
        t = plan.device(n, "cpu", table)
        a = getattr(plan, n)
        if n.endswith("_pos"):
            assert t.tolist() == (table.reshape(-1)[torch.from_numpy(a)].tolist() if len(a) else [0])
        else:
            assert t.dtype == torch.from_numpy(a).dtype and t.tolist() == a.tolist(), n
    assert [x.tolist() for x in plan.device("dtier", "cpu")] == [a.tolist() for a in plan.dtier]
    assert [x.dtype for x in plan.device("dtier", "cpu")] == [torch.int32] * 3
    uploads = [k for k in plan.dev if k[0] == "uploaded"]
    assert uploads == [("uploaded", "cpu")]


# ---- imports and registration --------------------------------------------------------------------------------
def test_backend_modules_do_not_import_rotkv_hf():
    code = ("import sys; import rotkv.integrations.vllm as m; import rotkv.integrations.vllm.attention, "
            "rotkv.integrations.vllm.config, rotkv.integrations.vllm.layout, rotkv.integrations.vllm.state, "
            "rotkv.integrations.vllm.tp; "
            "bad = [n for n in sys.modules if n.startswith('rotkv.hf')]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_no_import_path_from_the_backend_to_rotkv_hf():
    """Read from the source (module- and function-level imports, transitively): the backend reaches rotkv's
    cache, kernels, rotations and quantizer, never the transformers glue in rotkv.hf (but for the one edge
    named below)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "import_cycles.py"
    spec = importlib.util.spec_from_file_location("import_cycles", path)
    ic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ic)
    # rotkv.contract's validate_artifact takes a transformers model and imports rotkv.hf inside it; the backend
    # calls check_contract only (checked at run time by the test above)
    model_side = {("rotkv.contract", "rotkv.hf.geometry"), ("rotkv.contract", "rotkv.hf.fingerprint")}
    edges = [e for e in ic.edges(ic.modules()) if e not in model_side]
    start = {a for a, _ in edges if a.startswith("rotkv.integrations.vllm")}
    seen, todo = set(start), list(start)
    while todo:
        m = todo.pop()
        for a, b in edges:
            if a == m and b not in seen:
                seen.add(b)
                todo.append(b)
    assert "rotkv.integrations.vllm.backend" in start and "rotkv.kernels.decode" in seen
    assert not [m for m in seen if m.startswith("rotkv.hf")]


def test_entry_point_is_declared():
    import tomllib
    from pathlib import Path

    py = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert py["project"]["entry-points"]["vllm.general_plugins"]["rotkv"] == "rotkv.integrations.vllm:register"
    assert any(r.startswith("vllm") for r in py["project"]["optional-dependencies"]["vllm"])
    from rotkv.integrations.vllm import register

    assert callable(register)


def test_register_sets_the_custom_backend():
    pytest.importorskip("vllm.v1.attention.backends.registry")
    pytest.importorskip("vllm.config")  # register() imports the backend, which imports vLLM's config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rotkv.integrations.vllm import register

    register()
    assert AttentionBackendEnum.CUSTOM.get_path() == "rotkv.integrations.vllm.backend.RotkvAttentionBackend"
    cls = AttentionBackendEnum.CUSTOM.get_class()
    assert cls.get_name() == "CUSTOM"
    assert cls.get_supported_kernel_block_sizes() == [P]


# ---- the vLLM classes (where vLLM imports; its Python modules load on a CPU machine without its CUDA ops) ------
def _fake_vllm_config(rotkv: dict, layers=1, kv_heads=2, head_dim=64, max_len=512, max_num_seqs=4):
    from types import SimpleNamespace as NS

    mc = NS(hf_text_config=NS(num_hidden_layers=layers), get_total_num_kv_heads=lambda: kv_heads,
            get_head_size=lambda: head_dim, get_num_kv_heads=lambda pc: kv_heads, max_model_len=max_len, model="tiny")
    return NS(cache_config=NS(enable_prefix_caching=False), speculative_config=None,
              scheduler_config=NS(max_num_seqs=max_num_seqs), additional_config={"rotkv": rotkv}, model_config=mc,
              parallel_config=NS(), compilation_config=NS(max_cudagraph_capture_size=max_num_seqs))


def test_vllm_spec_reports_int2_pages_and_shapes_the_kv_tensor():
    """vLLM's own spec machinery sees the INT2 page (its FullAttentionManager runs it), and vLLM's own reshape of
    the raw KV allocation gives the tensor the layout views, without a copy."""
    pytest.importorskip("vllm.v1.attention.backend")
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry
    from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

    from rotkv.integrations.vllm.backend import _SLOT_BYTES, RotkvAttentionBackend, RotkvAttentionSpec

    h, d, n = 2, 64, 9
    layout = BlockLayout.of(h, d, P, *make_codecs("token", 2, 64, 1.0, 1.0))
    spec = RotkvAttentionSpec(block_size=P, num_kv_heads=h, head_size=d, dtype=torch.uint8,
                              rotkv_slot_bytes=layout.slot_bytes())
    assert spec.page_size_bytes == layout.page_bytes() == P * h * 40
    merged = RotkvAttentionSpec.merge([spec, spec])
    assert type(merged) is RotkvAttentionSpec and merged.page_size_bytes == spec.page_size_bytes
    assert KVCacheSpecRegistry.get_manager_class(spec) is FullAttentionManager
    _SLOT_BYTES[(h, d)] = layout.slot_bytes()
    shape = RotkvAttentionBackend.get_kv_cache_shape(n, P, h, d)
    assert RotkvAttentionBackend.get_kv_cache_block_dim(P, h, d) == 0
    raw = torch.zeros(n * spec.page_size_bytes, dtype=torch.int8)
    kv = _reshape_attention_kv_cache(raw, spec, shape, tuple(range(len(shape))), n, None)
    body = layout.body(kv, blocks_in(kv, spec.page_size_bytes))
    assert body.num_pages == n and body.k.codes.data_ptr() == raw.data_ptr()


def _vllm_step(step, lens, blocks, free, cols):
    """vLLM's CommonAttentionMetadata of one step of ``(request, new tokens)`` pairs: grows each request's length
    in ``lens`` and its blocks in ``blocks`` (taken from ``free``); returns (query start offsets, tokens, metadata)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    names = [r for r, _ in step]
    for r, n in step:
        lens[r] = lens.get(r, 0) + n
        have = blocks.setdefault(r, [])
        while len(have) * P < lens[r]:
            have.append(free.pop())
    table = torch.zeros(len(names), cols, dtype=torch.int32)
    for i, r in enumerate(names):
        table[i, :len(blocks[r])] = torch.tensor(blocks[r])
    counts = [n for _, n in step]
    qs = torch.tensor([0] + list(np.cumsum(counts)), dtype=torch.int32)
    seq = torch.tensor([lens[r] for r in names], dtype=torch.int32)
    t = int(qs[-1])
    cm = CommonAttentionMetadata(query_start_loc=qs, query_start_loc_cpu=qs, seq_lens=seq, num_reqs=len(names),
                                 num_actual_tokens=t, max_query_len=max(counts), max_seq_len=int(seq.max()),
                                 block_table_tensor=table, slot_mapping=torch.zeros(t, dtype=torch.int64),
                                 seq_lens_cpu_upper_bound=seq)
    return qs, t, cm


def test_runner_hooks_fit_vllms_runners():
    """The hooks wrap vLLM's own GPUModelRunner classes (V2 and V1), whose steps name their rows where the hooks
    read them: the request ids of the batch exist before the attention metadata is built, dummy runs say so, and
    the scheduler output names finished and preempted requests."""
    pytest.importorskip("vllm.v1.attention.backend")
    import dataclasses
    import inspect

    v2 = pytest.importorskip("vllm.v1.worker.gpu.model_runner")
    v1 = pytest.importorskip("vllm.v1.worker.gpu_model_runner")
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch as InputBatchV2
    from vllm.v1.worker.gpu_input_batch import InputBatch as InputBatchV1

    from rotkv.integrations.vllm.runner import RUNNERS, install_runner_hooks

    assert sorted(install_runner_hooks()) == sorted(RUNNERS)
    for mod in (v1, v2):
        for name, _ in RUNNERS[mod.__name__]:
            fn = getattr(mod.GPUModelRunner, name)
            assert fn._rotkv_rows and inspect.unwrap(fn) is not fn, name
    hooked = {(m, n): getattr(m.GPUModelRunner, n) for m in (v1, v2) for n, _ in RUNNERS[m.__name__]}
    install_runner_hooks()  # wraps once only
    assert all(getattr(m.GPUModelRunner, n) is fn for (m, n), fn in hooked.items())

    def src(cls, name):
        return inspect.getsource(inspect.unwrap(getattr(cls, name)))

    params = inspect.signature(inspect.unwrap(v2.GPUModelRunner.execute_model)).parameters
    assert "scheduler_output" in params and "dummy_run" in params
    assert "scheduler_output" in inspect.signature(inspect.unwrap(v1.GPUModelRunner.execute_model)).parameters
    body = src(v2.GPUModelRunner, "execute_model")
    assert -1 < body.index("self.prepare_inputs(") < body.index("self.model_state.prepare_attn(")
    assert "dummy_run=True" in src(v2.GPUModelRunner, "_dummy_run")
    body = src(v1.GPUModelRunner, "execute_model")
    assert -1 < body.index("self._prepare_inputs(") < body.index("self._build_attention_metadata(")
    assert {"req_ids", "num_reqs"} <= {f.name for f in dataclasses.fields(InputBatchV2)}
    assert isinstance(InputBatchV1.req_ids, property) and isinstance(InputBatchV1.num_reqs, property)
    assert {"finished_req_ids", "preempted_req_ids"} <= {f.name for f in dataclasses.fields(SchedulerOutput)}


class FakeRunnerV2:
    """vLLM's V2 model runner as far as the hooks see it: ``execute_model`` orders the step's rows
    (``prepare_inputs``: an InputBatch with the rows' request ids; ids past ``num_reqs`` are stale) and builds the
    attention metadata; ``_dummy_run`` calls ``execute_model(..., dummy_run=True)``."""

    def __init__(self, build):
        self.build = build

    def execute_model(self, scheduler_output, intermediate_tensors=None, dummy_run=False, skip_attn_for_dummy_run=False,
                      is_profile=False):
        if not dummy_run:
            self.prepare_inputs(scheduler_output, None)
        return self.build(scheduler_output.cm)

    def prepare_inputs(self, scheduler_output, batch_desc):
        from types import SimpleNamespace as NS

        return NS(req_ids=scheduler_output.rows + ["stale"], num_reqs=len(scheduler_output.rows))

    def _dummy_run(self, cm):
        from types import SimpleNamespace as NS

        return self.execute_model(NS(cm=cm, finished_req_ids=set(), preempted_req_ids=None), dummy_run=True)

    def capture_model(self):
        return None


class FakeRunnerV1(FakeRunnerV2):
    """vLLM's V1 model runner as far as the hooks see it: ``execute_model`` updates its persistent batch (rows
    condensed and ordered, stale ids after them), ``_prepare_inputs``, then the metadata; ``_dummy_run`` builds
    metadata outside ``execute_model``."""

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        from types import SimpleNamespace as NS

        self.input_batch = NS(req_ids=scheduler_output.rows + ["stale"], num_reqs=len(scheduler_output.rows))
        self._prepare_inputs(scheduler_output, None)
        return self.build(scheduler_output.cm)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        return None, None

    def _dummy_run(self, cm):
        return self.build(cm)


def _fake_runner(kind: str, build):
    """A runner of ``kind`` ("v1", "v2") with rotkv's hooks, whose steps build metadata with ``build``."""
    from types import SimpleNamespace as NS

    from rotkv.integrations.vllm.runner import RUNNERS, hook_runner_class

    cls = {"v1": FakeRunnerV1, "v2": FakeRunnerV2}[kind]
    module = {"v1": "vllm.v1.worker.gpu_model_runner", "v2": "vllm.v1.worker.gpu.model_runner"}[kind]
    assert hook_runner_class(cls, RUNNERS[module])
    runner = cls(build)

    def step(rows, finished, cm):
        return runner.execute_model(NS(rows=rows, cm=cm, finished_req_ids=finished, preempted_req_ids=None))
    return runner, step


@pytest.mark.parametrize("runner", ["v2", "v1", "fallback"])
@pytest.mark.parametrize("refine", [{}, {"refine_tokens": 16, "refine_values": True, "refine_every": 2}])
def test_vllm_builder_and_impl_match_rotkv_cache(monkeypatch, refine, runner):
    """vLLM's metadata (CommonAttentionMetadata) through rotkv's builder and impl: a profiling call, then mixed
    steps of three requests in a shuffled row order every step (one starting after another finished, a second
    prefill chunk); every output equals rotkv's own cache (with a refine tier of keys and values: a one-page ring
    per slot, which A's body wraps). The slots are keyed by the request ids of a hooked model runner (V2 and V1
    as the hooks see them), with no host read of the block table (its host reads raise), and a dummy run whose
    rows carry a live request's blocks leaves the live slots alone; or, with no hooked runner, by the requests'
    first block ids read from the device (the fallback)."""
    pytest.importorskip("vllm.v1.attention.backend")
    from dataclasses import replace
    from types import SimpleNamespace as NS

    from rotkv.cache.layer import HybridLayer
    from rotkv.integrations.vllm import backend as be
    from rotkv.rotations.registry import build_rotations

    h, hq, d, nblocks = 2, 4, 64, 40
    cfg = _fake_vllm_config({"preset": "quarot-int2", "sink": 4, "window": 16, "spare_slots": 1, **refine})
    monkeypatch.setattr(be, "get_current_vllm_config", lambda: cfg)
    monkeypatch.setattr(be, "_SLOT_TABLES", {})  # the process's slot table, fresh for this engine
    mp = be.model_plan(cfg)
    spec = be.RotkvAttentionSpec(block_size=P, num_kv_heads=h, head_size=d, dtype=torch.uint8,
                                 rotkv_slot_bytes=mp.slot_bytes)
    builder = be.RotkvMetadataBuilder(spec, ["model.layers.0.self_attn.attn"], cfg, torch.device("cpu"))
    impl = be.RotkvAttentionImpl(hq, d, d ** -0.5, h)

    def no_config():  # as vLLM outside set_current_vllm_config: its forwards, the profiling one included
        raise AssertionError("Current vLLM config is not set")

    monkeypatch.setattr(be, "get_current_vllm_config", no_config)
    layer = NS(layer_name="model.layers.0.self_attn.attn")
    out = torch.ones(3, hq, d)
    impl.forward(layer, torch.randn(3, hq, d), torch.randn(3, h, d), torch.randn(3, h, d), torch.empty(0), None, out)
    assert not out.any()  # the profiling run: zeros, and the side pool exists from now on
    assert impl._layer["side"][0].shape == ((4 + 1 + 1) * mp.geometry.slot_pages, h, P, d)
    rings = impl._layer["refine"]
    if refine:  # beside the side pool: one ring row per slot, K = ceil(refine_tokens / P) pages
        assert mp.geometry.refine_pages == 1 and len(rings.rings) == 2
        assert all(r.data.shape == (4 + 1 + 1, 1, h, P, d // 4) for r in rings.rings)
    else:
        assert rings is None
    kv = torch.zeros(nblocks, spec.page_size_bytes, dtype=torch.uint8)
    rot = build_rotations("hadamard", 1, h, d)[0]
    settings = parse_settings(cfg.additional_config)
    free = list(range(nblocks - 1, 0, -1))
    blocks, lens, refs = {}, {}, {}
    gen = torch.Generator().manual_seed(2)
    steps = [[("A", 30)], [("A", 1), ("B", 25)]] + [[("B", 1), ("A", 1)]] * 20 + [[("A", 1)], [("C", 20), ("A", 1)]]
    steps += [[("A", 20), ("C", 1)], [("A", 1), ("C", 1)]]
    graphed = []
    steps += [[("A", 1), ("C", 1), ("pad", 0)]]  # vLLM's padding row of a full graph: no token, block table 0
    hooked = runner != "fallback"
    if hooked:
        fake, run_step = _fake_runner(runner, lambda cm: builder.build(0, cm))
    rng = np.random.default_rng(5)
    finished = set()
    for si, step in enumerate(steps):
        if step[0][0] == "C":  # B finished: its blocks go back (C may get B's first block), its slot too
            free.extend(blocks.pop("B"))
            finished, b_slot = {"B"}, builder.slots._of.get("B")
        if hooked and si == 5:  # a dummy run whose rows hold A's blocks (vLLM's dummy rows may read stale tables)
            _, _, dm = _vllm_step([("dA", 1), ("dB", 1)], {}, {"dA": blocks["A"][:1], "dB": blocks["A"][:1]}, [],
                                  cols=8)
            before = dict(builder.slots._of)
            dmd = fake._dummy_run(dm)
            assert dict(builder.slots._of) == before and set(dmd.static.dslots[:2].tolist()) == {builder.slots.scratch}
            impl.forward(layer, *(torch.randn(2, m, d, generator=gen) for m in (hq, h, h)), kv, dmd,
                         torch.zeros(2, hq, d))
        real = [x for x in step if x[0] != "pad"]
        step = [real[i] for i in rng.permutation(len(real))] + step[len(real):]  # vLLM orders rows as it likes
        qs, t, cm = _vllm_step(step, lens, blocks, free, cols=8)
        if step[-1][0] == "pad":
            cm.block_table_tensor[-1] = 0
            cm = replace(cm, num_actual_tokens=len(step))
        if not hooked:
            md = builder.build(0, cm)
        else:
            cm = replace(cm, block_table_tensor=cm.block_table_tensor.as_subclass(HostReadGuard))
            HostReadGuard.armed = True
            try:
                md = run_step([r for r, _ in step if r != "pad"], finished, cm)
            finally:
                HostReadGuard.armed = False
            if finished:  # the new request took the finished one's slot
                assert b_slot is not None and builder.slots._of["C"] == b_slot and "B" not in builder.slots._of
            finished = set()
        graphed.append(md.static is not None)
        q, k, v = (torch.randn(t + 2, m, d, generator=gen) for m in (hq, h, h))
        out = torch.full((t + 2, hq, d), 7.0)
        impl.forward(layer, q, k, v, kv, md, out)
        assert not out[cm.num_actual_tokens:].any()  # vLLM's padded tokens
        for i, (r, n) in enumerate(step):
            a = int(qs[i])
            if r == "pad":
                continue
            if r not in refs:
                refs[r] = HybridLayer(settings.spec, rot, d, h, 0, mp.codecs[0])
            refs[r].update(k[a:a + n].transpose(0, 1)[None], v[a:a + n].transpose(0, 1)[None])
            want = refs[r].attend(q[a:a + n].transpose(0, 1)[None], None, d ** -0.5)[0]
            # float32 summation order differs across CPUs and torch versions (docs/results/vllm-h200-run4); a
            # misplaced row or slot is off by O(1)
            torch.testing.assert_close(out[a:a + n], want, atol=2e-4, rtol=1e-3)
    assert mp.geometry.body_pages(lens["A"]) >= 3
    # decode batches ran on the graphed step's fixed buffers (with the refine tier too)
    decode = [all(n <= 1 for _, n in step) for step in steps]
    assert graphed == decode and sum(decode) >= 20
    if refine:
        assert rings.keys.data.any() and rings.values.data.any()


def test_vllm_impl_serves_oscar_refine_like_rotkv_cache(monkeypatch, tmp_path):
    """The recommended preset itself, oscar-refine with an oscar-mix-long artifact (layer 0 keeps 4-bit keys: a
    value ring only; layer 1 rings of keys and values; 14 pages, one per 19 body pages), through vLLM's builder
    and impl of both layers, against rotkv's RotkvCache built from the same preset and artifact: a 300-token
    prompt (16 body pages: the rings wrap) chunked, next to decodes of another request."""
    pytest.importorskip("vllm.v1.attention.backend")
    from types import SimpleNamespace as NS

    from rotkv.cache.cache import RotkvCache
    from rotkv.contract import kind_meta
    from rotkv.integrations.vllm import backend as be
    from rotkv_testing import make_tiny_llama, write_artifact

    model = make_tiny_llama()
    widths = {"k_bits": torch.tensor([4, 2], dtype=torch.int32), "k_gain": torch.tensor([0.1, 0.0])}
    path = write_artifact(model, tmp_path / "long.safetensors", tensors=widths, longfit_seq_len="4096",
                          **kind_meta("oscar-mix-long"))
    layers, h, hq, d, nblocks = 2, 2, 4, 16, 48
    cfg = _fake_vllm_config({"artifact": path, "spare_slots": 1}, layers=layers, kv_heads=h, head_dim=d)
    monkeypatch.setattr(be, "get_current_vllm_config", lambda: cfg)
    mp = be.model_plan(cfg)
    assert mp.settings.spec.name == "oscar-refine" and mp.geometry.refine_pages == 14
    spec = be.RotkvAttentionSpec(block_size=P, num_kv_heads=h, head_size=d, dtype=torch.uint8,
                                 rotkv_slot_bytes=mp.slot_bytes)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    builder = be.RotkvMetadataBuilder(spec, names, cfg, torch.device("cpu"))
    impls = [be.RotkvAttentionImpl(hq, d, d ** -0.5, h) for _ in range(layers)]
    mods = [NS(layer_name=n) for n in names]
    for impl, mod in zip(impls, mods):  # the profiling run
        impl.forward(mod, torch.randn(3, hq, d), torch.randn(3, h, d), torch.randn(3, h, d), torch.empty(0), None,
                     torch.zeros(3, hq, d))
    rings = [impl._layer["refine"] for impl in impls]
    assert (rings[0].keys, rings[1].keys is not None, rings[0].values is not None) == (None, True, True)
    kvs = [torch.zeros(nblocks, spec.page_size_bytes, dtype=torch.uint8) for _ in range(layers)]
    free = list(range(nblocks - 1, 0, -1))
    blocks, lens, refs = {}, {}, {}
    gen = torch.Generator().manual_seed(4)
    steps = [[("A", 200)], [("A", 100), ("B", 20)]] + [[("B", 1), ("A", 1)]] * 3 + [[("A", 1), ("B", 40)]]
    for step in steps:
        qs, t, cm = _vllm_step(step, lens, blocks, free, cols=24)
        md = builder.build(0, cm)
        for li, (impl, mod, kv) in enumerate(zip(impls, mods, kvs)):
            q, k, v = (torch.randn(t, m, d, generator=gen) for m in (hq, h, h))
            out = torch.zeros(t, hq, d)
            impl.forward(mod, q, k, v, kv, md, out)
            for i, (r, n) in enumerate(step):
                a = int(qs[i])
                if r not in refs:
                    refs[r] = RotkvCache(model, "oscar-refine", path, context_length=cfg.model_config.max_model_len)
                refs[r].update(k[a:a + n].transpose(0, 1)[None], v[a:a + n].transpose(0, 1)[None], li)
                want = refs[r].layers[li].attend(q[a:a + n].transpose(0, 1)[None], None, d ** -0.5)[0]
                torch.testing.assert_close(out[a:a + n], want, atol=1e-4, rtol=1e-3)
    assert mp.geometry.body_pages(lens["A"]) > 14  # A's ring wrapped
    assert rings[1].keys.data.any() and rings[0].values.data.any()


def _kernel_paths_check(refine=False):
    """The mixed-batch check with rotkv's Triton kernels (decode over the side pool's tier table, the fused write
    into the part views; ``refine``: a refine tier of keys and values, read by the v1 decode kernel from the
    decode rows' rings) in place of their references: run under TRITON_INTERPRET=1 by the test below."""
    from types import SimpleNamespace

    import os

    from rotkv.cache.layer import HybridLayer
    from rotkv.integrations.vllm import attention

    # the kernels for the backend only: rotkv's cache (the reference) keeps its PyTorch path on the CPU
    attention.kernels = SimpleNamespace(enabled=lambda t: True, decode_config=attention.kernels.decode_config)
    import rotkv.kernels.decode as kd

    kernel, refine_calls = kd.decode_attention, []

    def counted(*a, **kw):  # the decode calls that give the kernel the refine rings
        refine_calls.append(kw.get("refine") is not None or kw.get("refine_values") is not None)
        return kernel(*a, **kw)
    kd.decode_attention = counted

    h, hq, d = 2, 4, 64
    extra = {"refine_tokens": 32, "refine_values": True, "refine_every": 2} if refine else {}
    spec = CacheSpec(bits=2, group_size=64, sink=4, window=16, page_size=P, tier_dtype="float32",
                     rotation="identity", clip_k=0.96, clip_v=0.92, **extra)
    rot = _rotation(h, d, 3)
    sim = VllmSim(spec, rot, h, hq, d)
    gen = torch.Generator().manual_seed(3)
    refs, lens = {}, {}
    steps = [[("A", 40)], [("A", 1), ("B", 30)]] + [[("B", 1), ("A", 1)]] * 8
    if refine:  # A's body grows past the ring (2 pages), B's prompt chunk reads its refined pages
        steps += [[("A", 50), ("B", 1)], [("B", 40), ("A", 1)], [("A", 1), ("B", 1)]]
    else:  # later chunks over a body: the prefill history through the dequant kernel
        steps += [[("A", 30), ("B", 1)], [("B", 20), ("A", 25)], [("A", 1), ("B", 1)]]
    import traceback

    from rotkv.kernels.plan import refine_reason

    reads = []  # the step's reads of tensor values to the host (on a GPU each waits for the stream), outside
    # the Triton interpreter's own (it runs the kernels on host arrays)
    for name in ("item", "__bool__", "tolist", "numpy", "cpu", "__int__", "__index__", "__float__"):
        def read(self, *a, _orig=getattr(torch.Tensor, name), _name=name, **kw):
            if reads and reads[0] == "on":
                stack = traceback.extract_stack()[:-1]
                if not any(f"{os.sep}triton{os.sep}" in fr.filename for fr in stack):
                    reads.append(f"{_name} at {stack[-1].filename}:{stack[-1].lineno}")
            return _orig(self, *a, **kw)
        setattr(torch.Tensor, name, read)
    for step in steps:
        names = [r for r, _ in step]
        q, k, v = ([torch.randn(n, m, d, generator=gen) for _, n in step] for m in (hq, h, h))
        for r, n in step:
            lens[r] = lens.get(r, 0) + n
        reads[:] = ["on"]
        outs, _ = sim.step(names, [lens[r] for r in names], q, k, v)  # the vLLM step, with the kernels
        # (where no kernel reads the refine tier, refine_kernel=0, the decode takes the PyTorch reference path)
        assert reads == ["on"] or (refine and refine_reason()), f"host reads of tensors in the step: {reads[1:]}"
        reads[:] = []
        for i, r in enumerate(names):
            layer = refs.setdefault(r, HybridLayer(spec, rot, d, h, 0, sim.codecs))
            layer.update(k[i].transpose(0, 1)[None], v[i].transpose(0, 1)[None])
            want = layer.attend(q[i].transpose(0, 1)[None], None, d ** -0.5)[0]
            torch.testing.assert_close(outs[i], want, atol=3e-2, rtol=3e-2)  # the interpreter's fp16 dots
    assert sim.geo.body_pages(lens["A"]) >= 1 and sim.geo.body_pages(lens["B"]) >= 1  # both flushed
    if refine:
        assert sim.geo.body_pages(lens["A"]) > sim.geo.refine_pages
        _check_rings(sim, refs, lens)
    print(f"kernel paths ok, {sum(refine_calls)} refine kernel calls")


def _prefill_dequant_check(device="cpu"):
    """The prefill rows' body dequantized by rotkv's Triton dequantizer in the launches of ``history_launches``
    (over vLLM's block table) equals the PyTorch reference's, per row and page range, for 2-bit keys and values
    and 4-bit keys, in float32 and bf16: with the default ``ROTKV_PREFILL_HISTORY_MB`` one launch for every
    prefill row; with 1 MiB groups of whole rows (the plan's table sliced at the group's rows) and the rows
    over it in page ranges. Run under TRITON_INTERPRET=1 by the test below (on the CPU, the kernels forced on),
    or on a GPU (``device`` "cuda")."""
    from types import SimpleNamespace

    from rotkv import switches
    from rotkv.integrations.vllm import attention

    if device == "cpu":
        from rotkv.kernels import plan as kernel_plan

        attention.kernels = SimpleNamespace(enabled=lambda t: True, decode_config=attention.kernels.decode_config)
        kernel_plan.kernels_enabled = lambda t: True  # plan_pools' rule, as the GPU takes it
    h, d, nblocks, cols = 8, 128, 160, 24
    gen = torch.Generator().manual_seed(6)
    geo = Geometry(sink=4, window=16, window_share=0.0, page=P, max_len=512)
    # rows: a chunk over 330 tokens (19 body pages), a decode row, a first chunk (no history), chunks over 70,
    # 90 and 200 tokens (3, 4 and 11 pages)
    qs, lens = np.array([0, 20, 21, 29, 34, 40, 47]), np.array([350, 50, 8, 75, 96, 207])
    plan = plan_step(geo, qs, lens, np.arange(6), cols)
    pages = plan.body_before[plan.prefill_rows]
    assert plan.prefill_rows.tolist() == [0, 2, 3, 4, 5] and pages.tolist() == [19, 0, 3, 4, 11]
    table = torch.randperm(nblocks - 1, generator=gen)[:6 * cols].add(1).reshape(6, cols).to(torch.int32).to(device)
    side = [torch.randn(7 * geo.slot_pages, h, P, d, generator=gen).to(device) for _ in range(2)]
    for key_bits in (2, 4):
        layout = BlockLayout.of(h, d, P, *make_codecs("token", 2, 32, 1.0, 1.0, key_bits=key_bits))
        body = layout.body(torch.randint(0, 256, (nblocks * layout.page_bytes(),), generator=gen, dtype=torch.uint8)
                           .to(device), nblocks)
        for part in body.parts:  # finite metadata
            part.scale.copy_(torch.rand(part.scale.shape, generator=gen) * 0.5)
            part.lo.copy_(torch.randn(part.lo.shape, generator=gen))
        assert attention.dequant_kernel_reads(body, body.k.codes)
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
            page_bytes = 2 * h * P * d * torch.empty(0, dtype=dtype).element_size()
            for budget in (None, 1):
                launches = attention.history_launches(pages, page_bytes, budget)
                if budget is None:
                    assert launches == [(0, 5, 0, 19)]
                else:  # 1 MiB: 8 float32 pages, 16 bf16 pages; rows 2 and 3 (3 and 4 pages) in one group
                    cap = (1 << 20) // page_bytes
                    assert (2, 4, 0, 4) in launches and any(j0 > 0 for _, _, j0, _ in launches)
                    assert all((i1 - i0) * (j1 - j0) <= cap for i0, i1, j0, j1 in launches)
                read = {i: [] for i in range(5)}
                for launch in launches:
                    i0, i1, j0, j1 = launch
                    bufs = attention.dequant_launch(plan, launch, body, table, dtype)
                    assert bufs[0].shape == (i1 - i0, h, (j1 - j0) * P, d) and bufs[0].dtype == dtype
                    for i in range(i0, i1):
                        e = min(int(pages[i]), j1)
                        if e <= j0:
                            continue
                        read[i].append((j0, e))
                        got = attention.body_piece(plan, i, j0, e, body, table, geo, dtype, bufs, i - i0)
                        want = attention.body_piece(plan, i, j0, e, body, table, geo, dtype)
                        for x, y in zip(got, want):
                            assert x.shape == (h, (e - j0) * P, d)
                            torch.testing.assert_close(x, y, atol=tol, rtol=tol)
                for i, n in enumerate(pages.tolist()):  # every body page read once, in order
                    assert [j for r in read[i] for j in range(*r)] == list(range(n))
    with switches.override(prefill_history_mb=1):  # the switch is the default budget
        fp32_page = 2 * h * P * d * 4
        assert attention.history_launches(pages, fp32_page) == attention.history_launches(pages, fp32_page, 1)
    print("prefill dequant ok")


def _graphed_kernel_check(refine=False, fused=False):
    """The graphed decode step against the general one with rotkv's Triton kernels in both (decode over the
    fixed tables with the grid of ``max_len``, the refine kernel reading the gathered rings, the fused write into
    the slots of one page per row): run under TRITON_INTERPRET=1 by the test below."""
    from types import SimpleNamespace

    from rotkv.integrations.vllm import attention

    attention.kernels = SimpleNamespace(enabled=lambda t: True, decode_config=attention.kernels.decode_config)
    tier = "float32"
    if fused:  # bf16 tiers in the GPU's bf16x2 rotation arithmetic: q, k and v rotated in one launch, the outputs
        # turned back inside the merge, keys and values (and their refine bits) flushed in one launch
        from rotkv import switches
        from rotkv.kernels import plan
        from rotkv.rotations import base

        switches.configure(rotation_math="bf16x2")
        base.plan_rotate = lambda x, a: plan.rotate_reason(x, a) is None
        calls = {}
        for mod, name in ((base.LayerRotation, "rotate_many_into"), (attention, "flush_into_body")):
            def counted(*a, _f=getattr(mod, name), _n=name, **k):
                got = _f(*a, **k)
                calls[_n] = calls.get(_n, 0) + bool(got)
                return got
            setattr(mod, name, counted)
        from rotkv.integrations.vllm import graph
        graph.flush_into_body = attention.flush_into_body
        tier = "bfloat16"
    # 8 steps (two of them of 2 rows): A flushes a page at step 4 (100 tokens, its body past the refine ring),
    # B and C together at step 6 (36 tokens: two rows in one flush)
    steps = 8
    flushed = _graphed_check(4, 16, 0.0, REFINES[1] if refine else None, d=64, tol=3e-2, steps=steps,
                             prompts=(95, 29, 30), max_len=128, tier_dtype=tier)
    assert flushed == 3, flushed
    if fused:
        assert calls.get("rotate_many_into", 0) >= steps and calls.get("flush_into_body", 0) == steps, calls
    print("graphed kernel paths ok")


def _rotate_into_check():
    """The graphed step's query and output rotations straight into their buffers (``LayerRotation.rotate_into``
    without rows: the rotation kernel writing a strided view) equal the PyTorch bf16x2 rotation, GQA heads, rows
    past ``b`` untouched; a view of another shape, or a side without a matrix, writes nothing. Run under
    TRITON_INTERPRET=1 (the kernel taken as on CUDA) by the test below."""
    from rotkv import switches
    from rotkv.kernels.plan import rotate_reason
    from rotkv.rotations import base

    switches.configure(rotation_math="bf16x2")
    base.plan_rotate = lambda x, a: rotate_reason(x, a) is None  # the kernels "on" for the CPU tensors
    h, hq, d, b, t = 2, 4, 32, 3, 5
    rot = _rotation(h, d, 7)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(t, hq, d, generator=gen).to(torch.bfloat16)  # vLLM's [tokens, heads, D]; rows b.. padding
    qr = torch.empty(b, hq, d, dtype=torch.bfloat16)
    assert rot.rotate_into("queries", q[:b].transpose(0, 1)[None], qr.transpose(0, 1)[None])
    want = base._rotate_bf16x2_bmm(q[:b].transpose(0, 1)[None], *rot._bf16x2("queries"))[0].transpose(0, 1)
    torch.testing.assert_close(qr.float(), want.float(), atol=1e-2, rtol=8e-3)
    out = torch.full((t, hq, d), 7.0, dtype=torch.bfloat16)
    assert rot.rotate_into("outputs", qr.transpose(0, 1)[None], out[:b].transpose(0, 1)[None])
    want = base._rotate_bf16x2_bmm(qr.transpose(0, 1)[None], *rot._bf16x2("outputs"))[0].transpose(0, 1)
    torch.testing.assert_close(out[:b].float(), want.float(), atol=1e-2, rtol=8e-3)
    assert bool((out[b:] == 7).all())
    assert not rot.rotate_into("outputs", qr.transpose(0, 1)[None], out[:b + 1].transpose(0, 1)[None])
    assert bool((out[b:] == 7).all())
    plain = LayerRotation(R_K=rot.R_K, R_V=None, k_mean=None)
    assert not plain.rotate_into("outputs", qr.transpose(0, 1)[None], out[:b].transpose(0, 1)[None])
    # the graphed step's one launch: keys and values into their side-pool slots, queries into the decode buffer
    pool_k, pool_v = (torch.zeros(4, h, 16, d, dtype=torch.bfloat16) for _ in range(2))
    rows = torch.tensor([1, 3, 0]) * pool_k.stride(0) + torch.tensor([5, 0, 15]) * pool_k.stride(2)
    k, v = (torch.randn(t, h, d, generator=gen).to(torch.bfloat16) for _ in range(2))
    qr2 = torch.empty(b, hq, d, dtype=torch.bfloat16)
    jobs = [("keys", k[:b, :, None], pool_k, rows), ("values", v[:b, :, None], pool_v, rows),
            ("queries", q[:b, :, None], qr2[:, :, None], None)]
    assert rot.rotate_many_into(jobs)
    assert torch.equal(qr2, qr)
    for which, x, pool in (("keys", k, pool_k), ("values", v, pool_v)):
        want = base._rotate_bf16x2_bmm(x[:b].transpose(0, 1)[None], *rot._bf16x2(which))[0].transpose(0, 1)
        torch.testing.assert_close(pool[[1, 3, 0], :, [5, 0, 15]].float(), want.float(), atol=1e-2, rtol=8e-3)
    assert pool_k.float().abs().sum() > 0 and int((pool_k != 0).any(-1).sum()) == b * h
    assert not plain.rotate_many_into(jobs[1:])  # no R_V: nothing written, the caller rotates each job itself
    print("rotate into ok")


def _under_interpreter(call: str, marker: str, **env_extra) -> str:
    """Runs ``test_vllm_plugin.<call>`` in a fresh interpreter with ``TRITON_INTERPRET=1`` (Triton reads it at
    import) and returns its stdout, asserting it exited cleanly and printed ``marker``."""
    import os
    from pathlib import Path

    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", **env_extra)
    r = subprocess.run([sys.executable, "-c", f"import test_vllm_plugin as t; t.{call}"], cwd=Path(__file__).parent,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and marker in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def test_graphed_rotations_into_their_buffers_under_the_triton_interpreter():
    _under_interpreter("_rotate_into_check()", "rotate into ok")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the dequant kernel on a GPU")
def test_prefill_dequant_kernel_on_the_gpu():
    _prefill_dequant_check("cuda")


def test_prefill_dequant_kernel_under_the_triton_interpreter():
    _under_interpreter("_prefill_dequant_check()", "prefill dequant ok")


@pytest.mark.parametrize("refine,merged", [(None, False), (REFINES[1], True)])
def test_prefill_rows_in_budget_launches_under_the_triton_interpreter(refine, merged):
    """The check above with the prefill rows' body dequantized by rotkv's Triton dequantizer."""
    _under_interpreter(f"_prefill_rows_check({refine}, {merged}, kernel=True)", "prefill rows ok")


@pytest.mark.parametrize("refine,fused", [(False, False), (True, False), (True, True)])
def test_graphed_step_kernels_under_the_triton_interpreter(refine, fused):
    """``fused``: bf16 tiers, so that the one-launch rotation and the merged output rotation run as well as the
    one-launch flush (which every case runs: with the refine bits where ``refine``); (False, True) adds no path
    the others miss and a minute of interpreter time."""
    _under_interpreter(f"_graphed_kernel_check({refine}, {fused})", "graphed kernel paths ok")


@pytest.mark.parametrize("refine,tuning", [(False, ""), (True, ""), (True, "refine_kernel=0")])
def test_kernel_paths_under_the_triton_interpreter(refine, tuning):
    """``refine_kernel=0``: no kernel reads the refine tier, so its decode calls take the PyTorch path (as in
    rotkv's cache), and the write kernel still runs."""
    out = _under_interpreter(f"_kernel_paths_check({refine})", "kernel paths ok", ROTKV_TUNING=tuning)
    calls = int(out.split("kernel paths ok, ")[1].split()[0])
    assert (calls > 0) == (refine and not tuning), out[-3000:]
