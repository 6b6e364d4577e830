"""Diagonal, input-independent linear RNN: the LRU-style baseline of block-diagonal-lrnn.txt section 2.1.

Each layer has ``state_size`` complex eigenvalues lambda_n = exp(-exp(nu_n) + i theta_n), the same at every
time step:

    x_k = lambda * x_{k-1} + gamma * (B u_k)      gamma = sqrt(1 - |lambda|^2), B complex
    y_k = Re(C x_k) + D * u_k                     C complex, D a per-channel skip

Multiplying by a complex number r e^{i theta} is the 2 x 2 rotation-scaling block [[r cos, -r sin],
[r sin, r cos]] on (Re, Im), so the state is ``state_size`` blocks of size 2 and the layer runs on the same
``model.ops.linear_scan`` as the block-diagonal LRNN, its one (N, 2, 2) set of blocks broadcast over batch and
time with ``expand`` (no copy). The stack around it (pre-norm residual blocks, MLP, cache) is
``model.lrnn.model.LinearRNN``.

Initialisation follows the LRU: |lambda|^2 uniform in [MIN_RADIUS^2, MAX_RADIUS^2] and theta uniform in
[0, MAX_PHASE), i.e. uniform on a ring of the complex plane. The full phase range keeps lambda = -1 (the
sign flip that PARITY needs) within reach.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from model.config import DiagonalLRNNConfig
from model.lrnn.model import LinearRNN, Recurrence

MIN_RADIUS, MAX_RADIUS, MAX_PHASE = 0.9, 0.999, 2 * math.pi


class DiagonalRecurrence(Recurrence):
    """x_k = lambda x_{k-1} + gamma B u_k over ``state_size`` complex channels, read out as Re(C x) + D u."""

    def __init__(self, config: DiagonalLRNNConfig) -> None:
        super().__init__()
        self.state_shape = (config.state_size, 2)  # (N, 2): real and imaginary parts
        squared_radius = torch.empty(config.state_size).uniform_(MIN_RADIUS**2, MAX_RADIUS**2)  # (N,)
        self.nu = nn.Parameter(torch.log(-0.5 * torch.log(squared_radius)))  # (N,): |lambda| = exp(-exp(nu))
        self.theta = nn.Parameter(torch.empty(config.state_size).uniform_(0.0, MAX_PHASE))  # (N,)
        self.input_proj = nn.Linear(config.d_model, 2 * config.state_size, bias=False)  # B: (Re, Im) per channel
        self.out_proj = nn.Linear(2 * config.state_size, config.d_model, bias=False)  # Re(C x) on (Re, Im) pairs
        self.skip = nn.Parameter(torch.randn(config.d_model))  # D

    def transitions(self, u: torch.Tensor) -> torch.Tensor:
        """u: (..., d_model) -> the rotation-scaling blocks of lambda, (..., N, 2, 2), a stride-0 view over (...)."""
        radius = torch.exp(-torch.exp(self.nu))  # (N,)
        cos, sin = radius * torch.cos(self.theta), radius * torch.sin(self.theta)  # (N,), (N,)
        blocks = torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2))  # (N, 2, 2)
        return blocks.expand(*u.shape[:-1], *blocks.shape)  # (..., N, 2, 2)

    def inputs(self, u: torch.Tensor) -> torch.Tensor:
        """u: (..., d_model) -> gamma * B u as (Re, Im) pairs: (..., N, 2)."""
        gamma = torch.sqrt(-torch.expm1(-2 * torch.exp(self.nu)))  # (N,): sqrt(1 - |lambda|^2)
        return self.input_proj(u).unflatten(-1, self.state_shape) * gamma.unsqueeze(-1)  # (..., N, 2)

    def readout(self, states: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """states: (..., N, 2), u: (..., d_model) -> Re(C x) + D u: (..., d_model)."""
        return self.out_proj(states.flatten(-2)) + self.skip * u  # (..., d_model)


class DiagonalLRNN(LinearRNN):
    """The diagonal LRNN baseline: :class:`model.lrnn.model.LinearRNN` with :class:`DiagonalRecurrence` layers."""

    def __init__(self, config: DiagonalLRNNConfig) -> None:
        super().__init__(config, [DiagonalRecurrence(config) for _ in range(config.n_layers)])
