"""The lm-evaluation-harness adapter (rotkv.integrations.lm_eval) on an offline task and a tiny model.

Skipped when lm_eval is not installed (``pip install -e '.[lmeval]'``)."""

import os

import pytest

lm_eval = pytest.importorskip("lm_eval")

from rotkv_testing import save_tiny_llama_dir  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = ["rotkv_tiny_mc", "rotkv_tiny_gen"]
# sink 4 + window 16 with 32-token chunks: each ~190-token context fills the INT2 body
CACHE = "sink=4,window=16,prefill_chunk=32,group_size=16"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import rotkv.integrations.lm_eval  # noqa: F401  (registers model "rotkv")
    from lm_eval.tasks import TaskManager

    model_dir = save_tiny_llama_dir(tmp_path_factory.mktemp("tiny"))
    cwd = os.getcwd()
    os.chdir(ROOT)  # the task's data path is relative to the repository root
    try:
        tm = TaskManager(include_path=os.path.join(ROOT, "tests", "lm_eval_task"))
        runs = {"plain": ("hf", f"pretrained={model_dir},device=cpu,dtype=float32"),
                "bf16": ("rotkv", f"pretrained={model_dir},preset=bf16,{CACHE},device=cpu"),
                "int2": ("rotkv", f"pretrained={model_dir},preset=quarot-int2,{CACHE},device=cpu")}
        out = {}
        for name, (model, args) in runs.items():
            r = lm_eval.simple_evaluate(model=model, model_args=args, tasks=TASKS, task_manager=tm, log_samples=True)
            samples = r["samples"]
            out[name] = {
                "ll": [[resp[0][0] for resp in s["resps"]] for s in samples["rotkv_tiny_mc"]],
                "gen": [s["resps"][0][0] for s in samples["rotkv_tiny_gen"]],
                "acc": r["results"]["rotkv_tiny_mc"]["acc,none"],
            }
    finally:
        os.chdir(cwd)
    return out


def _max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_bf16_scores_equal_the_plain_model(results):
    plain, bf16 = results["plain"], results["bf16"]
    assert len(plain["ll"]) == 12 and all(len(r) == 3 for r in plain["ll"])
    # bf16 tiers vs the fp32 model without a cache: ~4e-4 nats on 3-word continuations
    assert _max_diff(plain["ll"], bf16["ll"]) < 5e-3
    assert bf16["gen"] == plain["gen"]
    assert bf16["acc"] == plain["acc"]


def test_int2_scores_come_from_the_quantized_cache(results):
    plain, int2 = results["plain"], results["int2"]
    assert _max_diff(plain["ll"], int2["ll"]) > 2e-2  # the continuation read an INT2 body
    assert int2["gen"] != plain["gen"]


def test_the_cache_holds_an_int2_body(tmp_path):
    import torch
    from lm_eval.api.instance import Instance

    from rotkv.integrations.lm_eval import RotkvLM

    lm = RotkvLM(pretrained=save_tiny_llama_dir(tmp_path), preset="quarot-int2", sink=4, window=16,
                 prefill_chunk=32, group_size=16, device="cpu")
    ctx = "the cat sat on a mat " * 8
    reqs = [Instance("loglikelihood", {}, (ctx, c), i) for i, c in enumerate([" rain", " hills"])]
    got = lm.loglikelihood(reqs)
    assert len(got) == 2 and all(isinstance(s, float) for s, _ in got)
    stats = lm.last_stats
    assert stats["body_bytes"] > 0 and stats["body_bits_per_element"] == pytest.approx(2 + 32 / 16)
    # the same requests again give the same scores (fresh caches, the shared prefill is copied)
    assert lm.loglikelihood(reqs) == got
    with torch.no_grad():
        assert lm.model(torch.tensor([[104, 105]])).logits.shape[-1] == 128


def test_bad_preset_fails_at_construction(tmp_path):
    from rotkv.integrations.lm_eval import RotkvLM

    with pytest.raises(ValueError, match="preset"):
        RotkvLM(pretrained=save_tiny_llama_dir(tmp_path), preset="int3", device="cpu")
