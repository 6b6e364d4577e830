"""The torch fast paths, with backward: ``scan_parallel`` (log depth), ``scan_chunked`` (chunks in parallel). Shapes:
transitions (B, T, H, b, b), inputs (B, T, H, b), initial_state (B, H, b) -> states (B, T, H, b), final (B, H, b)."""

from __future__ import annotations

import torch

from model.ops.scan.reference import scan_sequential, scan_step, step_through
from model.ops.scan.signature import ScanResult, scan_signature


@scan_signature
def scan_parallel(transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor) -> ScanResult:
    """Log-depth associative scan. Shapes as in the module docstring."""
    first = scan_step(transitions[:, 0], inputs[:, 0], initial_state)  # (B, H, b): h_0 folded into b_1
    states = _parallel_from_zero(transitions, torch.cat([first.unsqueeze(1), inputs[:, 1:]], dim=1))
    return states, states[:, -1]  # (B, T, H, b), (B, H, b)


def _parallel_from_zero(transitions: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    """States from h_0 = 0: pairs (2i, 2i+1) compose into one step whose scan gives the odd states; each even state is
    one step further."""
    length = inputs.shape[1]
    if length == 1:
        return inputs  # (B, 1, H, b)
    pairs = length // 2
    # the pair products go straight into the recursion: each level holds only its own, ~2x the input in all
    odd_states = _parallel_from_zero(*_compose_pairs(transitions[:, : 2 * pairs], inputs[:, : 2 * pairs]))
    later_even = scan_step(transitions[:, 2::2], inputs[:, 2::2], odd_states[:, : (length - 1) // 2])
    even_states = torch.cat([inputs[:, :1], later_even], dim=1)  # (B, ceil(T/2), H, b)
    interleaved = torch.stack([even_states[:, :pairs], odd_states], dim=2).flatten(1, 2)  # (B, 2 pairs, H, b)
    return torch.cat([interleaved, even_states[:, pairs:]], dim=1)  # (B, T, H, b)


def _compose_pairs(transitions: torch.Tensor, inputs: torch.Tensor) -> ScanResult:
    odd_a = transitions[:, 1::2].contiguous()  # (B, P, H, b, b): copied once, used twice
    return torch.matmul(odd_a, transitions[:, 0::2]), scan_step(odd_a, inputs[:, 1::2], inputs[:, 0::2])


@scan_signature
def scan_chunked(
    transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor, chunk_size: int = 64
) -> ScanResult:
    """Sequential inside chunks (all chunks at once), parallel across them."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    batch, length, heads, block = inputs.shape
    num_chunks = length // chunk_size
    if num_chunks == 0:
        return scan_sequential(transitions, inputs, initial_state)
    whole = num_chunks * chunk_size
    chunk_a = transitions[:, :whole].reshape(batch, num_chunks, chunk_size, heads, block, block)
    chunk_b = inputs[:, :whole].reshape(batch, num_chunks, chunk_size, heads, block)
    starts = initial_state.unsqueeze(1)  # (B, 1, H, b)
    if num_chunks > 1:
        products, local_finals = _chunk_summaries(chunk_a[:, :-1], chunk_b[:, :-1])  # (B, n-1, H, b[, b])
        later_starts, _ = scan_parallel(products, local_finals, initial_state)  # (B, n-1, H, b)
        starts = torch.cat([starts, later_starts], dim=1)  # (B, n, H, b)
    states, _ = step_through(chunk_a, chunk_b, starts, time_dim=2)  # (B, n, chunk, H, b): all chunks at once
    states = states.reshape(batch, whole, heads, block)  # (B, whole, H, b)
    if whole == length:
        return states, states[:, -1]
    tail_states, final_state = scan_sequential(transitions[:, whole:], inputs[:, whole:], states[:, -1])
    return torch.cat([states, tail_states], dim=1), final_state  # (B, T, H, b), (B, H, b)


def _chunk_summaries(chunk_a: torch.Tensor, chunk_b: torch.Tensor) -> ScanResult:
    steps_a, steps_b = chunk_a.unbind(2), chunk_b.unbind(2)  # C x (B, n, H, b, b), C x (B, n, H, b)
    product, state = steps_a[0], steps_b[0]
    for transition, input in zip(steps_a[1:], steps_b[1:]):
        product = torch.matmul(transition, product)  # (B, n, H, b, b)
        state = scan_step(transition, input, state)  # (B, n, H, b)
    return product, state
