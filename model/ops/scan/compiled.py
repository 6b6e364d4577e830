"""``scan_compiled``: the scan as a compiled loop with its backward (numba, float32 CPU tensors; model/ops/cpu/)."""

from __future__ import annotations

import torch

from model.ops.cpu import cpu_decode
from model.ops.scan.signature import ScanResult


def scan_compiled(
    transitions: torch.Tensor, inputs: torch.Tensor, initial_state: torch.Tensor | None = None
) -> ScanResult:
    """The compiled reference loop with its backward; float32 CPU tensors and numba, else ValueError."""
    result = cpu_decode.linear_scan(transitions, inputs, initial_state)
    if result is None:
        raise ValueError(
            "the compiled scan takes float32 CPU tensors of matching shapes and at least one step, with numba "
            "installed; use a torch scan"
        )
    return result
