"""``ScanResult`` and ``scan_signature``, the check every ``scan_<impl>`` passes through: shapes, zeros for a missing
initial_state, the work in at least float32 (``compute_dtype``), the results in the input dtype."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

ScanResult = tuple[torch.Tensor, torch.Tensor]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def scan_signature(scan: Callable[..., ScanResult]) -> Callable[..., ScanResult]:

    @functools.wraps(scan)
    def checked(
        transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None = None, **kwargs: Any
    ) -> ScanResult:
        batch, length, heads, block = inputs.shape
        if transitions.shape != (batch, length, heads, block, block):
            raise ValueError(
                f"transitions must have shape {(batch, length, heads, block, block)} to match inputs "
                f"{tuple(inputs.shape)}, got {tuple(transitions.shape)}"
            )
        if length == 0:
            raise ValueError("the scan needs at least one time step")
        dtype = compute_dtype(inputs.dtype)
        if initial_state is None:
            initial_state = inputs.new_zeros((batch, heads, block), dtype=dtype)
        elif initial_state.shape != (batch, heads, block):
            raise ValueError(f"initial_state must have shape {(batch, heads, block)}, got {tuple(initial_state.shape)}")
        states, final_state = scan(transitions.to(dtype), inputs.to(dtype), initial_state.to(dtype), **kwargs)
        return states.to(inputs.dtype), final_state.to(inputs.dtype)

    return checked
