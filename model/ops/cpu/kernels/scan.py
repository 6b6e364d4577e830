"""The linear scan's loop, its backward and its loop with state codes (``cpu_decode.linear_scan`` and
``cpu_decode.snapped_scan``), compiled by :func:`build_scan`."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import NamedTuple

import numpy as np

from model.ops.cpu.kernels.helpers import reassociating_jit


class Scan(NamedTuple):
    """The compiled scan kernels, each compiled on its first call."""

    states: Callable[..., None]  # scan_states(transitions, inputs, initial, states, final)
    backward: Callable[..., None]  # scan_backward(transitions, initial, states, grad_states, grad_final, ...)
    snapped: Callable[..., None]  # scan_snapped(transitions, inputs, initial, codes, every, offset, states, final)


def build_scan(numba: ModuleType) -> Scan:
    """The scan forward (every state and the last), backward (the loop in reverse) and forward with state codes, on
    float32 arrays."""
    jit = reassociating_jit(numba)

    @jit
    def scan_backward(
        transitions: np.ndarray,
        initial: np.ndarray,
        states: np.ndarray,
        grad_states: np.ndarray,
        grad_final: np.ndarray,
        grad_transitions: np.ndarray,
        grad_inputs: np.ndarray,
        grad_initial: np.ndarray,
    ) -> None:
        """``_CompiledScan``'s backward: the gradients of ``scan_states``' outputs in, of its inputs out."""
        batch, length, heads, size = states.shape
        carried = np.empty(size, dtype=np.float32)  # G_(t+1) carried back: A_(t+1)^T G_(t+1)
        back = np.empty(size, dtype=np.float32)  # A_t^T G_t: each sum over i in order, row by row
        for r in range(batch):
            for h in range(heads):
                carried[:] = grad_final[r, h]
                for t in range(length - 1, -1, -1):
                    before = states[r, t - 1, h] if t > 0 else initial[r, h]  # state_(t-1)
                    transition, grad_transition = transitions[r, t, h], grad_transitions[r, t, h]
                    back[:] = np.float32(0.0)
                    for i in range(size):  # (vectors along j: the rows of A_t and dA_t are contiguous)
                        g = carried[i] + grad_states[r, t, h, i]  # G_t[i]
                        grad_inputs[r, t, h, i] = g
                        for j in range(size):
                            grad_transition[i, j] = g * before[j]
                            back[j] += transition[i, j] * g
                    carried[:] = back
                grad_initial[r, h] = carried

    @jit
    def advance(
        transitions: np.ndarray,
        inputs: np.ndarray,
        r: int,
        h: int,
        start: int,
        end: int,
        state: np.ndarray,
        states: np.ndarray,
    ) -> None:
        """Row r, block h from ``state`` (b,) through positions start .. end - 1: each into ``states``, the last
        into ``state``."""
        size = state.shape[0]
        for t in range(start, end):
            for i in range(size):
                total = np.float32(0.0)
                for j in range(size):
                    total += transitions[r, t, h, i, j] * state[j]
                states[r, t, h, i] = total + inputs[r, t, h, i]
            state[:] = states[r, t, h]

    @jit
    def scan_states(
        transitions: np.ndarray, inputs: np.ndarray, initial: np.ndarray, states: np.ndarray, final: np.ndarray
    ) -> None:
        """state_t = A_t state_(t-1) + u_t: (B, T, H, b, b), (B, T, H, b), (B, H, b)
        -> states (B, T, H, b), final (B, H, b)."""
        batch, length, heads, size = inputs.shape
        state = np.empty(size, dtype=np.float32)
        for r in range(batch):
            for h in range(heads):
                state[:] = initial[r, h]
                advance(transitions, inputs, r, h, 0, length, state, states)
                final[r, h] = state

    @jit
    def used_codes(codes: np.ndarray, h: int) -> int:
        """How many of block h's codes (H, K, b) a search reads: its rows before the trailing copies of its first
        (``python -m training snap`` pads each block's codes to K so). A copy of the first never wins over it, so
        skipping them picks what the whole search picks."""
        count: int = codes.shape[1]
        while count > 1:
            for i in range(codes.shape[2]):
                if codes[h, count - 1, i] != codes[h, 0, i]:
                    return count
            count -= 1
        return count

    @jit
    def scan_snapped(
        transitions: np.ndarray,
        inputs: np.ndarray,
        initial: np.ndarray,
        codes: np.ndarray,
        every: int,
        offset: int,
        states: np.ndarray,
        final: np.ndarray,
    ) -> None:
        """``scan_states`` with state codes: after the symbol at t with (offset + t + 1) % every == 0, each block's
        state is replaced by its nearest row of codes (H, K, b) (squared distance, the first of equals; the trailing
        copies of a block's first row are not read: :func:`used_codes`)."""
        batch, length, heads, size = inputs.shape
        counts = np.empty(heads, dtype=np.int64)
        for h in range(heads):
            counts[h] = used_codes(codes, h)
        state = np.empty(size, dtype=np.float32)
        for r in range(batch):
            for h in range(heads):
                count = counts[h]
                state[:] = initial[r, h]
                start = 0
                while start < length:
                    end = min(length, start + every - (offset + start) % every)  # the next snap, or the end
                    advance(transitions, inputs, r, h, start, end, state, states)
                    if (offset + end) % every == 0:
                        best, nearest = np.float32(np.inf), 0
                        for k in range(count):
                            distance = np.float32(0.0)
                            for i in range(size):
                                difference = state[i] - codes[h, k, i]
                                distance += difference * difference
                            if distance < best:
                                best, nearest = distance, k
                        state[:] = codes[h, nearest]
                        states[r, end - 1, h] = state
                    start = end
                final[r, h] = state

    return Scan(scan_states, scan_backward, scan_snapped)
