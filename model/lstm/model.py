"""Stacked LSTM baseline: embedding -> nn.LSTM -> projection to d_model -> LayerNorm -> head."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from model.base import SequenceModel, gather_last, parameter_count
from model.cache import InferenceCache, long_tensor
from model.config import LSTMConfig
from model.layers import TokenEmbedding
from model.serving import CallPath, Cost


@dataclass
class LSTMCache(InferenceCache):
    """Hidden and cell state, (n_layers, B, hidden_size) each."""

    hidden: torch.Tensor
    cell: torch.Tensor

    @classmethod
    def stack(cls, caches: Sequence[LSTMCache]) -> LSTMCache:
        hidden = torch.cat([cache.hidden for cache in caches], dim=1)  # (n_layers, B, hidden_size)
        cell = torch.cat([cache.cell for cache in caches], dim=1)  # (n_layers, B, hidden_size)
        return LSTMCache(torch.cat([cache.lengths for cache in caches]), hidden, cell)

    def select(self, rows: Sequence[int]) -> LSTMCache:
        index = torch.tensor(list(rows), dtype=torch.long)  # (rows,)
        device_index = index.to(self.hidden.device)
        return LSTMCache(self.lengths[index], self.hidden[:, device_index], self.cell[:, device_index])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.cell))

    def step_state(self) -> list[torch.Tensor]:
        return [self.hidden.transpose(0, 1), self.cell.transpose(0, 1)]  # (B, n_layers, hidden_size) each


class LSTMModel(SequenceModel):
    """Dropout acts between LSTM layers and on the last layer's output."""

    config: LSTMConfig

    def __init__(self, config: LSTMConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = TokenEmbedding(config)
        self.lstm = nn.LSTM(
            config.d_model,
            config.hidden_size,
            num_layers=config.n_layers,
            batch_first=True,
            dropout=config.dropout if config.n_layers > 1 else 0.0,
        )
        self.dropout = nn.Dropout(config.dropout)
        self.proj = nn.Linear(config.hidden_size, config.d_model)
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def hidden(self, tokens: torch.Tensor, cache: LSTMCache | None = None) -> torch.Tensor:
        """tokens (B, T) -> final hidden states (B, T, d_model); continues and advances ``cache``."""
        state = None if cache is None else (cache.hidden, cache.cell)
        out, (hidden, cell) = self.lstm(self.embedding(tokens), state)  # out: (B, T, hidden_size)
        if cache is not None:
            cache.hidden, cache.cell = hidden, cell  # (n_layers, B, hidden_size) each
            cache.lengths = cache.lengths + tokens.shape[1]
        normed: torch.Tensor = self.ln_f(self.proj(self.dropout(out)))  # (B, T, d_model)
        return normed

    def forward(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        assert cache is None or isinstance(cache, LSTMCache)
        return self.embedding.logits(self.hidden(tokens, cache))  # (B, T, output_size)

    def new_cache(self, batch_size: int) -> LSTMCache:
        shape = (self.config.n_layers, batch_size, self.config.hidden_size)
        zeros = torch.zeros(shape, device=self.device, dtype=self.dtype)
        return LSTMCache(long_tensor(0, batch_size), hidden=zeros, cell=zeros.clone())

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        return self.forward(tokens[:, None], cache)[:, 0]  # (B, output_size)

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The head runs on the last real positions only."""
        return self.embedding.logits(gather_last(self.hidden(tokens), lengths))  # (B, output_size)

    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost:
        """flops: the LSTM's and projection's weights per token, the head per logit position. nbytes: ~4 d + 5 h per
        layer per position (at least float32), and the logits."""
        config = self.config
        per_token = self._weights_per_token
        logit_positions = rows if path == "final" else rows * length
        item = self.dtype.itemsize
        per_position = 4 * config.d_model * item + 5 * config.n_layers * config.hidden_size * max(item, 4)
        return Cost(
            flops=float(rows * length * per_token + logit_positions * config.d_model * config.output_size),
            nbytes=rows * length * per_position + logit_positions * config.output_size * item,
        )

    @functools.cached_property
    def _weights_per_token(self) -> int:
        return parameter_count(self.lstm) + self.proj.weight.numel()

    def cache_nbytes(self, length: int) -> int:
        return 2 * self.config.n_layers * self.config.hidden_size * self.dtype.itemsize
