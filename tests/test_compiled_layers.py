"""rotkv.cache.compiled: the model's layers compiled around rotkv's (disabled) cache calls.

On the CPU with dynamo's ``aot_eager`` backend (the same graph breaks and guards as inductor's, no
code generation): decode steps through the compiled layers give the eager logits (bf16: exactly), every
layer is compiled (the per-layer recompiles stay under the raised limit) and the layers get their
own ``forward`` back. The GPU test (tests/kernels/test_backend.py) runs inductor inside the graph.
"""

import pytest
import torch
from rotkv_testing import make_tiny_llama

from rotkv.cache import make_cache
from rotkv.cache.compiled import compiled_layers, decoder_layers
from rotkv.generation import prefill, reserve


def _decode(model, preset, steps, compiled, rows=2):
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (rows, 70))
    cache = make_cache(model, preset, sink=4, window=16, page_size=8)
    reserve(cache, rows, 70 + steps)
    out = []
    with torch.no_grad():
        tok = prefill(model, ids, cache).argmax(-1)
        pos = torch.full((rows,), 70)
        for _ in range(steps):
            if compiled:
                with compiled_layers(model, backend="aot_eager"):
                    logits = model(input_ids=tok[:, None], position_ids=pos[:, None], use_cache=True,
                                   past_key_values=cache).logits[:, -1]
            else:
                logits = model(input_ids=tok[:, None], position_ids=pos[:, None], use_cache=True,
                               past_key_values=cache).logits[:, -1]
            out.append(logits)
            tok, pos = logits.argmax(-1), pos + 1
    return torch.stack(out)


@pytest.mark.parametrize("preset", ["quarot-int2", "bf16"])
def test_compiled_layers_decode_what_the_eager_layers_do(preset):
    import torch._dynamo

    torch._dynamo.reset()
    model = make_tiny_llama(layers=10)  # more layers than dynamo's default recompile limit (8)
    eager = _decode(model, preset, 20, compiled=False)  # 20 steps: pages flush in between
    from torch._dynamo.utils import counters

    counters.clear()
    compiled = _decode(model, preset, 20, compiled=True)
    if preset == "bf16":
        assert torch.equal(eager, compiled)
    else:  # a last-bit difference in a key can move its INT2 code (seen once on a 16-core host, 3e-4)
        assert (eager - compiled).abs().max() <= 1e-2 * eager.abs().max()
        assert (eager.argmax(-1) == compiled.argmax(-1)).float().mean() > 0.9
    # every layer's attention frame compiled once (its layer_idx is a constant there): none fell back
    said = [k.lower() for group in counters.values() for k in group]
    assert counters["stats"]["unique_graphs"] >= 10
    assert not [k for k in said if "recompile limit" in k or "cache_size_limit" in k or "recompile_limit" in k]
    for layer in decoder_layers(model):
        assert "forward" not in layer.__dict__  # the class's forward is back
    # more batch sizes (each recompiles every layer's attention frame): still compiled, no limit hit,
    # which would raise inside the block
    for rows in (3, 1):
        _decode(model, preset, 2, compiled=True, rows=rows)
    said = [k.lower() for group in counters.values() for k in group]
    assert not [k for k in said if "recompile limit" in k or "cache_size_limit" in k or "recompile_limit" in k]


def test_a_failing_compile_says_to_run_without_it_and_gives_the_layers_back():
    import torch._dynamo

    torch._dynamo.reset()

    def broken(gm, inputs):
        raise NotImplementedError("no code for this graph")

    model = make_tiny_llama()
    cache = make_cache(model, "bf16")
    with pytest.raises(RuntimeError, match="Run without compile_layers") as info:
        with torch.no_grad(), compiled_layers(model, backend=broken):
            model(input_ids=torch.ones(1, 4, dtype=torch.long), use_cache=True, past_key_values=cache)
    assert "no code for this graph" in str(info.value)
    assert all("forward" not in layer.__dict__ for layer in decoder_layers(model))
    torch._dynamo.reset()


def test_compiled_layers_refuse_a_model_without_decoder_layers():
    with pytest.raises(ValueError, match="no decoder layers"):
        with compiled_layers(torch.nn.Linear(2, 2)):
            pass


def test_bench_compile_flag_needs_the_graph():
    from rotkv.bench import parse_method

    assert parse_method("rotkv:quarot-int2+graph+compile") == ("quarot-int2", {"graph", "compile"})
    assert parse_method("rotkv:quarot-int2+compile") is None


def test_generate_batch_compile_layers_needs_the_graph():
    from rotkv.generation import generate_batch

    model = make_tiny_llama()
    cache = make_cache(model, "bf16")
    with pytest.raises(ValueError, match="cuda_graph=True"):
        generate_batch(model, torch.randint(1, 128, (1, 8)), cache, 2, compile_layers=True)
