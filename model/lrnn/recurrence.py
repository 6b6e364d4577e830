"""The interface every linear RNN layer's recurrence offers to :class:`model.lrnn.model.RecurrentBlock`."""

from __future__ import annotations

import torch
from torch import nn

from model.ops.cpu.cpu_decode import linear
from model.ops.scan.reference import scan_step


class Recurrence(nn.Module):
    """h_k = A_k h_{k-1} + b_k over a ``state_shape`` (H, b) state, read out by ``readout``; a ``step`` override must
    equal the scan's update."""

    state_shape: tuple[int, int]
    out_proj: nn.Linear  # the readout's projection, counted in the cost of a layer's tail
    mixes = False  # True: the block runs :meth:`mix`, which never holds every state, in place of the scan
    snap_every = 0  # > 0: after every snap_every-th symbol the state is replaced by :meth:`snap`'s code
    state_codes: torch.Tensor  # (H, K, b) where snap_every > 0: the codes :meth:`snap` picks from

    def snap(self, state: torch.Tensor) -> torch.Tensor:
        """state (B, H, b) -> each block's nearest code (B, H, b); only where ``snap_every`` > 0."""
        raise NotImplementedError

    def transitions(self, u: torch.Tensor) -> torch.Tensor:
        """u: (..., d_model) -> A: (..., H, b, b)."""
        raise NotImplementedError

    def inputs(self, u: torch.Tensor) -> torch.Tensor:
        """u: (..., d_model) -> b: (..., H, b)."""
        raise NotImplementedError

    def coefficients(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u: (..., d_model) -> the scan's transitions (..., H, b, b) and inputs (..., H, b)."""
        return self.transitions(u), self.inputs(u)

    def step(self, u: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """u: (B, d_model), state: (B, H, b) -> the next state A(u) state + b(u): (B, H, b)."""
        return scan_step(*self.coefficients(u), state)

    def initial_state(self, rows: int) -> torch.Tensor:
        """h_0 of ``rows`` rows: (rows, H, b); zeros unless a recurrence learns it."""
        weight = next(self.parameters())
        return weight.new_zeros(rows, *self.state_shape)

    def for_serving(self, streaming: bool) -> bool:
        """Lay weights out for :meth:`step` (values unchanged); returns whether any moved."""
        return False

    def readout(self, states: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """states: (..., H, b), u: (..., d_model) -> (..., d_model)."""
        raise NotImplementedError

    def project_out(self, read: torch.Tensor) -> torch.Tensor:
        """``out_proj``: (..., H b) -> (..., d_model)."""
        return linear(read, self.out_proj.weight, self.out_proj.bias)

    def mix(
        self, u: torch.Tensor, state: torch.Tensor, impl: str, chunk_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where ``mixes``: u (B, T, d_model) from ``state`` (B, H, b) -> what ``out_proj`` reads at every position
        (B, T, H b) and the last state."""
        raise NotImplementedError

    def fused_step_weights(self) -> list[torch.Tensor] | None:
        """The tensors ``cpu_decode.lrnn_layer_step`` takes, or None where it cannot."""
        return None

    def joint_weight(self) -> torch.Tensor | None:
        """The matrix :meth:`for_serving` stacked the input-side weights into, or None."""
        return None
