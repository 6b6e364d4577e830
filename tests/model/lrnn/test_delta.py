"""Checks specific to the delta-rule LRNN: its write gate, its reference path and what it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn import functional as F

from model.config import ConfigError, LRNNConfig
from model.lrnn.delta import DeltaRecurrence
from model.lrnn.model import BlockDiagonalLRNN
from model.ops.scan.dispatch import linear_scan
from tests.model.tiny_models import tiny_configs

VOCAB = 5


def make(**changes: object) -> BlockDiagonalLRNN:
    config = dataclasses.replace(tiny_configs(VOCAB, 0)["lrnn-delta"], **changes)
    return BlockDiagonalLRNN(config).double().eval()


def recurrence_of(model: BlockDiagonalLRNN, layer: int = 0) -> DeltaRecurrence:
    recurrence = model.blocks[layer].recurrence
    assert isinstance(recurrence, DeltaRecurrence)
    return recurrence


def test_the_gate_is_hard_when_served_and_blends_in_the_sigmoid_while_training() -> None:
    """beta = 2 clamp(z / 4 + 1 / 2, 0, 1) in evaluation mode and at softness 0; lerp towards 2 sigmoid(z) by
    ``softness`` in training mode; beta starts at 0.5."""
    recurrence = recurrence_of(make())
    heads = recurrence.heads
    u = torch.randn(6, 16, dtype=torch.float64)
    z = (u @ recurrence.in_proj.weight.T + recurrence.in_proj.bias)[:, -heads:]
    hard = 2 * (z / 4 + 0.5).clamp(0, 1)
    assert torch.allclose(recurrence.project(u)[3], hard)
    recurrence.train()
    for share in (0.0, 0.4, 1.0):
        recurrence.softness = share
        expected = torch.lerp(hard, 2 * torch.sigmoid(z), share)
        assert torch.allclose(recurrence.project(u)[3], expected)
    start = recurrence.eval().project(torch.zeros(1, 16, dtype=torch.float64))[3]
    assert torch.allclose(start, torch.full_like(start, 0.5))


def test_the_gates_mean_is_kept_only_in_training_mode_when_tracked() -> None:
    recurrence = recurrence_of(make())
    u = torch.randn(6, 16, dtype=torch.float64)
    recurrence.project(u)
    assert recurrence.writes is None
    recurrence.track_writes = True
    recurrence.project(u)
    assert recurrence.writes is None  # evaluation mode
    beta = recurrence.train().project(u)[3]
    assert recurrence.writes is not None and torch.allclose(recurrence.writes, beta.mean() / 2)


def test_a_closed_gate_keeps_the_state_exactly_at_any_length() -> None:
    """Where every z is far below 0 the served gate is exactly 0: after 1,000 tokens every layer's state is what it
    was, through the chunked form and through steps."""
    model = make()
    with torch.no_grad():
        for layer in range(2):
            recurrence_of(model, layer).in_proj.bias[-recurrence_of(model).heads :] = -1e6
        cache = model.new_cache(2)
        cache.states = [torch.randn_like(state) for state in cache.states]
        before = [state.clone() for state in cache.states]
        model(torch.randint(0, VOCAB, (2, 1000)), cache=cache)
        model.step(torch.randint(0, VOCAB, (2,)), cache)
    for got, want in zip(cache.states, before):
        assert torch.equal(got, want)


def test_the_mix_equals_the_generic_scan_and_readout() -> None:
    """The block's chunked path equals the reference view: transitions and inputs per value row, scanned by the
    linear scan, read out by :meth:`DeltaRecurrence.readout`."""
    model = make(scan_chunk_size=5)
    block = model.blocks[0]
    x = torch.randn(3, 23, 16, dtype=torch.float64)
    state = torch.randn(3, *recurrence_of(model).state_shape, dtype=torch.float64)
    with torch.no_grad():
        u, states, final = block.scan(x, state, 0)
        read, mixed_final = block.mix(x, state)
        torch.testing.assert_close(recurrence_of(model).project_out(read), recurrence_of(model).readout(states, u))
        torch.testing.assert_close(mixed_final, final)


def test_the_short_convolution_equals_a_loop_and_goes_on_across_calls() -> None:
    """:meth:`DeltaRecurrence.convolved` is SiLU of sum_j w_j x_{t - K + 1 + j}, zeros before the input; a mix cut in
    two (the state carrying the history) equals the whole; the generic scan from a zero state equals the mix."""
    model = make(short_conv=3, scan_chunk_size=4)
    recurrence, block = recurrence_of(model), model.blocks[0]
    x = torch.randn(2, 11, 3 * recurrence.heads * recurrence.size, dtype=torch.float64)
    weight = recurrence.conv.weight[:, 0]  # (3 H b, K)
    padded = torch.cat([torch.zeros(2, 2, x.shape[-1], dtype=torch.float64), x], dim=1)
    loop = torch.stack([F.silu((padded[:, t : t + 3] * weight.T).sum(1)) for t in range(11)], dim=1)
    got, history = recurrence.convolved(x, None)
    torch.testing.assert_close(got, loop)
    torch.testing.assert_close(history, x[:, -2:])
    tokens = torch.randn(2, 13, 16, dtype=torch.float64)
    with torch.no_grad():
        whole, whole_final = block.mix(tokens, None)
        first, state = block.mix(tokens[:, :6], None)
        second, final = block.mix(tokens[:, 6:], state)
        torch.testing.assert_close(torch.cat([first, second], dim=1), whole)
        torch.testing.assert_close(final, whole_final)
        u = block.ln_1(tokens)
        transitions, inputs = recurrence.coefficients(u)
        states, last = linear_scan(transitions, inputs, torch.zeros_like(inputs[:, 0]), impl="sequential")
        torch.testing.assert_close(recurrence.project_out(whole), recurrence.readout(states, u))
        torch.testing.assert_close(last, whole_final[:, : recurrence.heads * recurrence.size])
    assert recurrence.state_shape == (recurrence.heads * recurrence.size + 2 * 3 * recurrence.heads, 3)


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"short_conv": -1}, "short_conv must be >= 0"), ({"transition_norm": "column", "short_conv": 4}, "delta' only")],
)
def test_a_bad_short_convolution_is_refused(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(tiny_configs(VOCAB, 0)["lrnn-delta"], **changes)


@pytest.mark.parametrize("changes", [{"transition_rank": 2}, {"state_codes": 4, "num_labels": 3}])
def test_a_rank_or_state_codes_are_refused(changes: dict[str, int]) -> None:
    config = tiny_configs(VOCAB, 0)["lrnn-delta"]
    with pytest.raises(ConfigError, match="transition_norm 'delta' takes neither a transition_rank nor state_codes"):
        dataclasses.replace(config, **changes)


def test_a_delta_lrnn_does_not_grow() -> None:
    small, large = make(), make(num_blocks=4)
    with pytest.raises(ValueError, match="a delta-rule LRNN does not grow"):
        large.grown_from(small.state_dict())


def test_config_round_trip_keeps_the_transition_type() -> None:
    config = tiny_configs(VOCAB, 0)["lrnn-delta"]
    assert LRNNConfig(**dataclasses.asdict(config)).transition_norm == "delta"
