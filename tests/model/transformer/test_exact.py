"""Exact-transformer architecture: the papers' equations, per-prefix labels, the cache (rows of different lengths),
chunked attention, running in slices, costs, config."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.nn import functional as F

from model.config import CheckpointConfig, ConfigError, ExactTransformerConfig
from model.transformer.exact import ZERO_TEST_LOGIT, ExactTransformer, encoder_attention, in_slices, position_features
from tests.model.helpers import (
    assert_rows_of_different_lengths_run_as_alone,
    assert_select_split_stack_round_trip,
    counted_flops,
    measured_peak_bytes,
)
from training.exact_builders import SHIPPED

VOCAB = 2
ALL_FEATURES = (
    "fraction",
    "alternating",
    "is_first_symbol",
    "index",
    "mirror_index",
    "index_squared",
    "left_half",
    "right_half",
)


def make(**overrides) -> ExactTransformer:
    """A random-weight float64 model: 2 layers of 2 heads over d = 6, every position feature."""
    fields = {
        "vocab_size": VOCAB,
        "num_labels": 2,
        "d_model": 6,
        "construction": "parity",
        "n_layers": 2,
        "n_heads": 2,
        "d_ff": 5,
        "position_features": ALL_FEATURES,
        "compute_dtype": "float64",
    }
    model = ExactTransformer(ExactTransformerConfig(**{**fields, **overrides})).eval()
    with torch.no_grad():  # keep the index features (up to n^2) from saturating every softmax
        model.position.weight.mul_(0.01)
    return model


def reference_features(i: int, n: int) -> list[float]:
    """f(i, n) of ALL_FEATURES, written from their definitions."""
    return [
        i / n,
        math.cos(i * math.pi),
        float(i == 1),
        i,
        n - 1 - i,
        i * i,
        float(i <= (n - 1) / 2),
        float(i >= (n - 1) / 2),
    ]


def reference_logits(model: ExactTransformer, symbols: list[int]) -> torch.Tensor:
    """Chiang & Cholak (2022)'s encoder position by position: every layer at every position, heads summed."""
    config = model.config
    tokens = [VOCAB, *symbols] + ([VOCAB + 1] if config.append_eos else [])
    n, d = len(tokens), config.d_model
    scale = math.log(n) if config.log_length_scaling else 1.0

    def norm(x: torch.Tensor) -> torch.Tensor:
        if not config.layer_norm:
            return x
        return (x - x.mean()) / torch.sqrt(x.var(unbiased=False) + config.layer_norm_eps)

    with torch.no_grad():
        features = torch.tensor([reference_features(i, n) for i in range(n)], dtype=torch.float64)
        a = [model.word.weight[token] + model.position.weight @ features[i] for i, token in enumerate(tokens)]
        for layer in model.layers:
            stacked = torch.stack(a)  # (n, d)
            c = []
            for i in range(n):
                total = a[i].clone()
                for head in range(config.n_heads):
                    q = layer.query[head] @ a[i]
                    weights = torch.softmax(scale * (stacked @ layer.key[head].T) @ q / math.sqrt(d), dim=0)
                    total = total + (stacked @ layer.value[head].T).T @ weights
                c.append(norm(total))
            a = [norm(layer.ffn_out(F.relu(layer.ffn_in(x))) + x) for x in c]
        return model.head(a[0])


CONFIGS = {
    "plain": {},
    "layer_norm_eps0": {"layer_norm": True, "layer_norm_eps": 0.0},
    "layer_norm_log_scaled_eos": {
        "layer_norm": True,
        "layer_norm_eps": 1e-5,
        "log_length_scaling": True,
        "append_eos": True,
    },
    "three_layers_one_head": {"n_layers": 3, "n_heads": 1},
}


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("zero_values_after", [None, 1])
def test_final_logits_match_the_papers_equations(name: str, zero_values_after: int | None) -> None:
    """Also with the values of every layer after the first zeroed, where the model computes CLS alone."""
    model = make(**CONFIGS[name])
    if zero_values_after is not None:
        with torch.no_grad():
            for layer in model.layers[zero_values_after:]:
                layer.value.zero_()
    for length in (1, 2, 5, 8):
        symbols = torch.randint(0, VOCAB, (length,)).tolist()
        got = model.final_logits(torch.tensor([symbols]))[0]
        torch.testing.assert_close(got, reference_logits(model, symbols), rtol=1e-10, atol=1e-10)


