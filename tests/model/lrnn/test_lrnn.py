"""Checks specific to the linear RNNs: scan implementations, O(1) decoding memory, the transitions' shape and
generator (full or low-rank)."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from model.config import CheckpointConfig, ConfigError, LRNNConfig
from model.lrnn.diagonal import DiagonalLRNN
from model.lrnn.model import BlockDiagonalLRNN, LinearRNN
from model.ops.cpu import cpu_decode
from model.ops.scan.constraints import column_norm_constraint, column_sparsemax
from model.ops.scan.dispatch import ScanImpl
from model.ops.scan.reference import scan_step
from tests.model.tiny_models import tiny_configs

VOCAB, LABELS = 5, 3
MODELS = {
    "lrnn": BlockDiagonalLRNN,
    "lrnn-rank3": BlockDiagonalLRNN,
    "lrnn-stochastic": BlockDiagonalLRNN,
    "lrnn-stochastic-rank2": BlockDiagonalLRNN,
    "lrnn-delta": BlockDiagonalLRNN,
    "diagonal_lrnn": DiagonalLRNN,
}
BLOCK_DIAGONAL_IDS = ["lrnn", "lrnn-rank3", "lrnn-stochastic"]


def make(model_id: str, scan_impl: ScanImpl = "auto", scan_chunk_size: int = 64) -> LinearRNN:
    config = dataclasses.replace(
        tiny_configs(VOCAB, LABELS)[model_id], scan_impl=scan_impl, scan_chunk_size=scan_chunk_size
    )
    return MODELS[model_id](config).double().eval()


@pytest.mark.parametrize("model_id", sorted(MODELS))
def test_scan_impl_changes_nothing(model_id: str) -> None:
    reference = make(model_id, "sequential")
    tokens = torch.randint(0, VOCAB, (3, 45))
    with torch.no_grad():
        expected = reference(tokens)
        for impl, chunk_size in [("parallel", 64), ("chunked", 7), ("chunked", 9), ("auto", 64)]:
            model = make(model_id, impl, chunk_size)
            model.load_state_dict(reference.state_dict())
            torch.testing.assert_close(
                model(tokens), expected, rtol=1e-10, atol=1e-10, msg=lambda m, impl=impl: f"{impl}: {m}"
            )


@pytest.mark.parametrize("model_id", sorted(MODELS))
@pytest.mark.parametrize("impl", ["parallel", "chunked"])
def test_prefill_on_a_non_empty_cache_continues_the_sequence(model_id: str, impl: ScanImpl) -> None:
    model = make(model_id, impl, scan_chunk_size=4)
    tokens = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        expected = model(tokens)
        cache = model.new_cache(batch_size=2)
        parts = [model(tokens[:, start:end], cache=cache) for start, end in [(0, 11), (11, 12), (12, 40)]]
    assert cache.length == 40
    torch.testing.assert_close(torch.cat(parts, dim=1), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("model_id", sorted(MODELS))
def test_decode_memory_does_not_grow_with_context(model_id: str) -> None:
    model = make(model_id)
    cache = model.new_cache(batch_size=2)
    tokens = torch.randint(0, VOCAB, (1000, 2))
    sizes = {}
    with torch.no_grad():
        for t in range(1000):
            model.step(tokens[t], cache)
            if t + 1 in (10, 1000):
                sizes[t + 1] = cache.nbytes
    assert sizes[10] == sizes[1000] > 0


def column_norms(model: BlockDiagonalLRNN, tokens: torch.Tensor) -> torch.Tensor:
    """The p-norm of every column of every layer's transitions along a pass over ``tokens``."""
    norms = []
    x = model.embedding(tokens)  # (B, T, d_model)
    for block in model.blocks:
        transitions = block.recurrence.transitions(block.ln_1(x))  # (B, T, H, b, b)
        norms.append(torch.linalg.vector_norm(transitions, ord=model.config.p_norm, dim=-2).flatten())
        x, _ = block(x, None)
    return torch.cat(norms)


