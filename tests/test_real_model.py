"""On the real default model (SmolLM2-135M-Instruct, loaded once per session)."""

import json
import os

import pytest
import torch

from rotkv.cache import RotkvCache
from rotkv.generation import encode_prompt, generate
from rotkv.hf.compat import cache_kwarg

pytestmark = pytest.mark.slow
SMALL = dict(sink=16, window=64, page_size=16)


def eval_ids(tok, n):
    from rotkv.cli.demo import haystack_text

    return tok(haystack_text()[20000:40000], return_tensors="pt").input_ids[:, :n]


@torch.no_grad()
def decode_kl(model, ids, ctx, preset):
    """KL(plain || preset) over teacher-forced decode steps after a chunk-prefilled context."""
    ref = torch.log_softmax(model(input_ids=ids).logits[0, ctx - 1:-1].float(), -1)
    cache = RotkvCache(model, preset, prefill_chunk=128, **SMALL)
    kw = {cache_kwarg(model): cache}
    logits = [model(input_ids=ids[:, :ctx], **kw).logits[0, -1]]
    for t in range(ctx, ids.shape[1] - 1):
        logits.append(model(input_ids=ids[:, t:t + 1], **kw).logits[0, -1])
    lp = torch.log_softmax(torch.stack(logits).float(), -1)
    return (ref.exp() * (ref - lp)).sum(-1).mean().item(), cache.stats()


