"""The delta-rule recurrence (DeltaNet: Schlag et al. 2021, Yang et al. 2024), an input-dependent linear RNN whose
transitions are generalised Householder matrices. Per head a b x b state S: S_k = S_{k-1} (I - beta k k^T) + beta v k^T
with unit-length keys and beta in [0, 2], so that every transition's eigenvalues lie in [-1, 1] (Grazzi et al. 2025);
it reads out S q. A token writes its value under its key, replacing what the key held: associative recall."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from model.config import LRNNConfig
from model.lrnn.recurrence import Recurrence
from model.ops.cpu.cpu_decode import linear
from model.ops.scan.delta import delta_chunked, delta_sequential, runs_sequential

BETA_BIAS = -1.0  # beta = 2 gate(-1) = 0.5 at initialisation, for the hard gate and (0.54) for the sigmoid


class DeltaRecurrence(Recurrence):
    """``num_blocks`` heads of a ``block_size`` x ``block_size`` state, held as (H b, b): row (h, i) is head h's value
    row i of S, over the key dimensions. One product of ``in_proj`` gives q, k, v and the write gate's logit z;
    beta = 2 gate(z). Served, gate(z) = clamp(z / 4 + 1 / 2, 0, 1), so that a token can write exactly nothing; while
    training it is lerp(that, sigmoid(z), ``softness``), as the trainer sets it, and with ``track_writes`` the gates'
    mean is kept for a penalty that closes the gates no answer needs (``--write-weight``). With ``short_conv`` K > 0,
    q, k and v are first convolved (:meth:`convolved`), and the state holds, after S's H b rows, the last K - 1
    positions' projections ((K - 1) 3 H rows of b), so that a chunk or a step goes on where the last one ended."""

    mixes = True

    def __init__(self, config: LRNNConfig) -> None:
        super().__init__()
        self.heads, self.size, self.taps = config.num_blocks, config.block_size, config.short_conv
        width = 3 * self.heads * self.size
        self.history_rows = max(self.taps - 1, 0) * 3 * self.heads  # the last K - 1 positions' q, k, v, in rows of b
        self.state_shape = (self.heads * self.size + self.history_rows, self.size)
        self.in_proj = nn.Linear(config.d_model, width + self.heads)  # [q; k; v; z]
        self.out_proj = nn.Linear(self.heads * self.size, config.d_model)
        if self.taps:  # weight (3 H b, 1, K), initialised as torch's depthwise Conv1d; applied by :meth:`convolved`
            self.conv = nn.Conv1d(width, width, self.taps, groups=width, bias=False)
        with torch.no_grad():
            self.in_proj.bias[-self.heads :] = BETA_BIAS
        self.softness = 0.0  # training mode only: the sigmoid's share of the gate (set by the trainer)
        self.track_writes = False  # training mode: keep the write gates' mean in ``writes`` (set by the trainer)
        self.writes: torch.Tensor | None = None  # () mean of beta / 2 over the last training call's tokens and heads

    def project(
        self, u: torch.Tensor, history: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """u (..., T, d_model) after ``history`` (:meth:`convolved`'s) -> unit q and k, v (..., T, H, b), beta
        (..., T, H) and the history after u (None without a short convolution)."""
        width = self.heads * self.size
        projected = linear(u, self.in_proj.weight, self.in_proj.bias)  # (..., T, 3 H b + H)
        qkv, z = projected.split([3 * width, self.heads], dim=-1)
        if self.taps:
            qkv, history = self.convolved(qkv, history)
        q, k, v = (x.unflatten(-1, (self.heads, self.size)) for x in qkv.split(width, dim=-1))  # (..., T, H, b)
        gate = (z * 0.25 + 0.5).clamp(0.0, 1.0)  # (..., T, H): the hard sigmoid, with the sigmoid's slope at 0
        softness = self.softness if self.training else 0.0
        if softness:
            gate = torch.lerp(gate, torch.sigmoid(z), softness)
        if self.training and self.track_writes:
            self.writes = gate.mean()
        return F.normalize(q, dim=-1), F.normalize(k, dim=-1), v, 2 * gate, history

    def convolved(self, qkv: torch.Tensor, history: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The short convolution: qkv (..., T, 3 H b) after ``history`` (..., K - 1, 3 H b), the K - 1 positions
        before it (None: zeros) -> SiLU of each channel's causal convolution over the last K positions, and the
        history after qkv (the last K - 1 positions of the two together)."""
        length = qkv.shape[-2]
        if history is None:
            history = qkv.new_zeros(*qkv.shape[:-2], self.taps - 1, qkv.shape[-1])
        padded = torch.cat([history.to(qkv.dtype), qkv], dim=-2)  # (..., K - 1 + T, 3 H b)
        weight = self.conv.weight[:, 0].to(qkv.dtype)  # (3 H b, K): tap j reads position t - (K - 1) + j
        mixed = padded[..., :length, :] * weight[:, 0]
        for tap in range(1, self.taps):
            mixed = mixed + padded[..., tap : tap + length, :] * weight[:, tap]
        return F.silu(mixed), padded[..., length:, :]

    def coefficients(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's view of u (..., T, d_model) from a zero history: every value row's transition
        I - beta k k^T (..., T, H b, b, b) and input beta v_i k (..., T, H b, b)."""
        _, k, v, beta, _ = self.project(u)
        scaled = beta.unsqueeze(-1) * k  # (..., H, b): beta k
        eye = torch.eye(self.size, dtype=k.dtype, device=k.device)
        transition = eye - scaled.unsqueeze(-1) * k.unsqueeze(-2)  # (..., H, b, b)
        transitions = transition.unsqueeze(-3).expand(*transition.shape[:-2], self.size, -1, -1)  # (..., H, b, b, b)
        inputs = v.unsqueeze(-1) * scaled.unsqueeze(-2)  # (..., H, b, b): row i is beta v_i k
        return transitions.flatten(-4, -3), inputs.flatten(-3, -2)

    def readout(self, states: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """S q per head, then ``out_proj``: states (..., T, H b, b) and u (..., T, d_model) from a zero history ->
        (..., T, d_model)."""
        q = self.project(u)[0]  # (..., T, H, b)
        rows = states.unflatten(-2, (self.heads, self.size))  # (..., H, b, b)
        read = torch.matmul(rows, q.unsqueeze(-1)).squeeze(-1)  # (..., H, b)
        return self.project_out(read.flatten(-2))

    def mix(
        self, u: torch.Tensor, state: torch.Tensor, impl: str, chunk_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """S q at every position (B, T, H b), before ``out_proj``, and the last state (B, H b + history rows, b),
        never holding every state: :func:`delta_chunked`, or the reference loop for ``impl`` "sequential" and for
        one token."""
        rows = self.heads * self.size
        history = state[:, rows:].reshape(state.shape[0], self.taps - 1, -1) if self.taps else None  # (B, K-1, 3Hb)
        q, k, v, beta, history = self.project(u, history)  # (B, T, H, b) x 3, (B, T, H)
        matrices = state[:, :rows].unflatten(1, (self.heads, self.size))  # (B, H, b, b)
        if runs_sequential(impl, u.shape[1]):
            read, final = delta_sequential(q, k, v, beta, matrices)  # (B, T, H, b), (B, H, b, b)
        else:
            read, final = delta_chunked(q, k, v, beta, matrices, chunk_size)
        final = final.flatten(1, 2)  # (B, H b, b)
        if history is not None:
            final = torch.cat([final, history.reshape(final.shape[0], self.history_rows, self.size).to(final.dtype)], 1)
        return read.flatten(-2), final
