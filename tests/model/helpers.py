"""Helpers that more than one test module of tests/model uses: the batching and cost checks every architecture
passes (test_models, test_exact), the inputs and reference comparisons of Sliding-Dilated-Attention
(test_dilated_attention, test_cuda) and of the linear scans (test_linear_scan, test_cuda)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from model.base import SequenceModel
from model.cache import InferenceCache
from model.ops.attention.banded import dilated_attention_banded
from model.ops.attention.gathered import dilated_attention_fast
from model.ops.attention.reference import dilated_attention_reference
from model.ops.scan.constraints import column_norm_constraint
from model.ops.scan.parallel import scan_chunked, scan_parallel
from model.ops.scan.reference import scan_sequential, scan_step
from model.regulargpt.cache import adaptive_depth

# Rows of different lengths in one batch, and what calls cost (test_models, test_exact)

PROMPT_LENGTHS = (1, 5, 12)


def prefilled_alone(model: SequenceModel, prompts: list[torch.Tensor]) -> list[InferenceCache]:
    """One single-row cache per prompt (1, n), each prefilled alone."""
    caches = []
    for prompt in prompts:
        caches.append(model.new_cache(batch_size=1))
        model(prompt, cache=caches[-1])
    return caches


def stack(caches: list[InferenceCache]) -> InferenceCache:
    """As a server stacks caches: through the first one's class, whichever it is."""
    return type(caches[0]).stack(caches)


def run_chunk_then_steps(
    model: SequenceModel, cache: InferenceCache, chunk: torch.Tensor, steps: torch.Tensor
) -> torch.Tensor:
    """chunk (B, Tc) through ``cache`` in one cached forward, then steps (B, Ts) one at a time -> (B, Tc + Ts, V)."""
    logits = [model(chunk, cache=cache)] + [model.step(steps[:, t], cache)[:, None] for t in range(steps.shape[1])]
    return torch.cat(logits, dim=1)


def assert_rows_of_different_lengths_run_as_alone(model: SequenceModel, vocab: int) -> None:
    """Prompts of PROMPT_LENGTHS, each prefilled alone, then stacked: a chunk of 4 tokens through the stacked
    cache, then 5 steps, give each row the logits (1e-9) of the same tokens run through its own cache."""
    prompts = [torch.randint(0, vocab, (1, n)).to(model.device) for n in PROMPT_LENGTHS]
    chunk = torch.randint(0, vocab, (len(prompts), 4)).to(model.device)
    steps = torch.randint(0, vocab, (len(prompts), 5)).to(model.device)
    with torch.no_grad():
        alone = prefilled_alone(model, prompts)
        stacked = stack(alone)
        assert stacked.lengths.tolist() == list(PROMPT_LENGTHS)
        together = run_chunk_then_steps(model, stacked, chunk, steps)  # (3, 9, V)
        for row, cache in enumerate(alone):
            expected = run_chunk_then_steps(model, cache, chunk[row : row + 1], steps[row : row + 1])  # (1, 9, V)
            torch.testing.assert_close(together[row : row + 1], expected, rtol=1e-9, atol=1e-9)
    assert stacked.lengths.tolist() == [n + 9 for n in PROMPT_LENGTHS]


def assert_select_split_stack_round_trip(model: SequenceModel, vocab: int, padded: bool) -> None:
    """select copies rows in any order, split and re-stack give back the same rows; a stack of caches of one
    layout holds the sum of their bytes, one of rows of different lengths too, or more for a ``padded`` layout."""
    prompts = [torch.randint(0, vocab, (1, n)) for n in PROMPT_LENGTHS]
    steps = torch.randint(0, vocab, (len(prompts), 3))
    order = [2, 0, 1]
    with torch.no_grad():
        stacked = stack(prefilled_alone(model, prompts))
        reordered, restacked = stacked.select(order), stack(stacked.split())
        assert reordered.lengths.tolist() == [12, 1, 5] and restacked.lengths.tolist() == list(PROMPT_LENGTHS)
        middle = reordered.select([2])
        assert stack([middle, middle.clone()]).nbytes == 2 * middle.nbytes
        parts = sum(cache.nbytes for cache in stacked.split())
        assert stacked.nbytes > parts if padded else stacked.nbytes == parts
        for t in range(3):
            expected = model.step(steps[:, t], stacked)  # (3, V)
            reordered_logits = model.step(steps[order, t], reordered)
            torch.testing.assert_close(reordered_logits, expected[order], rtol=1e-9, atol=1e-9)
            torch.testing.assert_close(model.step(steps[:, t], restacked), expected, rtol=1e-9, atol=1e-9)
    assert stacked.lengths.tolist() == restacked.lengths.tolist() == [n + 3 for n in PROMPT_LENGTHS]
    assert middle.lengths.tolist() == [5]  # untouched by the steps of the cache it was selected from


def counted_flops(call: Callable[[], object]) -> float:
    """Multiply-adds of ``call`` as torch's FlopCounterMode counts them (matrix products; SDPA through its math
    path, whose products it sees)."""
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        call()
    return counter.get_total_flops() / 2


