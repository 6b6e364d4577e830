"""The reference scan, h_t = A_t h_{t-1} + b_t one step at a time, which every fast path equals: transitions
(B, T, H, b, b), inputs (B, T, H, b), initial_state (B, H, b) -> states (B, T, H, b), final_state (B, H, b)."""

from __future__ import annotations

import torch

from model.ops.scan.signature import ScanResult, scan_signature


def scan_step(transition: torch.Tensor, input: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """One step: transition (B, H, b, b), input (B, H, b), state (B, H, b) -> A state + input (B, H, b)."""
    return torch.matmul(transition, state.unsqueeze(-1)).squeeze(-1) + input  # (B, H, b)


@scan_signature
def scan_sequential(transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor) -> ScanResult:
    """The reference: T steps of ``scan_step``. Shapes as in the module docstring."""
    return step_through(transitions, inputs, initial_state, time_dim=1)


def step_through(transitions: torch.Tensor, inputs: torch.Tensor, state: torch.Tensor, time_dim: int) -> ScanResult:
    states = []
    # unbind, not transitions[:, t]: its backward is one stack, where T selects would each fill a zero (B, T, ...)
    for transition, input in zip(transitions.unbind(time_dim), inputs.unbind(time_dim)):
        state = scan_step(transition, input, state)  # (..., ..., b)
        states.append(state)
    return torch.stack(states, dim=time_dim), state
