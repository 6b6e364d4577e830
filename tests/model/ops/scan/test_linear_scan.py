"""The linear-scan implementations agree with a step-by-step loop: states, final states and gradients."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.ops.cpu import cpu_decode
from model.ops.scan.compiled import scan_compiled
from model.ops.scan.constraints import (
    column_divisors,
    column_norm_constraint,
    column_sparsemax,
    orthogonal_constraint,
    spectral_norm_constraint,
)
from model.ops.scan.dispatch import choose_scan_impl, linear_scan
from model.ops.scan.parallel import scan_parallel
from model.ops.scan.reference import scan_sequential
from model.ops.scan.triton import available as triton_available
from tests.model.helpers import BATCH, BLOCK, HEADS, implementations, make_problem, outputs_and_gradients, step_loop

TOLERANCE = {torch.float64: {"rtol": 1e-10, "atol": 1e-10}, torch.float32: {"rtol": 1e-4, "atol": 1e-5}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("length", [1, 2, 3, 7, 64, 100, 1000, 10000])
def test_implementations_agree_with_step_loop(length: int, dtype: torch.dtype) -> None:
    problem = make_problem(length, dtype)
    expected = outputs_and_gradients(step_loop, problem)
    names = ["states", "final_state", "grad transitions", "grad inputs", "grad initial_state"]
    for impl, scan in implementations():
        actual = outputs_and_gradients(scan, problem)
        for name, got, want in zip(names, actual, expected):
            torch.testing.assert_close(
                got, want, **TOLERANCE[dtype], msg=lambda m, impl=impl, name=name: f"{impl} {name}: {m}"
            )


def test_missing_initial_state_means_zeros() -> None:
    transitions, inputs, _ = make_problem(9, torch.float64)
    zeros = torch.zeros(BATCH, HEADS, BLOCK, dtype=torch.float64)
    for impl, scan in implementations():
        for got, want in zip(scan(transitions, inputs), step_loop(transitions, inputs, zeros)):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m, impl=impl: f"{impl}: {m}")


def test_transitions_expanded_over_batch_and_time() -> None:
    """The diagonal LRNN passes one set of blocks expanded (stride 0) over batch and time."""
    blocks = column_norm_constraint(torch.randn(HEADS, BLOCK, BLOCK, dtype=torch.float64))
    transitions = blocks.expand(BATCH, 37, HEADS, BLOCK, BLOCK)
    inputs = torch.randn(BATCH, 37, HEADS, BLOCK, dtype=torch.float64)
    expected = step_loop(transitions, inputs, torch.zeros(BATCH, HEADS, BLOCK, dtype=torch.float64))
    for impl, scan in implementations():
        for got, want in zip(scan(transitions, inputs), expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12, msg=lambda m, impl=impl: f"{impl}: {m}")


@pytest.mark.parametrize("impl", ["sequential", "parallel", "chunked"])
def test_bfloat16_runs_close_to_float32(impl: str) -> None:
    transitions, inputs, initial_state = (t.detach() for t in make_problem(100, torch.float32))
    reference, reference_final = step_loop(transitions, inputs, initial_state)
    low = (t.bfloat16() for t in (transitions, inputs, initial_state))
    states, final_state = linear_scan(*low, impl=impl, chunk_size=16)
    assert states.dtype == final_state.dtype == torch.bfloat16
    torch.testing.assert_close(states.float(), reference, rtol=0.05, atol=0.05)
    torch.testing.assert_close(final_state.float(), reference_final, rtol=0.05, atol=0.05)


def test_auto_dispatches_to_a_named_implementation() -> None:
    problem = [t.detach() for t in make_problem(100, torch.float64)]
    expected = step_loop(*problem)
    for got, want in zip(linear_scan(*problem, impl="auto"), expected):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="unknown scan impl"):
        linear_scan(*problem, impl="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("batch", "length", "device", "expected"),
    [
        (1, 500, "cpu", "chunked"),  # batch x heads <= 32 on the CPU
        (64, 500, "cpu", "sequential"),
        (64, 65536, "cuda", "chunked"),  # 8 GiB of float32 transitions
        (64, 8192, "cuda", "chunked"),  # 1 GiB
        (64, 500, "cuda", "parallel"),
        (1, 65536, "cuda", "parallel"),
    ],
)
def test_auto_policy_without_triton_or_the_compiled_loop(batch: int, length: int, device: str, expected: str) -> None:
    assert choose_scan_impl(batch, length, 8, 8, torch.device(device), triton=False, compiled=False) == expected


@pytest.mark.skipif(not triton_available(), reason="needs the triton package")
def test_auto_policy_takes_triton_on_cuda_where_it_runs() -> None:
    cuda = torch.device("cuda")
    assert choose_scan_impl(64, 65536, 8, 8, cuda) == "triton"
    assert choose_scan_impl(1, 500, 8, 16, cuda) == "triton"
    assert choose_scan_impl(1, 500, 8, 17, cuda) == "parallel"  # blocks of at most 16
    assert choose_scan_impl(8192, 500, 8, 8, cuda) == "chunked"  # at most 65,535 rows x heads; 8 GiB
    assert choose_scan_impl(1, 500, 8, 8, torch.device("cpu"), compiled=False) == "chunked"  # CUDA only


def test_shape_mismatch_is_refused() -> None:
    transitions, inputs, _ = make_problem(5, torch.float64)
    with pytest.raises(ValueError, match="transitions must have shape"):
        scan_parallel(transitions[:, :4], inputs)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        scan_sequential(transitions, inputs, torch.zeros(BATCH, HEADS, BLOCK + 1, dtype=torch.float64))


@pytest.mark.parametrize("p", [1.0, 1.2, 2.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_column_norm_constraint(p: float, dtype: torch.dtype) -> None:
    scale = torch.tensor([0.01, 0.1, 1.0, 10.0]).repeat(50)  # (200,): columns inside and outside the ball
    matrices = (torch.randn(200, 4, 4) * scale.view(200, 1, 1)).to(dtype)  # (200, b, b)
    constrained = column_norm_constraint(matrices, p)
    assert constrained.dtype == dtype
    norms = torch.linalg.vector_norm(constrained.double(), ord=p, dim=-2)  # (200, b): one per column
    assert bool((norms <= 1 + {torch.bfloat16: 1e-2}.get(dtype, 1e-6)).all())
    inside = torch.linalg.vector_norm(matrices.double(), ord=p, dim=-2) <= 1  # (200, b)
    assert bool(inside.any()) and bool((~inside).any())
    torch.testing.assert_close(
        constrained.transpose(-1, -2)[inside], matrices.transpose(-1, -2)[inside], rtol=0, atol=0
    )


@pytest.mark.parametrize("p", [1.0, 1.2, 2.0, 3.5])
def test_column_norm_constraint_equals_the_reference_formula(p: float) -> None:
    """v / max(1, ||v||_p) with torch.linalg.vector_norm (the LRNN paper's eq. 6, written plainly)."""
    matrices = torch.randn(300, 5, 5, dtype=torch.float64) * torch.tensor([0.05, 0.5, 5.0]).repeat(100).view(300, 1, 1)
    reference = matrices / torch.linalg.vector_norm(matrices, ord=p, dim=-2, keepdim=True).clamp(min=1.0)
    torch.testing.assert_close(column_norm_constraint(matrices, p), reference, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_column_divisors_are_max_one_and_the_column_norm(dtype: torch.dtype) -> None:
    """What the LRNN's fused step divides the state by; ``column_norm_constraint`` divides the columns by it."""
    matrices = torch.randn(300, 5, 5, dtype=torch.float64) * torch.tensor([0.05, 5.0]).repeat(150).view(300, 1, 1)
    divisors = column_divisors(matrices.to(dtype), 1.2)
    assert divisors.shape == (300, 1, 5) and divisors.dtype == torch.promote_types(dtype, torch.float32)
    reference = torch.linalg.vector_norm(matrices.to(dtype).double(), ord=1.2, dim=-2, keepdim=True).clamp(min=1.0)
    torch.testing.assert_close(divisors.double(), reference, rtol={torch.bfloat16: 1e-5}.get(dtype, 1e-12), atol=0)


def test_column_norm_constraint_gradient_is_finite_at_zero_entries() -> None:
    matrices = torch.tensor([[[0.0, 3.0], [0.0, 0.0]]], requires_grad=True)  # a zero column, a zero entry
    column_norm_constraint(matrices).sum().backward()
    assert torch.isfinite(matrices.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_spectral_norm_closed_form_equals_svd(dtype: torch.dtype) -> None:
    scale = torch.tensor([0.05, 0.5, 1.0, 5.0]).repeat(100).view(400, 1, 1)
    matrices = (torch.randn(400, 2, 2, dtype=torch.float64) * scale).to(dtype)  # inside and outside the ball
    rotations = torch.tensor([[0.309017, -0.951057], [0.951057, 0.309017]], dtype=dtype) * torch.tensor(
        [0.5, 1.0, 3.0], dtype=dtype
    ).view(3, 1, 1)  # scaled rotations: two equal singular values
    matrices = torch.cat([matrices, rotations])
    svd = spectral_norm_constraint(matrices, impl="svd")
    tolerance = {torch.float32: 1e-5, torch.float64: 1e-10}[dtype]
    closed_form = spectral_norm_constraint(matrices, impl="closed_form")
    torch.testing.assert_close(closed_form, svd, rtol=tolerance, atol=tolerance)
    norms = torch.linalg.matrix_norm(svd.double(), ord=2)
    assert bool((norms <= 1 + tolerance).all())
    inside = torch.linalg.matrix_norm(matrices.double(), ord=2) <= 1
    assert bool(inside.any()) and bool((~inside).any())
    torch.testing.assert_close(svd[inside], matrices[inside], rtol=0, atol=0)  # unchanged inside the ball
    torch.testing.assert_close(
        svd[-1].double() @ svd[-1].double().T, torch.eye(2, dtype=torch.float64), rtol=1e-5, atol=1e-5
    )  # a rotation stays a rotation


def test_spectral_norm_constraint_bounds_products_and_keeps_gradients_finite() -> None:
    blocks = (torch.randn(64, 3, 3, dtype=torch.float64) * 3).requires_grad_()  # svd path (b = 3)
    constrained = spectral_norm_constraint(blocks)
    product = torch.linalg.multi_dot(list(constrained.detach()))
    assert float(torch.linalg.matrix_norm(product, ord=2)) <= 1 + 1e-9  # non-expanding at any length
    constrained.sum().backward()
    assert torch.isfinite(blocks.grad).all()
    degenerate = (0.9 * torch.eye(2)).expand(4, 2, 2).clone().requires_grad_()  # equal singular values
    for blocks in (degenerate, (2 * degenerate.detach()).requires_grad_()):
        spectral_norm_constraint(blocks, impl="closed_form").sum().backward()
        assert torch.isfinite(blocks.grad).all()
    with pytest.raises(ValueError, match="2 x 2"):
        spectral_norm_constraint(torch.zeros(3, 3), impl="closed_form")


@pytest.mark.parametrize("size", [2, 3, 5, 8])
def test_orthogonal_newton_schulz_equals_the_svd_polar_factor(size: int) -> None:
    generator = torch.Generator().manual_seed(size)
    scale = torch.tensor([0.01, 1.0, 100.0]).repeat(200).view(600, 1, 1)
    matrices = torch.randn(600, size, size, generator=generator) * scale
    near = 0.9 * torch.eye(size) + 0.02 * torch.randn(100, size, size, generator=generator)  # as training starts
    flip = torch.diag(torch.tensor([-1.0] + [1.0] * (size - 1)))  # a reflection: determinant -1 is kept
    matrices = torch.cat([matrices, near, flip[None]])
    smallest = torch.linalg.svdvals(matrices)[:, -1] / torch.linalg.matrix_norm(matrices)
    kept = smallest > 1e-3  # full rank, far enough from singular for the iteration's bound
    fast, svd = orthogonal_constraint(matrices[kept]), orthogonal_constraint(matrices[kept], impl="svd")
    torch.testing.assert_close(fast, svd, rtol=0, atol=1e-5)
    gram = fast.transpose(-1, -2) @ fast
    torch.testing.assert_close(gram, torch.eye(size).expand_as(gram), rtol=0, atol=1e-6)
    torch.testing.assert_close(orthogonal_constraint(flip), flip, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="newton_schulz or svd"):
        orthogonal_constraint(matrices, impl="qr")  # type: ignore[arg-type]


def test_orthogonal_constraint_keeps_norms_over_long_products_and_gradients_finite() -> None:
    blocks = (0.9 * torch.eye(5) + 0.05 * torch.randn(5000, 5, 5)).requires_grad_()
    constrained = orthogonal_constraint(blocks)
    state = torch.ones(5) / 5**0.5
    for block in constrained.detach():
        state = block @ state
    assert abs(float(state.norm()) - 1) < 1e-3  # 5,000 steps: no decay, no growth
    constrained.sum().backward()
    assert torch.isfinite(blocks.grad).all()
    repeated = (0.5 * torch.eye(3)).expand(4, 3, 3).clone().requires_grad_()  # equal singular values: svd's gradient
    orthogonal_constraint(repeated).sum().backward()  # is undefined there, the iteration's is not
    assert torch.isfinite(repeated.grad).all()
    assert orthogonal_constraint(torch.randn(2, 4, 4, dtype=torch.float64)).dtype == torch.float64


def test_orthogonal_constraint_gives_a_block_the_same_bits_beside_any_others() -> None:
    """A batch's blocks converge in different numbers of steps; each stops at its own, so a served row's transitions do
    not depend on the other rows in its batch."""
    near = 0.9 * torch.eye(5) + 0.02 * torch.randn(8, 5, 5)  # converges in a few steps
    far = torch.randn(8, 5, 5) * torch.tensor([1.0, 1.0, 1.0, 1.0, 1e-3])  # a small singular value: many steps
    alone = orthogonal_constraint(near)
    beside = orthogonal_constraint(torch.cat([near, far]))[:8]
    assert torch.equal(alone, beside)


def simplex_projection(column: torch.Tensor) -> torch.Tensor:
    """The reference: argmin ||p - v|| over the simplex is max(v - tau, 0), tau found by bisection on sum = 1."""
    low, high = float(column.min()) - 1, float(column.max())
    for _ in range(200):
        tau = (low + high) / 2
        low, high = (tau, high) if float((column - tau).clamp(min=0).sum()) > 1 else (low, tau)
    return (column - (low + high) / 2).clamp(min=0)


@pytest.mark.parametrize("scale", [0.1, 1.0, 10.0])
def test_column_sparsemax_is_the_projection_onto_the_simplex(scale: float) -> None:
    matrices = torch.randn(6, 5, 5, dtype=torch.float64) * scale
    projected = column_sparsemax(matrices)  # (6, 5, 5)
    for block, expected_block in zip(matrices, projected):
        for j in range(5):
            torch.testing.assert_close(expected_block[:, j], simplex_projection(block[:, j]), rtol=0, atol=1e-12)
    assert column_sparsemax(matrices.float()).dtype == torch.float32


def test_column_sparsemax_reaches_exact_zeros_and_has_the_sparsemax_jacobian() -> None:
    deterministic = torch.tensor([[3.0, 0.0], [1.5, 0.2]])  # gaps of 1.5 and 0.2: one exact 0/1 column
    assert column_sparsemax(deterministic)[:, 0].tolist() == [1.0, 0.0]
    column = torch.tensor([0.5, 0.4, -2.0, 0.45], dtype=torch.float64)
    jacobian = torch.autograd.functional.jacobian(lambda v: column_sparsemax(v.unsqueeze(-1)).squeeze(-1), column)
    support = (column_sparsemax(column.unsqueeze(-1)).squeeze(-1) > 0).double()  # (4,)
    expected = torch.diag(support) - torch.outer(support, support) / support.sum()  # diag(s) - s s^T / |S|
    torch.testing.assert_close(jacobian, expected)


@pytest.mark.skipif(not cpu_decode.kernel_available(), reason="numba is not importable")
@pytest.mark.parametrize(
    ("batch", "length", "heads", "block"), [(1, 1, 1, 1), (2, 37, 3, 5), (3, 200, 2, 8), (1, 64, 4, 16)]
)
def test_the_compiled_scan_equals_the_loop_and_auto_takes_it_on_the_cpu(
    monkeypatch, batch, length, heads, block
) -> None:
    """The compiled loop (``cpu_decode.linear_scan``) equals ``scan_sequential`` up to float rounding, from a given
    initial state and from zeros, on contiguous and expanded (stride 0) transitions, and so do its gradients (the
    loop in reverse) of transitions, inputs and initial state; "auto" takes it for float32 CPU tensors, with a
    gradient or without, and a torch scan for float64."""
    generator = torch.Generator().manual_seed(length)
    transitions = column_norm_constraint(torch.randn(batch, length, heads, block, block, generator=generator))
    inputs = torch.randn(batch, length, heads, block, generator=generator)
    start = torch.randn(batch, heads, block, generator=generator)
    calls = []
    kernels = cpu_decode._kernels
    compiled = kernels.scan.states
    counted = kernels.scan._replace(states=lambda *arrays: calls.append(1) or compiled(*arrays))
    monkeypatch.setattr(cpu_decode, "_kernels", dataclasses.replace(kernels, scan=counted))
    for initial in (start, None):
        expected = scan_sequential(transitions, inputs, initial)
        for got, want in zip(linear_scan(transitions, inputs, initial), expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    shared = transitions[:1, :, :1].expand(batch, length, heads, block, block)  # stride 0 on B and H
    for got, want in zip(scan_compiled(shared, inputs, start), scan_sequential(shared, inputs, start)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(calls) == 3
    weights = torch.randn(batch, length, heads, block, generator=generator)  # a loss that weighs every state

    def gradients(scan) -> list[torch.Tensor]:
        leaves = [tensor.clone().requires_grad_() for tensor in (transitions, inputs, start)]
        states, final = scan(*leaves)
        ((states * weights).sum() + 3 * final.sum()).backward()
        return [leaf.grad for leaf in leaves]

    for got, want in zip(gradients(linear_scan), gradients(scan_sequential)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(calls) == 4
    linear_scan(transitions.double(), inputs.double(), start.double())
    assert len(calls) == 4
    with pytest.raises(ValueError, match="the compiled scan takes float32 CPU tensors"):
        scan_compiled(transitions.double(), inputs.double(), start.double())
