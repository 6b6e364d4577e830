"""Position handlings of the transformer baselines: sinusoidal, ALiBi (Press et al. 2022), KERPLE (Chi et al. 2022), T5
buckets and Transformer-XL. A relative one is ``forward(q, k, query_offset) -> bias`` (1 or B, H, Tq, Tk) added to q.k /
sqrt(hd), queries starting at ``query_offset`` (int or (B,)); callers mask future keys."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
from torch import nn
from torch.nn import functional as F

QueryOffset = int | torch.Tensor
"""A call's first query position: one int for all rows, or (B,) int64 per row."""


def sinusoidal_encoding(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """positions (...,) -> (..., dim) float32: sin and cos of p / 10000^(2i/dim), interleaved."""
    frequencies = torch.exp(
        torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) * (-math.log(10000.0) / dim)
    )  # (ceil(dim / 2),)
    angles = positions.to(torch.float32)[..., None] * frequencies  # (..., ceil(dim / 2))
    return torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)[..., :dim]  # (..., dim)


def query_positions(query_offset: QueryOffset, query_length: int, device: torch.device) -> torch.Tensor:
    """Positions from ``query_offset``: (Tq,) for an int, (B, Tq) per row."""
    steps = torch.arange(query_length, device=device)  # (Tq,)
    if isinstance(query_offset, int):
        return steps + query_offset
    return query_offset.to(device)[:, None] + steps  # (B, Tq)


def last_query_position(query_offset: QueryOffset, query_length: int) -> int:
    """The largest query position of any row: max(query_offset) + Tq - 1."""
    return int(query_offset if isinstance(query_offset, int) else query_offset.max()) + query_length - 1


def relative_distance(
    query_offset: QueryOffset, query_length: int, key_length: int, device: torch.device
) -> torch.Tensor:
    """i - j, (Tq, Tk) int64 or (B, Tq, Tk) per row; negative for future keys."""
    queries = query_positions(query_offset, query_length, device)  # (Tq,) or (B, Tq)
    keys = torch.arange(key_length, device=device)  # (Tk,)
    return queries[..., :, None] - keys  # (Tq, Tk) or (B, Tq, Tk)


def past_distance(query_offset: QueryOffset, query_length: int, key_length: int, device: torch.device) -> torch.Tensor:
    """max(i - j, 0) as (1, Tq, Tk), or (B, 1, Tq, Tk) per row."""
    return relative_distance(query_offset, query_length, key_length, device).clamp(min=0).unsqueeze(-3)


class StaticPositionBias(nn.Module, ABC):
    """A bias of positions only: ``bias(offset, Tq, Tk)`` is (H, Tq, Tk), or (B, H, Tq, Tk) per row."""

    @abstractmethod
    def bias(self, query_offset: QueryOffset, query_length: int, key_length: int) -> torch.Tensor:
        """(H, Tq, Tk), or (B, H, Tq, Tk) for per-row offsets."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, query_offset: QueryOffset) -> torch.Tensor:
        bias = self.bias(query_offset, q.shape[-2], k.shape[-2])  # (H, Tq, Tk) or (B, H, Tq, Tk)
        return bias.reshape(-1, *bias.shape[-3:]).to(q.dtype)


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi's geometric slopes 2^(-8h/n) (interleaved from 2n' heads when n is not a power of two)."""
    if n_heads & (n_heads - 1) == 0:
        return [2.0 ** (-8.0 * (h + 1) / n_heads) for h in range(n_heads)]
    power = 2 ** math.floor(math.log2(n_heads))
    return alibi_slopes(power) + alibi_slopes(2 * power)[0::2][: n_heads - power]


class ALiBi(StaticPositionBias):
    slopes: torch.Tensor

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", torch.tensor(alibi_slopes(n_heads)), persistent=False)  # (H,)

    def bias(self, query_offset: QueryOffset, query_length: int, key_length: int) -> torch.Tensor:
        distance = past_distance(query_offset, query_length, key_length, self.slopes.device)  # ([B,] 1, Tq, Tk)
        return -self.slopes[:, None, None] * distance  # ([B,] H, Tq, Tk)


