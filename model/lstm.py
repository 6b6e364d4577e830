"""Stacked LSTM baseline: embedding -> nn.LSTM -> projection to d_model -> LayerNorm -> head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model.base import InferenceCache, SequenceModel, TokenEmbedding, gather_last
from model.config import LSTMConfig


@dataclass
class LSTMCache(InferenceCache):
    """The LSTM's state after ``length`` tokens: hidden and cell, (n_layers, B, hidden_size) each."""

    hidden: torch.Tensor
    cell: torch.Tensor

    def clone(self) -> LSTMCache:
        return LSTMCache(length=self.length, hidden=self.hidden.clone(), cell=self.cell.clone())

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.cell))


class LSTMModel(SequenceModel):
    """Dropout (``config.dropout``) acts between LSTM layers and on the last layer's output."""

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
        """tokens: (B, T) -> final hidden states (B, T, d_model); continues from and advances ``cache``."""
        state = None if cache is None else (cache.hidden, cache.cell)
        out, (hidden, cell) = self.lstm(self.embedding(tokens), state)  # out: (B, T, hidden_size)
        if cache is not None:
            cache.hidden, cache.cell = hidden, cell  # (n_layers, B, hidden_size) each
            cache.length += tokens.shape[1]
        return self.ln_f(self.proj(self.dropout(out)))  # (B, T, d_model)

    def forward(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        return self.embedding.logits(self.hidden(tokens, cache))  # (B, T, output_size)

    def new_cache(self, batch_size: int) -> LSTMCache:
        shape = (self.config.n_layers, batch_size, self.config.hidden_size)
        zeros = torch.zeros(shape, device=self.device, dtype=self.dtype)
        return LSTMCache(length=0, hidden=zeros, cell=zeros.clone())

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        return self.forward(tokens[:, None], cache)[:, 0]  # (B, output_size)

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The head runs on the last real positions only, not on all B * T."""
        return self.embedding.logits(gather_last(self.hidden(tokens), lengths))  # (B, output_size)