@pytest.mark.parametrize("model_id", BLOCK_DIAGONAL_IDS)
@pytest.mark.parametrize("weight_scale", [1.0, 1000.0], ids=["init", "large-weights"])
def test_every_transition_column_has_p_norm_at_most_one(model_id: str, weight_scale: float) -> None:
    model = make(model_id)
    with torch.no_grad():
        for block in model.blocks:
            block.recurrence.transition.weight.mul_(weight_scale)
        norms = column_norms(model, torch.randint(0, VOCAB, (4, 30)))
    assert bool((norms <= 1 + 1e-12).all()), norms.max()
    if weight_scale > 1:
        assert torch.isclose(norms.max(), torch.tensor(1.0, dtype=norms.dtype))  # the constraint is active


@pytest.mark.parametrize("model_id", BLOCK_DIAGONAL_IDS)
def test_the_fused_step_equals_one_scan_step_with_the_constraint_active(model_id: str) -> None:
    """The step divides the state by the column divisors instead of the columns; at init every divisor is 1, so
    the weights are scaled up until most columns are clamped."""
    recurrence = make(model_id).blocks[0].recurrence
    with torch.no_grad():
        recurrence.transition.weight.mul_(1000.0)
        u = torch.randn(5, tiny_configs(VOCAB, LABELS)[model_id].d_model, dtype=torch.float64)
        state = torch.randn(5, *recurrence.state_shape, dtype=torch.float64)
        transitions, inputs = recurrence.coefficients(u)
        assert (torch.linalg.vector_norm(transitions, ord=recurrence.p_norm, dim=-2) > 0.999).float().mean() > 0.5
        torch.testing.assert_close(recurrence.step(u, state), scan_step(transitions, inputs, state))


@pytest.mark.parametrize("model_id", BLOCK_DIAGONAL_IDS)
def test_the_fused_step_runs_in_bfloat16(model_id: str) -> None:
    model = make(model_id).float()
    tokens = torch.randint(0, VOCAB, (3,))
    with torch.no_grad():
        reference = model.step(tokens, model.new_cache(batch_size=3))
        low = model.to(torch.bfloat16).step(tokens, model.new_cache(batch_size=3))
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), reference, rtol=0.1, atol=0.1)


def test_diagonal_transitions_do_not_depend_on_the_input() -> None:
    model = make("diagonal_lrnn")
    recurrence = model.blocks[0].recurrence
    u = torch.randn(2, 7, model.config.d_model, dtype=torch.float64)
    transitions = recurrence.transitions(u)  # (B, T, N, 2, 2)
    assert transitions.shape == (2, 7, model.config.state_size, 2, 2)
    assert transitions.stride()[:2] == (0, 0)  # expanded over batch and time, not copied
    torch.testing.assert_close(recurrence.transitions(torch.randn_like(u)), transitions, rtol=0, atol=0)
    eigenvalue_magnitudes = torch.linalg.vector_norm(transitions[0, 0, :, :, 0], dim=-1)  # (N,)
    assert bool((eigenvalue_magnitudes < 1).all())


def test_the_full_generator_keeps_the_papers_parameters_and_arithmetic() -> None:
    """transition_rank None is the paper's full generator: the same parameters, and A(u), B u computed by the same
    products (bitwise), so shipped checkpoints load and give the same outputs."""
    recurrence = make("lrnn").blocks[0].recurrence
    assert sorted(recurrence.state_dict()) == [
        "input_proj.bias",
        "input_proj.weight",
        "out_proj.bias",
        "out_proj.weight",
        "transition.bias",
        "transition.weight",
    ]
    u = torch.randn(3, 7, recurrence.transition.in_features, dtype=torch.float64)
    heads, block = recurrence.state_shape
    transitions, inputs = recurrence.coefficients(u)
    raw = F.linear(u, recurrence.transition.weight, recurrence.transition.bias)  # (3, 7, H b^2)
    expected = column_norm_constraint(raw.unflatten(-1, (heads, block, block)), recurrence.p_norm)
    assert torch.equal(transitions, expected)
    expected_inputs = F.linear(u, recurrence.input_proj.weight, recurrence.input_proj.bias)  # (3, 7, H b)
    assert torch.equal(inputs, expected_inputs.unflatten(-1, (heads, block)))


