"""Properties every architecture must have: step equals parallel, final equals gather, causality, heads, rows of
different lengths in one batch, what calls declare they cost."""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.model.helpers import (
    assert_rows_of_different_lengths_run_as_alone,
    assert_select_split_stack_round_trip,
    counted_flops,
    measured_peak_bytes,
    prefilled_alone,
    stack,
)
from tests.model.tiny_models import ARCHITECTURE_OF, DEVICES, MODEL_IDS, build_tiny

VOCAB, LABELS = 5, 3


def make(model_id: str, num_labels: int = LABELS, dtype: torch.dtype = torch.float64, device: str = "cpu"):
    return build_tiny(model_id, VOCAB, num_labels).to(device=device, dtype=dtype).eval()


@pytest.mark.parametrize("model_id", MODEL_IDS)
@pytest.mark.parametrize("num_labels", [0, LABELS], ids=["lm", "transducer"])
def test_shapes_and_heads(model_id: str, num_labels: int) -> None:
    model = make(model_id, num_labels)
    tokens = torch.randint(0, VOCAB, (3, 11))
    logits = model(tokens)
    assert logits.shape == (3, 11, num_labels or VOCAB)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("model_id", MODEL_IDS)
@pytest.mark.parametrize("length", [1, 2, 9, 30])
def test_step_by_step_equals_parallel(model_id: str, length: int) -> None:
    model = make(model_id, num_labels=0)
    tokens = torch.randint(0, VOCAB, (2, length))
    with torch.no_grad():
        parallel = model(tokens)  # (B, T, V)
        cache = model.new_cache(batch_size=2)
        stepped = torch.stack([model.step(tokens[:, t], cache) for t in range(length)], dim=1)
    assert cache.length == length
    torch.testing.assert_close(stepped, parallel, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_advance_and_step_greedy_are_the_step_without_its_logits(model_id: str) -> None:
    """``advance`` leaves the cache where ``step`` does (the logits after it are the same), and ``step_greedy`` gives
    the first largest of ``step``'s logits and their values (a model that overrides them skips the head's output)."""
    model = make(model_id, num_labels=0)
    tokens = torch.randint(0, VOCAB, (3, 7))
    with torch.no_grad():
        stepped, advanced, greedy = (model.new_cache(batch_size=3) for _ in range(3))
        for t in range(6):
            logits = model.step(tokens[:, t], stepped)
            model.advance(tokens[:, t], advanced)
            picks, values = model.step_greedy(tokens[:, t], greedy)
            assert torch.equal(picks, logits.argmax(-1)) and torch.equal(values, logits.amax(-1))
        last = [model.step(tokens[:, 6], cache) for cache in (stepped, advanced, greedy)]
    assert stepped.length == advanced.length == greedy.length == 7
    assert torch.equal(last[0], last[1]) and torch.equal(last[0], last[2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_prefill_then_step_equals_parallel(model_id: str, device: str) -> None:
    model = make(model_id, num_labels=0, device=device)
    tokens = torch.randint(0, VOCAB, (2, 23)).to(device)
    with torch.no_grad():
        parallel = model(tokens)
        cache = model.new_cache(batch_size=2)
        prefilled = model(tokens[:, :13], cache=cache)
        stepped = torch.stack([model.step(tokens[:, t], cache) for t in range(13, 23)], dim=1)
    assert cache.length == 23
    torch.testing.assert_close(prefilled, parallel[:, :13], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(stepped, parallel[:, 13:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_cache_clone_is_independent(model_id: str) -> None:
    """Stepping a clone and its original alternately, on different tokens, gives each its own sequence."""
    model = make(model_id, num_labels=0)
    first_tokens = torch.randint(0, VOCAB, (1, 14))
    second_tokens = torch.cat([first_tokens[:, :6], torch.randint(0, VOCAB, (1, 8))], dim=1)
    with torch.no_grad():
        expected_first, expected_second = model(first_tokens), model(second_tokens)
        cache = model.new_cache(batch_size=1)
        model(first_tokens[:, :6], cache=cache)
        snapshot = cache.clone()
        first, second = [], []
        for t in range(6, 14):
            first.append(model.step(first_tokens[:, t], cache))
            second.append(model.step(second_tokens[:, t], snapshot))
    assert snapshot.length == cache.length == 14
    assert snapshot.nbytes > 0
    torch.testing.assert_close(torch.stack(first, 1), expected_first[:, 6:], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(torch.stack(second, 1), expected_second[:, 6:], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_final_logits_equal_gathered_parallel_logits(model_id: str, device: str) -> None:
    model = make(model_id, device=device)
    tokens = torch.randint(0, VOCAB, (4, 37)).to(device)
    lengths = torch.tensor([37, 1, 20, 28], device=device)
    with torch.no_grad():
        parallel = model(tokens)
        final = model.final_logits(tokens, lengths)
        final_full = model.final_logits(tokens)
    expected = parallel[torch.arange(4, device=device), lengths - 1]
    torch.testing.assert_close(final, expected, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(final_full, parallel[:, -1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_causal_prefix_outputs_do_not_depend_on_later_tokens(model_id: str) -> None:
    model = make(model_id)
    tokens = torch.randint(0, VOCAB, (2, 26))
    with torch.no_grad():
        full = model(tokens)
        prefix = model(tokens[:, :10])
    torch.testing.assert_close(full[:, :10], prefix, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_gradients_reach_every_parameter(model_id: str) -> None:
    model = make(model_id, dtype=torch.float32).train()
    tokens = torch.randint(0, VOCAB, (2, 17))
    model(tokens).square().mean().backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_bfloat16_runs_close_to_float32(model_id: str, device: str) -> None:
    model = make(model_id, dtype=torch.float32, device=device)
    tokens = torch.randint(0, VOCAB, (2, 19)).to(device)
    with torch.no_grad():
        reference = model(tokens)
        low = model.to(torch.bfloat16)(tokens)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), reference, rtol=0.1, atol=0.1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_rows_of_different_lengths_decode_in_one_batch_as_each_alone(model_id: str, device: str) -> None:
    assert_rows_of_different_lengths_run_as_alone(make(model_id, num_labels=0, device=device), VOCAB)


PADDED = {"transformer", "regulargpt"}
"""The architectures whose caches grow with the length, padded to the longest row when stacked."""


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_select_split_and_stack_round_trip(model_id: str) -> None:
    model = make(model_id, num_labels=0)
    assert_select_split_stack_round_trip(model, VOCAB, padded=ARCHITECTURE_OF[type(model.config)] in PADDED)


CONTEXT_MATTERS = {"transformer": True, "regulargpt": True, "lrnn": False, "diagonal_lrnn": False, "lstm": False}
"""Whether a step's cost depends on the context it continues: attention reads the cache, a recurrence does not."""


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_cost_grows_with_length_and_a_step_reflects_its_context_where_it_matters(model_id: str) -> None:
    model = make(model_id, num_labels=0)
    for path in ("forward", "final", "cached"):
        costs = [model.cost(path, 2, length, context=50) for length in (1, 10, 100, 1000)]
        assert all(0 < a.flops < b.flops and 0 < a.nbytes <= b.nbytes for a, b in itertools.pairwise(costs)), path
    short, long = (model.cost("cached", 1, 1, context) for context in (10, 100_000))
    if CONTEXT_MATTERS[ARCHITECTURE_OF[type(model.config)]]:
        assert long.flops > short.flops and long.nbytes >= short.nbytes
    else:
        assert long == short


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_a_call_of_no_new_tokens_has_a_cost(model_id: str) -> None:
    """The server prefills 0 tokens where a prompt came whole from its state cache: that call's cost is declared,
    as cheap as any, and raises nothing."""
    model = make(model_id, num_labels=0)
    for context in (0, 50, 100_000):
        empty, one = model.cost("cached", 2, 0, context), model.cost("cached", 2, 1, context)
        assert 0 <= empty.flops <= one.flops and 0 <= empty.nbytes <= one.nbytes, context
        assert model.prefill_cost(2, 0, context).flops <= model.prefill_cost(2, 1, context).flops


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_declared_flops_are_the_counted_matrix_products(model_id: str) -> None:
    """Within [1, 1.3] of what torch counts: the declared multiply-adds are its matrix products (plus weights that
    are not in one, such as biases and norms)."""
    model = make(model_id, num_labels=0)
    tokens = torch.randint(0, VOCAB, (2, 100))
    with torch.no_grad():
        cache = model.new_cache(batch_size=2)
        model(torch.randint(0, VOCAB, (2, 200)), cache=cache)
        calls = {
            ("forward", 100, 0): lambda: model(tokens),
            ("final", 100, 0): lambda: model.final_logits(tokens),
            ("cached", 16, 200): lambda: model(tokens[:, :16], cache=cache),
            ("cached", 1, 216): lambda: model.step(tokens[:, 0], cache),
        }
        for (path, length, context), call in calls.items():
            ratio = model.cost(path, 2, length, context).flops / counted_flops(call)
            assert 1 <= ratio <= 1.3, (path, length, context, ratio)


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_an_unscored_prompt_chunk_costs_the_head_on_its_last_positions_only(model_id: str) -> None:
    """``prefill_cost``: where a model selects positions, the pass the server runs for a prompt chunk no one scores
    (its head on each row's last position), within [1, 1.3] of torch's count, and a slice takes a longer chunk of it;
    elsewhere the "cached" call."""
    model = make(model_id, num_labels=0)
    cached, unscored = model.cost("cached", 2, 16, 200), model.prefill_cost(2, 16, 200)
    budget = model.cost("cached", 1, 64).flops
    if not model.selects_positions:
        assert unscored == cached
        assert model.chunk_length(budget, 0, 10_000, scored=False) == model.chunk_length(budget, 0, 10_000)
        return
    assert unscored.flops < cached.flops and unscored.nbytes < cached.nbytes
    assert model.chunk_length(budget, 0, 10_000, scored=False) > model.chunk_length(budget, 0, 10_000) == 64
    tokens = torch.randint(0, VOCAB, (2, 16))
    last = torch.zeros(2, 16, dtype=torch.bool)
    last[:, -1] = True
    with torch.no_grad():
        cache = model.new_cache(batch_size=2)
        model(torch.randint(0, VOCAB, (2, 200)), cache=cache)
        ratio = unscored.flops / counted_flops(lambda: model(tokens, cache=cache, positions=last))
    assert 1 <= ratio <= 1.3, ratio


@pytest.mark.parametrize("model_id", MODEL_IDS)
def test_cache_nbytes_bounds_what_a_row_holds(model_id: str) -> None:
    model = make(model_id, num_labels=0)
    cache = model.new_cache(batch_size=1)
    with torch.no_grad():
        model(torch.randint(0, VOCAB, (1, 7)), cache=cache)
        for length in range(8, 40):
            model.step(torch.randint(0, VOCAB, (1,)), cache)
            assert 0 < cache.nbytes <= model.cache_nbytes(length)


TRANSFORMER_IDS = [model_id for model_id in MODEL_IDS if model_id.startswith("transformer")]
MEASURED_IDS = ["diagonal_lrnn", "lrnn", "lrnn-delta", "lrnn-delta-conv", "lstm", "regulargpt-c2", *TRANSFORMER_IDS]
"""One tiny model per architecture, and every position handling of the transformer (each has its own bias)."""


@pytest.mark.parametrize("model_id", MEASURED_IDS)
def test_declared_nbytes_are_at_least_the_measured_peak(model_id: str) -> None:
    """forward and final_logits of (2, 128) tokens, and a 32-token chunk through a stack of rows of different
    lengths: the declared nbytes bound the measured peak (for the chunk, beside what the cache grew by, which
    :meth:`cache_nbytes` accounts for). Calls this large make the per-position terms dominate."""
    model = make(model_id, num_labels=0)
    tokens = torch.randint(0, VOCAB, (2, 128))
    with torch.no_grad():
        assert measured_peak_bytes(lambda: model(tokens)) <= model.cost("forward", 2, 128).nbytes
        assert measured_peak_bytes(lambda: model.final_logits(tokens)) <= model.cost("final", 2, 128).nbytes
        cache = stack(prefilled_alone(model, [torch.randint(0, VOCAB, (1, n)) for n in (20, 100, 50)]))
        before = cache.nbytes
        peak = measured_peak_bytes(lambda: model(torch.randint(0, VOCAB, (3, 32)), cache=cache))
    assert peak <= model.cost("cached", 3, 32, context=100).nbytes + cache.nbytes - before
