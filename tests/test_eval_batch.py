"""``rotkv eval --window-batch``: nll windows scored as the rows of one cache give what scoring them one at a time
gives (the figures to float rounding, the measured bytes exactly), on a tiny random Llama, for presets of each
cache kind (bf16 tiers, the INT4/INT2 body, a refine tier, inter-layer key prediction) and a peer."""

import pytest
import torch

from rotkv.eval import nll, peers
from rotkv.eval.config import make_config
from rotkv.eval.methods import Method, nominal_bits
from rotkv.eval.run import run_nll, unit_settings
from rotkv_testing import make_tiny_llama
from test_predict_keys import _artifact

LENGTH, NEW, CHUNK = 96, 12, 40  # a prefill of three chunks, the last one short


@pytest.fixture(scope="module")
def tiny():
    return make_tiny_llama(seed=3, layers=4, kv_heads=2, q_heads=4, head_dim=16)


def _windows(rows, seed=0):
    return torch.randint(4, 128, (rows, LENGTH + NEW), generator=torch.Generator().manual_seed(seed))


def _method(name, tiny, tmp_path, **overrides):
    if name in peers.PEERS:
        return Method(name, "peer", nominal_bits(name))
    artifact = _artifact(tiny, tmp_path / "aqua.safetensors") if name == "oscar-aqua" else None
    return Method(name, "rotkv", nominal_bits(name), overrides=overrides, artifact=artifact)


CASES = [("bf16", {}), ("int4", {"sink": 4, "window": 8}), ("quarot-int2", {"sink": 4, "window": 8}),
         ("quarot-int2", {"sink": 4, "window": 8, "refine_tokens": 32, "refine_values": True, "refine_every": 2}),
         ("oscar-aqua", {}), ("hf-quanto-int4", {})]


@pytest.mark.parametrize("name,overrides", CASES, ids=[f"{n}{'-refine' if o.get('refine_tokens') else ''}"
                                                       for n, o in CASES])
def test_batched_windows_score_as_one_at_a_time(tiny, tmp_path, name, overrides):
    if name in peers.PEERS and peers.unavailable(name):
        pytest.skip(peers.unavailable(name))
    method = _method(name, tiny, tmp_path, **overrides)
    ids = _windows(3)
    refs = [nll.reference(tiny, ids[b:b + 1], LENGTH, NEW) for b in range(3)]
    one = [nll.score_window(tiny, method, ids[b:b + 1], LENGTH, NEW, CHUNK, refs[b]) for b in range(3)]
    pers, mem = nll.score_windows(tiny, method, ids, LENGTH, NEW, CHUNK, refs)
    assert mem == one[0][1]  # one row's bytes and elements
    for b in range(3):
        for k in ("nll", "kl"):
            torch.testing.assert_close(torch.tensor(pers[b][k]), torch.tensor(one[b][0][k]), rtol=2e-3, atol=2e-4)
        # top-1 agrees wherever the reference's top two are apart by more than the rounding
        assert sum(a != c for a, c in zip(pers[b]["top1"], one[b][0]["top1"])) <= 1
    # the rows are not one window repeated: the batched scores follow each row's own tokens
    assert pers[0]["nll"] != pers[1]["nll"]


def test_run_nll_groups_windows_and_keeps_their_order(tiny, tmp_path):
    """Five windows in groups of two (the last alone) give the per-window means of one-at-a-time scoring, in order."""
    method = _method("quarot-int2", tiny, tmp_path, sink=4, window=8)
    ids_all = _windows(1, seed=5).repeat(1, 3)[:, : 3 * (LENGTH + NEW)]
    starts = nll.window_starts(ids_all.shape[1], LENGTH, NEW, 5)
    refs = [(s, nll.reference(tiny, ids_all[:, s:s + LENGTH + NEW], LENGTH, NEW)) for s in starts]
    recs = {}
    for wb in (1, 2):
        cfg = make_config("smoke", new_tokens=NEW, chunk=CHUNK, window_batch=wb)
        recs[wb] = run_nll(tiny, method, ids_all, cfg, LENGTH, refs)[0]
    a, b = recs[1], recs[2]
    assert a["n"] == b["n"] == 5 * NEW and a["windows"] == b["windows"] == 5
    torch.testing.assert_close(torch.tensor(b["per_window"]["kl"]), torch.tensor(a["per_window"]["kl"]),
                               rtol=2e-3, atol=2e-4)
    assert a["kv_bytes"] == b["kv_bytes"] and a["bpe_measured"] == b["bpe_measured"]


def test_window_batch_is_checked_and_cached_apart():
    with pytest.raises(ValueError, match="window_batch"):
        make_config("smoke", window_batch=0)
    unit = ("nll", None, 2048)
    one = unit_settings(make_config("smoke"), unit, "t", "h")
    eight = unit_settings(make_config("smoke", window_batch=8), unit, "t", "h")
    assert "window_batch" not in one  # caches from before the flag keep their fingerprint
    assert eight["window_batch"] == 8


def test_the_cli_names_the_flag(capsys):
    from rotkv.cli import main

    assert main(["eval", "--window-batch", "0", "--out", "/tmp/never"]) == 2
    assert "--window-batch" in capsys.readouterr().err