def test_a_low_rank_generator_is_v_scaled_u_plus_c_and_shares_one_product_with_the_input_map() -> None:
    config = tiny_configs(VOCAB, LABELS)["lrnn-rank3"]
    recurrence = make("lrnn-rank3").blocks[0].recurrence
    rank, d_model, heads, block = 3, config.d_model, config.num_blocks, config.block_size
    assert recurrence.in_proj.weight.shape == (rank + heads * block, d_model)  # [U; B]
    assert recurrence.transition.weight.shape == (heads * block * block, rank)  # V
    assert not hasattr(recurrence, "input_proj")
    assert recurrence.in_proj.bias.shape == (rank + heads * block,) and recurrence.transition.bias.shape == (32,)
    u = torch.randn(2, 9, d_model, dtype=torch.float64)
    code_map, input_map = recurrence.in_proj.weight.split([rank, heads * block])
    code_bias, input_bias = recurrence.in_proj.bias.split([rank, heads * block])
    code = F.linear(u, code_map, code_bias) * d_model / rank  # code_scale U u
    raw = F.linear(code, recurrence.transition.weight, recurrence.transition.bias)
    transitions, inputs = recurrence.coefficients(u)
    expected = column_norm_constraint(raw.unflatten(-1, (heads, block, block)), config.p_norm)
    torch.testing.assert_close(transitions, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(inputs, F.linear(u, input_map, input_bias).unflatten(-1, (heads, block)))
    assert torch.equal(code_bias, torch.zeros(rank, dtype=code_bias.dtype))  # c is V's bias alone at init


def test_a_low_rank_generator_starts_like_the_full_one() -> None:
    """Both start at A(u) ~ 0.9 I with entries of g(u) spread by ~0.02, so a rank changes what can be learned,
    not where learning starts."""
    spreads = {}
    for rank in (None, 16):
        config = LRNNConfig(vocab_size=VOCAB, d_model=128, num_blocks=8, block_size=8, transition_rank=rank)
        torch.manual_seed(0)
        recurrence = BlockDiagonalLRNN(config).blocks[0].recurrence
        with torch.no_grad():
            transitions = recurrence.transitions(torch.randn(4096, 128))  # (N, H, b, b): u ~ LN(x), unit entries
        identity = 0.9 * torch.eye(8)
        assert torch.allclose(transitions.mean(0), identity.expand(8, 8, 8), atol=0.01)
        spreads[rank] = float(transitions.std(0).mean())
    assert spreads[16] == pytest.approx(spreads[None], rel=0.1) and 0.015 < spreads[None] < 0.025


@pytest.mark.parametrize("rank", [0, 16, 64])
def test_a_rank_that_factors_nothing_is_refused(rank: int) -> None:
    """d_model 16, H b^2 = 32: a factorisation needs 1 <= r < 16."""
    with pytest.raises(ConfigError, match="transition_rank"):
        LRNNConfig(vocab_size=VOCAB, d_model=16, num_blocks=2, block_size=4, transition_rank=rank)


@pytest.mark.parametrize("model_id", sorted(MODELS))
def test_for_serving_transposes_the_wide_weights_in_memory_and_changes_no_value(model_id: str) -> None:
    model = MODELS[model_id](dataclasses.replace(tiny_configs(VOCAB, 0)[model_id], vocab_size=40)).double().eval()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    tokens = torch.randint(0, 40, (2, 21))
    with torch.no_grad():
        expected = model(tokens)
        notes = model.for_serving()
        parallel = model(tokens)
        cache = model.new_cache(batch_size=2)
        stepped = torch.stack([model.step(tokens[:, t], cache) for t in range(21)], dim=1)
    wide = [weight for weight in model.parameters() if weight.dim() == 2 and weight.shape[0] > weight.shape[1]]
    assert notes and wide and all(weight.stride(0) == 1 for weight in wide)  # (in, out) in memory
    assert any(weight is model.embedding.embed.weight for weight in wide)  # the tied head (V = 40 > d_model = 16)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    torch.testing.assert_close(parallel, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stepped, expected, rtol=1e-9, atol=1e-9)
    assert model.for_serving() == []  # nothing left to move


@pytest.mark.parametrize("streaming", [True, False])
def test_served_full_generator_makes_g_and_b_with_one_product_until_moved(streaming: bool) -> None:
    """Stacked (out, in) in memory for the streaming kernel (float32, one thread), (in, out) for MKL's products."""
    model = make("lrnn").float()
    tokens = torch.randint(0, VOCAB, (2, 13))
    products = contextlib.nullcontext() if streaming else cpu_decode.torch_products()
    with torch.no_grad(), products:
        expected = model(tokens)
        assert all(block.recurrence.joint_weight() is None for block in model.blocks)
        model.for_serving()
        recurrence = model.blocks[0].recurrence
        joint = recurrence.joint_weight()  # (H b^2 + H b, d_model), what both weights view
        assert joint is not None and joint.shape == (2 * 4 * 4 + 2 * 4, 16)
        assert joint.is_contiguous() if streaming else joint.t().is_contiguous()
        assert torch.equal(joint, torch.cat([recurrence.transition.weight, recurrence.input_proj.weight]))
        for moved in (False, True):
            if moved:
                model.double().float()  # each weight gets its own storage: the step makes two products again
                assert recurrence.joint_weight() is None
            cache = model.new_cache(batch_size=2)
            stepped = torch.stack([model.step(tokens[:, t], cache) for t in range(13)], dim=1)
            torch.testing.assert_close(stepped, expected, rtol=1e-5, atol=1e-5)
    assert make("lrnn-rank3").blocks[0].recurrence.joint_weight() is None


@pytest.mark.parametrize(("version", "keys"), [(2, ["transition_rank"]), (5, ["state_codes", "snap_every"])])
def test_a_config_from_before_an_option_loads_as_its_files_meant(version: int, keys: list[str]) -> None:
    """Format 2 files (and version 1 ones) have no transition_rank: they meant the full generator; format 5 ones have
    no state codes: they meant none."""
    model = dataclasses.asdict(tiny_configs(2, 2)["lrnn"])
    for key in keys:
        del model[key]
    data = {
        "format_version": version,
        "architecture": "lrnn",
        "kind": "transduce",
        "alphabet": "01",
        "labels": ["0", "1"],
        "task": None,
        "tokenizer": None,
        "metadata": {},
        "model": model,
    }
    assert CheckpointConfig.from_dict(data).model == tiny_configs(2, 2)["lrnn"]
    with pytest.raises(ConfigError, match="missing key"):
        CheckpointConfig.from_dict({**data, "format_version": version + 1})  # the next format writes the keys


@pytest.mark.parametrize("model_id", ["lrnn-stochastic", "lrnn-stochastic-rank2"])
def test_a_stochastic_layer_is_a_probabilistic_automaton(model_id: str) -> None:
    """Column-stochastic transitions, no input term, a learned h_0: every state, at every length and in the cache,
    is a distribution per block; with weights large enough, the transitions are exact 0/1 matrices."""

    def assert_distributions(states: list[torch.Tensor], atol: float) -> None:
        for state in states:  # (3, H, b)
            assert torch.allclose(state.sum(-1), torch.ones(3, 2, dtype=torch.float64), atol=atol)
            assert bool((state >= 0).all())

    model = make(model_id)
    with torch.no_grad():
        for block in model.blocks:
            block.recurrence.initial.normal_()
        tokens = torch.randint(0, VOCAB, (3, 2000))
        cache = model.new_cache(batch_size=3)
        assert_distributions(cache.states, atol=1e-12)  # h_0 before any token
        model(tokens, cache=cache)
        model.step(tokens[:, 0], cache)
        assert_distributions(cache.states, atol=1e-9)
        recurrence = model.blocks[0].recurrence
        transitions, inputs = recurrence.coefficients(torch.randn(4, 16, dtype=torch.float64))
        assert not hasattr(recurrence, "input_proj") and bool((inputs == 0).all())
        assert torch.allclose(transitions.sum(-2), torch.ones(4, 2, 3, dtype=torch.float64), atol=1e-12)
        recurrence.transition.weight.mul_(1e4)
        transitions, _ = recurrence.coefficients(torch.randn(4, 16, dtype=torch.float64))
        assert bool(((transitions == 0) | (transitions == 1)).all())


def test_softness_blends_softmax_and_sparsemax_columns_while_training_only() -> None:
    """``softness`` s gives s softmax + (1 - s) sparsemax columns in training mode (still stochastic: each column
    sums to 1); 0, or evaluation mode, gives the sparsemax served."""
    recurrence = make("lrnn-stochastic").blocks[0].recurrence.train()
    u = torch.randn(4, 16, dtype=torch.float64)
    generated, _ = recurrence._generate(u)
    soft, sparse = generated.softmax(dim=-2), column_sparsemax(generated)
    assert not torch.allclose(soft, sparse)
    for share in (1.0, 0.3):
        recurrence.softness = share
        transitions, _ = recurrence.coefficients(u)
        assert torch.allclose(transitions, share * soft + (1 - share) * sparse, atol=1e-12)
        assert torch.allclose(transitions.sum(-2), torch.ones_like(transitions.sum(-2)), atol=1e-12)
    assert torch.equal(recurrence.eval().coefficients(u)[0], sparse)
    recurrence.train().softness = 0.0
    assert torch.equal(recurrence.coefficients(u)[0], sparse)


def test_the_soft_phase_keeps_its_columns_impurity_only_when_asked() -> None:
    """``impurity`` = mean over columns of 1 - sum_i A_ij^2 of the softmax columns, kept with ``track_impurity``
    in the soft phase; never for the sparsemax (evaluation, serving)."""
    recurrence = make("lrnn-stochastic").blocks[0].recurrence.train()
    u = torch.randn(4, 16, dtype=torch.float64)
    recurrence.softness = 1.0
    transitions, _ = recurrence.coefficients(u)  # (4, H, b, b)
    assert recurrence.impurity is None
    recurrence.track_impurity = True
    transitions, _ = recurrence.coefficients(u)
    expected = (1 - transitions.pow(2).sum(dim=-2)).mean()
    assert torch.allclose(recurrence.impurity, expected) and 0 < float(expected.detach()) < 1
    recurrence.impurity, recurrence.softness = None, 0.0
    recurrence.coefficients(u)
    assert recurrence.impurity is None


@pytest.mark.parametrize("model_id", ["lrnn", "lrnn-rank3", "lrnn-stochastic", "lrnn-stochastic-rank2"])
def test_a_model_grown_to_more_blocks_computes_what_it_did_and_its_new_blocks_learn(model_id: str) -> None:
    """``grown_from``: the smaller model's weights in the first blocks, the new blocks' readout zero: the same
    logits in the parallel pass and step by step; every new parameter gets a gradient (a stochastic block's
    whole columns, none outside a sparsemax's support); a model of another shape is refused, naming the tensor."""
    small = make(model_id)
    with torch.no_grad():
        for parameter in small.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))  # trained-looking weights, not the initial ones
    large = MODELS[model_id](dataclasses.replace(small.config, num_blocks=5)).double().eval()
    large.load_state_dict(large.grown_from(small.state_dict()))
    tokens = torch.randint(0, VOCAB, (3, 50))
    with torch.no_grad():
        assert torch.allclose(large(tokens), small(tokens), atol=1e-10)
        caches = small.new_cache(3), large.new_cache(3)
        for position in range(5):
            assert torch.allclose(
                large.step(tokens[:, position], caches[1]), small.step(tokens[:, position], caches[0]), atol=1e-10
            )
    old_state = small.config.num_blocks * small.config.block_size
    large.train()
    large(tokens).logsumexp(-1).sum().backward()  # the readout's new columns first: zero, they pass no gradient
    recurrence = large.blocks[0].recurrence
    assert bool((recurrence.out_proj.weight.grad[:, old_state:] != 0).all())
    with torch.no_grad():
        recurrence.out_proj.weight[:, old_state:] = 0.1
    large.zero_grad()
    large(tokens).logsumexp(-1).sum().backward()
    new_rows = recurrence.transition.weight.grad[old_state * small.config.block_size :]
    assert bool((new_rows.abs().sum(-1) > 0).all())  # each generated entry of a new block moves
    wider = dataclasses.replace(small.config, d_model=2 * small.config.d_model)
    with pytest.raises(ValueError, match=r"embedding\.embed\.weight: \(5, 16\) there, \(5, 32\) expected"):
        MODELS[model_id](dataclasses.replace(wider, num_blocks=5)).grown_from(small.state_dict())
    with pytest.raises(ValueError, match="with fewer than 2 blocks per layer"):
        small.grown_from(large.state_dict())