def test_forward_labels_each_prefix_with_its_own_encoder_pass() -> None:
    model = make(layer_norm=True)
    tokens = torch.randint(0, VOCAB, (3, 9))
    with torch.no_grad():
        logits = model(tokens)  # (B, T, L)
        for t in range(9):
            torch.testing.assert_close(logits[:, t], model.encode(tokens[:, : t + 1]), rtol=0, atol=0)


def test_final_logits_equal_gathered_parallel_logits() -> None:
    model = make()
    tokens = torch.randint(0, VOCAB, (4, 13))
    lengths = torch.tensor([13, 1, 7, 7])
    with torch.no_grad():
        parallel = model(tokens)
        final = model.final_logits(tokens, lengths)
    torch.testing.assert_close(final, parallel[torch.arange(4), lengths - 1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["layer_norm_log_scaled_eos", "three_layers_one_head"])
def test_each_step_gives_the_papers_equations_on_the_prefix_read_so_far(name: str) -> None:
    """Step t's logits are those of reference_logits (written position by position, independent of ``encode``)
    on symbols 1..t: the cache re-encodes the whole prefix, with its own n, positions and EOS."""
    model = make(**CONFIGS[name])
    tokens = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        cache = model.new_cache(batch_size=2)
        for t in range(11):
            stepped = model.step(tokens[:, t], cache)  # (B, L)
            assert cache.length == t + 1 and torch.equal(cache.symbols, tokens[:, : t + 1])
            for row in range(2):
                expected = reference_logits(model, tokens[row, : t + 1].tolist())
                torch.testing.assert_close(stepped[row], expected, rtol=1e-10, atol=1e-10)


def test_prefill_then_step_and_clone() -> None:
    model = make()
    first = torch.randint(0, VOCAB, (1, 10))
    second = torch.cat([first[:, :4], 1 - first[:, 4:]], dim=1)
    with torch.no_grad():
        expected_first, expected_second = model(first), model(second)
        cache = model.new_cache(batch_size=1)
        prefilled = model(first[:, :4], cache=cache)
        snapshot = cache.clone()
        stepped_first = [model.step(first[:, t], cache) for t in range(4, 10)]
        stepped_second = [model.step(second[:, t], snapshot) for t in range(4, 10)]
    assert cache.length == snapshot.length == 10 and snapshot.nbytes > 0
    torch.testing.assert_close(prefilled, expected_first[:, :4], rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(stepped_first, 1), expected_first[:, 4:], rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(stepped_second, 1), expected_second[:, 4:], rtol=0, atol=0)


@pytest.mark.parametrize("name", ["plain", "layer_norm_log_scaled_eos"])
def test_rows_of_different_lengths_step_in_one_batch_as_each_alone(name: str) -> None:
    assert_rows_of_different_lengths_run_as_alone(make(**CONFIGS[name]), VOCAB)


def test_select_split_and_stack_round_trip() -> None:
    assert_select_split_stack_round_trip(make(), VOCAB, padded=True)


def run_to_the_end(slices) -> tuple[object, list[float]]:
    """The result of a generator of slices, and what it yielded: each slice's multiply-adds."""
    done = []
    while True:
        try:
            done.append(next(slices))
        except StopIteration as stop:
            return stop.value, done


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda shipped: shipped.task)
def test_run_in_slices_equals_final_logits_and_forward(shipped) -> None:
    """With slices of 100 multiply-adds (a piece each: every projection, attention query chunk and FFN), both outputs
    equal the unsliced calls."""
    model = shipped.build()
    tolerance = 1e-9 if model.dtype == torch.float64 else 1e-5
    tokens = torch.randint(0, VOCAB, (1, 40))
    with torch.no_grad():
        (final, labels), final_slices = run_to_the_end(model.run_in_slices(tokens, False, slice_flops=100))
        (last, every), all_slices = run_to_the_end(model.run_in_slices(tokens[:, :12], True, slice_flops=100))
        torch.testing.assert_close(final, model.final_logits(tokens)[0], rtol=tolerance, atol=tolerance)
        parallel = model(tokens[:, :12])[0]  # (12, L)
    assert labels is None and torch.equal(every, parallel.argmax(-1))
    torch.testing.assert_close(last, parallel[-1], rtol=tolerance, atol=tolerance)
    assert len(final_slices) > len(model.layers) and len(all_slices) > 12 * len(model.layers)


