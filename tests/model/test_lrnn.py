"""Checks specific to the linear RNNs: scan implementations, O(1) decoding memory, the transitions' shape."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.diagonal_lrnn import DiagonalLRNN
from model.lrnn import BlockDiagonalLRNN, LinearRNN
from model.ops.linear_scan import ScanImpl
from tests.model.tiny_models import tiny_configs

VOCAB, LABELS = 5, 3
MODELS = {"lrnn": BlockDiagonalLRNN, "diagonal_lrnn": DiagonalLRNN}


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
            torch.testing.assert_close(model(tokens), expected, rtol=1e-10, atol=1e-10, msg=lambda m: f"{impl}: {m}")


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


@pytest.mark.parametrize("weight_scale", [1.0, 1000.0], ids=["init", "large-weights"])
def test_every_transition_column_has_p_norm_at_most_one(weight_scale: float) -> None:
    model = make("lrnn")
    with torch.no_grad():
        for block in model.blocks:
            block.recurrence.transition.weight.mul_(weight_scale)
        norms = column_norms(model, torch.randint(0, VOCAB, (4, 30)))
    assert bool((norms <= 1 + 1e-12).all()), norms.max()
    if weight_scale > 1:
        assert torch.isclose(norms.max(), torch.tensor(1.0, dtype=norms.dtype))  # the constraint is active


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