class KerpleLog(StaticPositionBias):
    """bias = -r1_h log(1 + r2_h (i - j)), r1, r2 = softplus(raw) > 0."""

    def __init__(self, n_heads: int) -> None:
        super().__init__()
        r1 = torch.empty(n_heads).uniform_(0.0, 2.0).clamp(min=0.01)
        r2 = torch.empty(n_heads).uniform_(0.0, 1.0).clamp(min=0.01)
        self.raw_r1 = nn.Parameter(torch.log(torch.expm1(r1)))  # (H,), softplus^-1
        self.raw_r2 = nn.Parameter(torch.log(torch.expm1(r2)))  # (H,)

    def bias(self, query_offset: QueryOffset, query_length: int, key_length: int) -> torch.Tensor:
        distance = past_distance(query_offset, query_length, key_length, self.raw_r1.device)  # ([B,] 1, Tq, Tk)
        r1 = F.softplus(self.raw_r1)[:, None, None]  # (H, 1, 1)
        r2 = F.softplus(self.raw_r2)[:, None, None]  # (H, 1, 1)
        return -r1 * torch.log1p(r2 * distance)  # ([B,] H, Tq, Tk)


def t5_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """Causal T5 bucket of i - j >= 0: exact below num_buckets // 2, log-spaced up to max_distance, then the last."""
    exact = num_buckets // 2
    log_ratio = torch.log(distance.clamp(min=exact).float() / exact) / math.log(max_distance / exact)
    large = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return torch.where(distance < exact, distance, large)


class T5Buckets(StaticPositionBias):
    def __init__(self, n_heads: int, num_buckets: int, max_distance: int) -> None:
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bucket_bias = nn.Parameter(torch.randn(num_buckets, n_heads) * 0.02)  # (buckets, H)

    def bias(self, query_offset: QueryOffset, query_length: int, key_length: int) -> torch.Tensor:
        distance = relative_distance(query_offset, query_length, key_length, self.bucket_bias.device).clamp(min=0)
        buckets = t5_bucket(distance, self.num_buckets, self.max_distance)  # ([B,] Tq, Tk)
        return self.bucket_bias[buckets].movedim(-1, -3)  # ([B,] H, Tq, Tk)


class XLRelative(nn.Module):
    """Transformer-XL terms (q_i.(W_r R_{i-j}) + u.k_j + v.(W_r R_{i-j})) / sqrt(hd); queries are moved into R's space,
    O(T d_model) per head per step."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.relative_proj = nn.Linear(d_model, d_model, bias=False)  # W_r
        self.content_bias = nn.Parameter(torch.randn(n_heads, self.head_dim) * 0.02)  # u: (H, hd)
        self.position_bias = nn.Parameter(torch.randn(n_heads, self.head_dim) * 0.02)  # v: (H, hd)

    def forward(self, q: torch.Tensor, k: torch.Tensor, query_offset: QueryOffset) -> torch.Tensor:
        batch, _, query_length, _ = q.shape
        key_length = k.shape[-2]
        d_model = self.relative_proj.in_features
        # keys j >= 0 and queries i <= the last query position: distances 0 .. that position
        distances = torch.arange(last_query_position(query_offset, query_length) + 1, device=q.device)  # (D,)
        encodings = sinusoidal_encoding(distances, d_model).to(q.dtype)  # (D, d_model)
        proj = self.relative_proj.weight.view(self.n_heads, self.head_dim, d_model)  # (H, hd, d_model)
        query_in_r = (q + self.position_bias[:, None]) @ proj  # (B, H, Tq, d_model)
        by_distance = query_in_r @ encodings.t()  # (B, H, Tq, D)
        distance = past_distance(query_offset, query_length, key_length, q.device)  # ([B,] 1, Tq, Tk)
        position_term = by_distance.gather(-1, distance.expand(batch, self.n_heads, -1, -1))  # (B, H, Tq, Tk)
        content_term = (k @ self.content_bias[:, :, None]).transpose(-1, -2)  # (B, H, 1, Tk)
        return (position_term + content_term) / math.sqrt(self.head_dim)  # (B, H, Tq, Tk)