def test_int2_quality_ordering_and_bits(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    ids = eval_ids(tok, 448)
    kl = {}
    for p in ("bf16", "int4", "naive-int2", "quarot-int2"):
        kl[p], st = decode_kl(model, ids, 384, p)
        if p == "naive-int2":
            assert st["body_bits_per_element"] == pytest.approx(2.5)
    assert kl["bf16"] < 0.01
    assert kl["int4"] < kl["quarot-int2"] < kl["naive-int2"], kl


def test_greedy_and_sampled_generation(smollm2):
    model, tok = smollm2.model, smollm2.tokenizer
    ids = encode_prompt(tok, "What is the capital of France?")
    g = generate(model, tok, ids, RotkvCache(model, "quarot-int2", sink=4, window=8, page_size=4), max_new_tokens=8)
    assert "Paris" in g.text and g.prompt_tokens == ids.shape[1]
    torch.manual_seed(0)
    s = generate(model, tok, ids, RotkvCache(model, "kivi-2"), max_new_tokens=8, do_sample=True, temperature=0.8)
    assert len(s.new_tokens) >= 1


# The batched forward is not bitwise the lone one on the CPU: the GEMMs (the model's and the
# rotation's) block their reductions by the rows they hold and by the thread count, the batched
# attention pads keys to the longest row, and INT2 rounding can turn a last-bit difference into
# another code. At one thread those differences stay at the last bits: measured max |batch - alone|
# over 6 steps, both rows, bf16 0.016 and quarot-int2 0.029 (2026-12-03, torch 2.13.0,
# transformers 5.25.0). At two threads the *lone* run itself moves: quarot-int2 alone at 2 threads
# against alone at 1 thread differs by 1.67 at the first step and picks other greedy tokens (bf16: 0.03-0.07),
# deterministically for each thread count, so INT2 turns the thread count's rounding into a different
# generation. That is not what this test is about (how the cache places a left-padded row), so it runs
# both sides at one thread. Bounds: about 3x and 8x the measured maxima.
BATCH_LOGIT_TOL = 5e-2
INT2_BATCH_LOGIT_TOL = 0.25


@pytest.fixture
def one_thread():
    """torch at one intra-op thread for the test, restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("preset,tol", [("bf16", BATCH_LOGIT_TOL), ("quarot-int2", INT2_BATCH_LOGIT_TOL)])
def test_left_padded_batch_on_the_real_model(smollm2, preset, tol):
    model, tok = smollm2.model, smollm2.tokenizer
    a = eval_ids(tok, 150)[0]
    b = eval_ids(tok, 400)[0, 250:340]
    ids = torch.full((2, 150), tok.pad_token_id)
    mask = torch.zeros(2, 150, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 60:], mask[1, 60:] = b, 1
    gen = dict(max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True,
               pad_token_id=tok.pad_token_id)
    kw = dict(sink=8, window=16, page_size=8, prefill_chunk=64)
    batch = model.generate(input_ids=ids, attention_mask=mask, **gen,
                           **{cache_kwarg(model): RotkvCache(model, preset, **kw)})
    for row, x in ((0, a), (1, b)):
        alone = model.generate(input_ids=x[None], attention_mask=torch.ones(1, len(x), dtype=torch.long), **gen,
                               **{cache_kwarg(model): RotkvCache(model, preset, **kw)})
        assert_same_greedy(batch.sequences[row, 150:].tolist(), [s[row] for s in batch.scores],
                           alone.sequences[0, len(x):].tolist(), [s[0] for s in alone.scores], tol)


def assert_same_greedy(tokens, scores, ref_tokens, ref_scores, tol=BATCH_LOGIT_TOL):
    """Greedy tokens agree with the reference up to the first step where the reference's top-2
    margin is under 2 * tol (a near-tie the bound allows to flip); the logits agree within ``tol``
    at every step up to and including that one (after it the two runs have other prefixes)."""
    for step, (t, r, s, rs) in enumerate(zip(tokens, ref_tokens, scores, ref_scores)):
        diff = (s.float() - rs.float()).abs().max().item()
        assert diff < tol, f"step {step}: logits differ by {diff:.4f} (bound {tol})"
        top = rs.float().topk(2).values
        margin = (top[0] - top[1]).item()
        if margin < 2 * tol:
            return  # a near-tie: either token is a correct greedy choice within the bound
        assert t == r, f"step {step}: token {t} vs {r} with a top-2 margin of {margin:.3f} (> 2 x {tol})"


def test_generate_cli_json(smollm2, monkeypatch, capsys):
    import rotkv.hf.models as models
    from rotkv.cli import main

    monkeypatch.setattr(models, "load_model", lambda *a, **k: smollm2)
    rc = main(["generate", "--preset", "quarot-int2", "--prompt", "Name three colors.", "--max-new-tokens", "6",
               "--sink", "4", "--window", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["prompt_tokens"] > 5 and out["kv_bytes"] < out["kv_bytes_bf16"]
    assert {"text", "bits_per_element", "body_bits_per_element", "decode_tokens_per_s", "artifact_bytes"} <= set(out)
    assert out["kv_bytes"] <= out["resident_bytes"]  # what the process holds: the pools, in whole pages


def test_cli_bad_input_is_one_clear_line(capsys):
    from rotkv.cli import main

    rc = main(["generate", "--preset", "oscar-int2", "--prompt", "x", "--model", "/no/such/model"])
    assert rc == 2 and "not found" in capsys.readouterr().err


@pytest.mark.slow
def test_converted_copy_loads_the_same_model(tmp_path, monkeypatch, setenv):
    """The GGUF file is converted once; the safetensors copy gives the same logits, tokens and chat template."""
    from rotkv.hf.models import converted_dir, load_model, resolve_model_path

    setenv("ROTKV_CACHE_DIR", str(tmp_path))
    first = load_model()  # converts the GGUF file and writes the copy
    path, gguf, _ = resolve_model_path(None)
    assert os.path.exists(os.path.join(converted_dir(path, gguf), "model.safetensors"))
    second = load_model()  # reads the copy
    msg = [{"role": "user", "content": "Name three colors."}]
    ids = first.tokenizer.apply_chat_template(msg, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ids2 = second.tokenizer.apply_chat_template(msg, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    assert torch.equal(ids, ids2) and second.model_id == first.model_id
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
