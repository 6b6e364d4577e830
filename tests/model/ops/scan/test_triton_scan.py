"""The Triton scan agrees with the reference loop: on CUDA compiled, elsewhere in Triton's interpreter (which
tests/conftest.py switches on where there is no CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from model.ops.scan import dispatch
from model.ops.scan.constraints import column_norm_constraint
from model.ops.scan.dispatch import linear_scan
from model.ops.scan.reference import scan_sequential
from model.ops.scan.triton import MAX_BLOCK, refusal, scan_triton

pytest.importorskip("triton")

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter is off (CUDA is present)"
        ),
    ),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


def make_problem(batch: int, length: int, heads: int, block: int, device: str, dtype=torch.float32):
    """Transitions inside the paper's norm constraint (states stay bounded), inputs and an initial state."""
    generator = torch.Generator().manual_seed(length * 1000 + block)
    transitions = column_norm_constraint(torch.randn(batch, length, heads, block, block, generator=generator))
    inputs = torch.randn(batch, length, heads, block, generator=generator)
    initial_state = torch.randn(batch, heads, block, generator=generator)
    return tuple(tensor.to(device=device, dtype=dtype) for tensor in (transitions, inputs, initial_state))


def assert_scan_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """float32 agreement up to the order of the sums: the chunked kernels add the same products in another order
    than the loop, so an element's error grows with the largest states, not with the element itself; a wrong product
    is off by O(1)."""
    scale = max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=2e-5 * scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("batch", "length", "heads", "block", "chunk_size"),
    [
        (1, 1, 1, 1, 4),  # one step
        (2, 7, 3, 5, 64),  # one short chunk, a block that is not a power of 2
        (2, 16, 2, 8, 16),  # exactly one chunk
        (2, 67, 3, 8, 16),  # four whole chunks and a short one
        (1, 96, 2, 4, 32),  # whole chunks only
        (3, 33, 2, MAX_BLOCK, 8),  # the largest block
        (1, 40, 1, 3, 1),  # chunks of one step
    ],
)
def test_agrees_with_the_reference_loop(device, batch, length, heads, block, chunk_size) -> None:
    transitions, inputs, initial_state = make_problem(batch, length, heads, block, device)
    expected_states, expected_final = scan_sequential(transitions, inputs, initial_state)
    states, final_state = scan_triton(transitions, inputs, initial_state, chunk_size=chunk_size)
    assert_scan_close(states, expected_states)
    assert_scan_close(final_state, expected_final)
    zero_start, _ = scan_triton(transitions, inputs, chunk_size=chunk_size)  # initial state None: zeros
    assert_scan_close(zero_start, scan_sequential(transitions, inputs)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_any_strides_and_half_precision(device) -> None:
    """A stride-0 expand of one transition per step, inputs viewed through a transpose, and bfloat16 in (float32
    inside, bfloat16 out), through ``linear_scan(impl="triton")``."""
    batch, length, heads, block = 2, 37, 3, 4
    transitions, inputs, initial_state = make_problem(1, length, 1, block, device)
    shared = transitions.expand(batch, length, heads, block, block)  # (B, T, H, b, b) with stride 0 on B and H
    inputs = torch.randn(batch, heads, length, block, device=device).transpose(1, 2)  # (B, T, H, b), not contiguous
    start = initial_state.expand(batch, heads, block)
    states, final_state = linear_scan(shared, inputs, start, impl="triton", chunk_size=8)
    expected_states, expected_final = scan_sequential(shared, inputs, start)
    assert_scan_close(states, expected_states)
    assert_scan_close(final_state, expected_final)
    half = [tensor.bfloat16() for tensor in (shared, inputs, start)]
    states, final_state = scan_triton(*half, chunk_size=8)
    expected_states, expected_final = scan_sequential(*half)  # the same: float32 inside, bfloat16 out
    assert states.dtype == final_state.dtype == torch.bfloat16
    torch.testing.assert_close(states, expected_states, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(final_state, expected_final, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_runs_triton_without_a_gradient_and_a_torch_scan_with_one(monkeypatch) -> None:
    transitions, inputs, initial_state = make_problem(2, 70, 3, 8, "cuda")
    taken = []
    monkeypatch.setattr(
        dispatch, "scan_triton", lambda *args, **kwargs: taken.append(1) or scan_triton(*args, **kwargs)
    )
    with torch.no_grad():
        states, _ = linear_scan(transitions, inputs, initial_state)
    assert taken == [1]
    assert_scan_close(states, scan_sequential(transitions, inputs, initial_state)[0])
    leaf = transitions.clone().requires_grad_()
    states, _ = linear_scan(leaf, inputs, initial_state)  # training: the parallel scan, with its backward
    states.sum().backward()
    assert taken == [1] and leaf.grad is not None
    assert_scan_close(states.detach(), scan_sequential(transitions, inputs, initial_state)[0])


def test_refuses_what_it_cannot_run(monkeypatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # CPU tensors pass the device check, also where CUDA is present
    transitions, inputs, initial_state = make_problem(1, 5, 1, 3, "cpu")
    cases = {
        "blocks of at most 16": make_problem(1, 2, 1, MAX_BLOCK + 1, "cpu"),
        "at most 65535 rows x heads": make_problem(65_536, 1, 1, 1, "cpu"),
        "float64": (transitions.double(), inputs.double(), initial_state.double()),
        "no backward": (transitions.clone().requires_grad_(), inputs, initial_state),
        "transitions must have shape": (transitions[:, :4], inputs, initial_state),
        "initial_state must have shape": (transitions, inputs, initial_state[:, :, :2]),
        "at least one time step": (transitions[:, :0], inputs[:, :0], initial_state),
    }
    for message, problem in cases.items():
        with pytest.raises(ValueError, match=message):
            scan_triton(*problem)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        scan_triton(transitions, inputs, initial_state, chunk_size=0)
    with torch.no_grad():  # without autograd a tensor that requires grad is fine
        assert refusal(transitions.clone().requires_grad_(), inputs, initial_state, 64) is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on CUDA tensors, got cpu"):
        scan_triton(transitions, inputs, initial_state)


COMPILE_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from model.ops.scan import triton_kernels as kernels

pointer, index = "*fp32", "i64"
signatures = {  # as launched by scan_triton: pointers, then sizes and strides (i64 covers both)
    kernels.chunk_summary_kernel: [pointer] * 4 + [index] * 13,
    kernels.chunk_starts_kernel: [pointer] * 3 + [index] * 3 + [pointer] + [index] * 3,
    kernels.chunk_states_kernel: [pointer] * 3 + [index] * 4 + [pointer] + [index] * 17,
}
for kernel, types in signatures.items():
    names = [name for name in kernel.arg_names if name != "BLOCK"]
    assert len(names) == len(types), (kernel.__name__, len(names), len(types))
    for block in (2, 8, 16):
        source = ASTSource(
            kernel,
            {**dict(zip(names, types)), "BLOCK": "constexpr"},
            constexprs={(kernel.arg_names.index("BLOCK"),): block},
        )
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], kernel.__name__
print("compiled")
"""


def test_the_kernels_compile_for_an_h100(tmp_path) -> None:
    """Without a GPU the interpreter checks what the kernels compute, not that Triton compiles them: this compiles
    each for sm_90 (Triton's own ptxas, no device needed), in a process where the interpreter is off."""
    environment = {
        **os.environ,
        "TRITON_INTERPRET": "0",
        "TRITON_DEFAULT_FP_FUSION": "1",
        "TRITON_CACHE_DIR": str(tmp_path),
    }
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_H100],
        capture_output=True,
        text=True,
        env=environment,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-3000:]
