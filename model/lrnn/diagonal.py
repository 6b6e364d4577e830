"""Diagonal, input-independent LRNN baseline (LRU-style): per layer ``state_size`` complex eigenvalues lambda =
exp(-exp(nu) + i theta), x_k = lambda x_{k-1} + sqrt(1 - |lambda|^2) B u_k, y_k = Re(C x_k) + D u_k, each as a 2 x 2
rotation-scaling block on the block-diagonal LRNN's scan."""

from __future__ import annotations

import math

import torch
from torch import nn

from model.config import DiagonalLRNNConfig
from model.lrnn.model import LinearRNN
from model.lrnn.recurrence import Recurrence

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
        """u (..., d_model) -> lambda's blocks (..., N, 2, 2), a stride-0 view."""
        radius = torch.exp(-torch.exp(self.nu))  # (N,)
        cos, sin = radius * torch.cos(self.theta), radius * torch.sin(self.theta)  # (N,), (N,)
        blocks: torch.Tensor = torch.stack([cos, -sin, sin, cos], dim=-1).unflatten(-1, (2, 2))  # (N, 2, 2)
        return blocks.expand(*u.shape[:-1], *blocks.shape)  # (..., N, 2, 2)

    def inputs(self, u: torch.Tensor) -> torch.Tensor:
        gamma = torch.sqrt(-torch.expm1(-2 * torch.exp(self.nu)))  # (N,): sqrt(1 - |lambda|^2)
        projected: torch.Tensor = self.input_proj(u).unflatten(-1, self.state_shape)  # (..., N, 2)
        return projected * gamma.unsqueeze(-1)

    def readout(self, states: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        read: torch.Tensor = self.out_proj(states.flatten(-2))
        return read + self.skip * u  # (..., d_model)


class DiagonalLRNN(LinearRNN):
    def __init__(self, config: DiagonalLRNNConfig) -> None:
        super().__init__(config, [DiagonalRecurrence(config) for _ in range(config.n_layers)])
