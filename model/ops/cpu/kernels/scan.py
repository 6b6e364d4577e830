"""The linear scan's loop and its backward (``cpu_decode.linear_scan``), compiled by :func:`build_scan`."""

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


def build_scan(numba: ModuleType) -> Scan:
    """The scan forward (every state and the last) and backward (the loop in reverse), on float32 arrays."""
    jit = reassociating_jit(numba)

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
                for t in range(length):
                    for i in range(size):
                        total = np.float32(0.0)
                        for j in range(size):
                            total += transitions[r, t, h, i, j] * state[j]
                        states[r, t, h, i] = total + inputs[r, t, h, i]
                    state[:] = states[r, t, h]
                final[r, h] = state

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

    return Scan(scan_states, scan_backward)