def measured_peak_bytes(call: Callable[[], object]) -> int:
    """The most bytes that tensors created by ``call`` held at once on the CPU, from torch.profiler's memory
    timeline (private API: the test skips where it is missing). Tensors that existed before (weights, caches,
    inputs) are not counted, nor are their frees."""
    memory_profiler = pytest.importorskip("torch.profiler._memory_profiler")
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        call()
    created, live, peak = set(), 0, 0
    for _, action, (key, _), size in prof._memory_profile().timeline:
        if action == memory_profiler.Action.CREATE:
            created.add(key)
            live += size
        elif action == memory_profiler.Action.DESTROY and key in created:
            live -= size
        peak = max(peak, live)
    return peak


# Sliding-Dilated-Attention against its T x T reference (test_dilated_attention, test_cuda)

INPUT_NAMES = ("q", "k", "v", "relative_bias", "null_key", "null_value")
FAST_OPS = pytest.mark.parametrize("op", [dilated_attention_fast, dilated_attention_banded], ids=["fast", "banded"])


def make_inputs(batch: int, heads: int, length: int, chunk_size: int, dtype: torch.dtype, null: bool = False):
    """(q, k, v, relative_bias), then (null_key, null_value) if ``null``; head_dim 4."""
    shapes = [(batch, heads, length, 4)] * 3 + [(heads, chunk_size)] + [(heads, 4)] * (2 if null else 0)
    return tuple(torch.randn(shape, dtype=dtype, requires_grad=True) for shape in shapes)


def attend(op, inputs, chunk_size: int, dilation: int, key_offset=None) -> torch.Tensor:
    q, k, v, relative_bias, *null = inputs
    return op(q, k, v, relative_bias, chunk_size, dilation, key_offset, *null)  # (B, H, T, hd)


def values_and_grads(op, inputs, chunk_size: int, dilation: int, key_offset=None):
    out = attend(op, inputs, chunk_size, dilation, key_offset)  # (B, H, T, hd)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype).to(out.device)
    grads = torch.autograd.grad((out * weights).sum(), inputs)
    return out, grads


def assert_agree(op, inputs, chunk_size: int, dilation: int, key_offset=None, **tolerance) -> None:
    fast = values_and_grads(op, inputs, chunk_size, dilation, key_offset)
    reference = values_and_grads(dilated_attention_reference, inputs, chunk_size, dilation, key_offset)
    assert_close(fast, reference, **tolerance)


def assert_close(fast, reference, **tolerance) -> None:
    """Values and the gradients of every input (from :func:`values_and_grads`) agree."""
    torch.testing.assert_close(fast[0], reference[0], **tolerance)
    for name, fast_grad, reference_grad in zip(INPUT_NAMES, fast[1], reference[1]):
        torch.testing.assert_close(fast_grad, reference_grad, **tolerance, msg=lambda m, name=name: f"grad {name}: {m}")


def dilations(length: int, chunk_size: int) -> list[int]:
    """Every dilation the model uses at this length, and the first at which a position sees only itself."""
    return [chunk_size**layer for layer in range(adaptive_depth(length - 1, chunk_size) + 1)]


# The linear scans against a step-by-step loop (test_linear_scan, test_cuda)

BATCH, HEADS, BLOCK = 2, 2, 3
CHUNK_SIZES = [1, 3, 4, 16, 64]  # divide some of the lengths below and not others


def make_problem(length: int, dtype: torch.dtype, batch: int = BATCH) -> tuple[torch.Tensor, ...]:
    """Random transitions inside the norm constraint, inputs and an initial state, all requiring grad."""
    transitions = column_norm_constraint(torch.randn(batch, length, HEADS, BLOCK, BLOCK, dtype=dtype))
    inputs = torch.randn(batch, length, HEADS, BLOCK, dtype=dtype)
    initial_state = torch.randn(batch, HEADS, BLOCK, dtype=dtype)
    return tuple(t.requires_grad_() for t in (transitions, inputs, initial_state))


def step_loop(transitions, inputs, initial_state):
    """The recurrence written out with ``scan_step``: the reference every implementation is checked against."""
    state, states = initial_state, []
    for transition, input in zip(transitions.unbind(1), inputs.unbind(1)):
        state = scan_step(transition, input, state)
        states.append(state)
    return torch.stack(states, dim=1), state


def implementations():
    yield "sequential", scan_sequential
    yield "parallel", scan_parallel
    for chunk_size in CHUNK_SIZES:
        yield f"chunked-{chunk_size}", lambda *args, c=chunk_size: scan_chunked(*args, chunk_size=c)


def outputs_and_gradients(scan, problem):
    """(states, final_state, d/d transitions, d/d inputs, d/d initial_state) of a fixed random loss."""
    states, final_state = scan(*problem)
    weights = torch.linspace(-1, 1, states.numel(), dtype=states.dtype, device=states.device).view_as(states)
    loss = (states * weights).sum() + final_state.square().sum()
    return (states.detach(), final_state.detach(), *torch.autograd.grad(loss, problem))
