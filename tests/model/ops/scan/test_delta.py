"""The delta rule's chunked form equals its reference loop (outputs, final states, gradients), and the reference loop is
the linear scan of the transitions I - beta k k^T."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from model.ops.scan.delta import delta_chunked, delta_sequential
from model.ops.scan.reference import scan_sequential

HEADS, SIZE = 3, 4


def problem(length: int, dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.Tensor]:
    """q, k (unit), v, beta in [0, 2] (B, T, H[, b]) and an initial state (B, H, b, b), all requiring gradients."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    q, k = (F.normalize(draw(2, length, HEADS, SIZE), dim=-1) for _ in range(2))
    v, state = draw(2, length, HEADS, SIZE), draw(2, HEADS, SIZE, SIZE)
    beta = 2 * torch.rand(2, length, HEADS, generator=generator, dtype=torch.float64)
    return [x.to(dtype).requires_grad_() for x in (q, k, v, beta, state)]


def outputs_and_gradients(run, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    outputs, final = run(*tensors)
    weights = torch.linspace(-1, 1, outputs.numel(), dtype=outputs.dtype).view_as(outputs)
    ((outputs * weights).sum() + final.square().sum()).backward()
    gradients = [x.grad for x in tensors]
    for x in tensors:
        x.grad = None
    return [outputs.detach(), final.detach(), *gradients]


@pytest.mark.parametrize("length", [1, 2, 7, 16, 33, 100])
@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_chunked_equals_the_reference_with_gradients(length: int, chunk_size: int) -> None:
    tensors = problem(length)
    expected = outputs_and_gradients(delta_sequential, tensors)
    actual = outputs_and_gradients(lambda *x: delta_chunked(*x, chunk_size=chunk_size), tensors)
    for name, got, want in zip(["outputs", "final", "q", "k", "v", "beta", "state"], actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


def test_the_reference_is_the_linear_scan_of_householder_like_transitions() -> None:
    """Each value row of S is a key-sized state: x_t = (I - beta k k^T) x_{t-1} + beta v_i k, read out as x . q."""
    q, k, v, beta, state = (x.detach() for x in problem(9))
    eye = torch.eye(SIZE, dtype=q.dtype)
    transitions = eye - (beta[..., None, None] * k.unsqueeze(-1)) * k.unsqueeze(-2)  # (B, T, H, b, b)
    rows = transitions.unsqueeze(3).expand(-1, -1, -1, SIZE, -1, -1).flatten(2, 3)  # (B, T, H b, b, b)
    inputs = (beta[..., None, None] * v.unsqueeze(-1) * k.unsqueeze(-2)).flatten(2, 3)  # (B, T, H b, b)
    states, final = scan_sequential(rows, inputs, state.flatten(1, 2))
    expected = (states.unflatten(2, (HEADS, SIZE)) @ q.unsqueeze(-1)).squeeze(-1)  # (B, T, H, b)
    outputs, got_final = delta_sequential(q, k, v, beta, state)
    torch.testing.assert_close(outputs, expected)
    torch.testing.assert_close(got_final, final.unflatten(1, (HEADS, SIZE)))


def test_transitions_keep_norms_and_a_zero_gate_writes_nothing() -> None:
    """With beta in [0, 2] every transition's eigenvalues are 1 and 1 - beta, in [-1, 1]; beta = 0 leaves the state
    exactly as it was, over any number of tokens, on both paths."""
    q, k, v, beta, state = (x.detach() for x in problem(300))
    transitions = torch.eye(SIZE, dtype=q.dtype) - (beta[..., None, None] * k.unsqueeze(-1)) * k.unsqueeze(-2)
    assert torch.linalg.matrix_norm(transitions, ord=2).max() <= 1 + 1e-12
    silent = torch.zeros_like(beta)
    for run in (delta_sequential, delta_chunked):
        _, final = run(q, k, v, silent, state)
        assert torch.equal(final, state), run.__name__


def test_chunked_runs_bfloat16_in_float32_and_returns_bfloat16() -> None:
    tensors = [x.detach() for x in problem(40)]
    expected, expected_final = delta_sequential(*tensors)
    outputs, final = delta_chunked(*(x.bfloat16() for x in tensors), chunk_size=16)
    assert outputs.dtype == final.dtype == torch.bfloat16
    torch.testing.assert_close(outputs.double(), expected, rtol=0.05, atol=0.1)
    torch.testing.assert_close(final.double(), expected_final, rtol=0.05, atol=0.1)


def test_a_chunk_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        delta_chunked(*problem(4), chunk_size=0)