def test_a_slice_holds_about_slice_flops() -> None:
    """PARITY over 3,000 symbols (its first layer attends, O(n^2)) in slices of a tenth of its multiply-adds: about
    ten slices, the attention's query chunks cut to fit, each reporting the work it did (all of it but the position
    features and the head, which are no pieces)."""
    model = next(shipped for shipped in SHIPPED if shipped.task == "parity_check").build()
    tokens = torch.randint(0, VOCAB, (1, 3000))
    whole = model.cost("final", 1, 3000).flops
    with torch.no_grad():
        (final, _), slices = run_to_the_end(model.run_in_slices(tokens, False, slice_flops=whole / 10))
        torch.testing.assert_close(final, model.final_logits(tokens)[0], rtol=1e-9, atol=1e-9)
    assert 10 <= len(slices) <= 12 and max(slices) <= whole / 10
    assert sum(slices) == pytest.approx(whole, rel=1e-3)


def test_in_slices_ends_a_slice_before_the_piece_that_would_cross_slice_flops() -> None:
    def pieces():
        yield from (3, 3, 3, 9, 1, 2)
        return "done"

    assert run_to_the_end(in_slices(pieces(), slice_flops=6)) == ("done", [6, 3, 9, 3])  # [3, 3], [3], [9], [1, 2]


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda shipped: shipped.task)
def test_cost_grows_with_length_and_a_step_re_encodes_its_context(shipped) -> None:
    model = shipped.build()
    for path in ("forward", "final", "cached"):
        costs = [model.cost(path, 2, length, context=50) for length in (1, 10, 100, 1000)]
        assert all(0 < a.flops < b.flops and 0 < a.nbytes <= b.nbytes for a, b in itertools.pairwise(costs)), path
    assert model.cost("cached", 1, 1, context=10_000).flops > 100 * model.cost("cached", 1, 1, context=10).flops
    # "forward" is the sum of the prefixes' "final" passes
    assert model.cost("forward", 3, 20).flops == sum(model.cost("final", 3, length).flops for length in range(1, 21))


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda shipped: shipped.task)
def test_declared_flops_are_the_counted_matrix_products(shipped) -> None:
    model = shipped.build()
    tokens = torch.randint(0, VOCAB, (2, 300))
    with torch.no_grad():
        cache = model.new_cache(batch_size=2)
        model(tokens[:, :50], cache=cache)
        calls = {
            ("final", 300, 0): lambda: model.final_logits(tokens),
            ("forward", 20, 0): lambda: model(tokens[:, :20]),
            ("cached", 3, 50): lambda: model(tokens[:, 50:53], cache=cache),
        }
        for (path, length, context), call in calls.items():
            ratio = model.cost(path, 2, length, context).flops / counted_flops(call)
            assert 1 <= ratio <= 1.3, (path, ratio)


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda shipped: shipped.task)
def test_declared_nbytes_are_at_least_the_measured_peak(shipped) -> None:
    model = shipped.build()
    tokens = torch.randint(0, VOCAB, (2, 300))
    with torch.no_grad():
        assert measured_peak_bytes(lambda: model.final_logits(tokens)) <= model.cost("final", 2, 300).nbytes
        assert measured_peak_bytes(lambda: model(tokens[:, :8])) <= model.cost("forward", 2, 8).nbytes


@pytest.mark.parametrize("n_keys", [1, 7, 33])
def test_chunked_attention_equals_one_block(n_keys: int) -> None:
    queries = torch.randn(2, 3, n_keys, 4, dtype=torch.float64)  # (B, H, T, d)
    keys, values = torch.randn_like(queries), torch.randn_like(queries)
    whole = encoder_attention(queries, keys, values, 1.7, block_elements=1 << 20)
    expected = torch.softmax(1.7 * queries @ keys.transpose(-1, -2) / 2.0, dim=-1) @ values
    torch.testing.assert_close(whole, expected, rtol=1e-12, atol=1e-12)
    for block_elements in (1, 2 * 3 * n_keys * 2, 2 * 3 * n_keys * 5):
        chunked = encoder_attention(queries, keys, values, 1.7, block_elements)
        torch.testing.assert_close(chunked, whole, rtol=1e-12, atol=1e-12)


def test_attention_under_autograd_computes_the_same_and_has_the_right_gradients() -> None:
    """Without autograd the chunks' weights are computed in place; with it, out of place."""
    queries = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    keys = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    values = torch.randn(1, 2, 5, 3, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        in_place = encoder_attention(queries, keys, values, 0.8, block_elements=20)
    torch.testing.assert_close(encoder_attention(queries, keys, values, 0.8, 20), in_place, rtol=0, atol=0)
    assert torch.autograd.gradcheck(lambda q, k, v: encoder_attention(q, k, v, 0.8, 20), (queries, keys, values))


def test_position_features_follow_their_definitions() -> None:
    for n in (1, 4, 7):
        got = position_features(ALL_FEATURES, n, torch.float64, torch.device("cpu"))  # (n, F)
        expected = torch.tensor([reference_features(i, n) for i in range(n)], dtype=torch.float64)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_zero_test_output_reports_the_indicator() -> None:
    model = make(output="zero_test")
    with torch.no_grad():
        model.head.weight.zero_()
        model.head.bias.copy_(torch.tensor([0.5, 0.5]))
        assert model.final_logits(torch.tensor([[0, 1]])).tolist() == [[-ZERO_TEST_LOGIT, ZERO_TEST_LOGIT]]
        model.head.bias.copy_(torch.tensor([0.5, 0.5 + 1e-9], dtype=torch.float64))
        assert model.final_logits(torch.tensor([[0, 1]])).tolist() == [[ZERO_TEST_LOGIT, -ZERO_TEST_LOGIT]]


def test_refuses_symbols_outside_the_alphabet() -> None:
    model = make()
    with pytest.raises(ValueError, match="CLS and EOS are added inside"):
        model(torch.tensor([[0, VOCAB]]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"position_features": ("fraction", "fraction")}, "repeats"),
        ({"position_features": ("sinusoid",)}, "not one of"),
        ({"num_labels": 0}, "classifier"),
        ({"dropout": 0.1}, "no dropout"),
        ({"layer_norm_eps": -1.0}, ">= 0"),
        ({"output": "zero_test", "num_labels": 3}, "two labels"),
        ({"construction": "dyck"}, "not one of"),
    ],
)
def test_config_refuses_what_cannot_be_built(overrides: dict, message: str) -> None:
    fields = {"vocab_size": VOCAB, "num_labels": 2, "d_model": 6, "construction": "parity"}
    with pytest.raises(ConfigError, match=message):
        ExactTransformerConfig(**{**fields, **overrides})


def test_config_survives_json() -> None:
    model_config = make(layer_norm=True, append_eos=True).config
    config = CheckpointConfig(
        architecture="exact",
        model=model_config,
        kind="transduce",
        task="parity_check",
        alphabet="01",
        labels=("0", "1"),
    )
    assert CheckpointConfig.from_dict(config.to_dict()) == config
