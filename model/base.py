"""The interface every architecture implements, and the shared token embedding and output head.

A model maps token ids ``(B, T)`` to logits ``(B, T, output_size)``: label logits for a transducer, next-
token logits for a language model. Three ways to run it, which must agree:

- ``forward(tokens)``: the parallel pass over a whole (right-padded) batch;
- ``final_logits(tokens, lengths)``: only the logits at each sequence's last position, through the
  cheapest exact path the architecture has;
- ``new_cache(batch)`` then ``forward(prompt, cache=cache)`` (prefill) and ``step(token, cache)`` one token
  at a time: incremental decoding through the architecture's :class:`InferenceCache`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from model.config import BaseModelConfig


@dataclass
class InferenceCache(ABC):
    """Per-model decoding state for a batch of sequences, updated in place by ``forward``/``step``.

    ``length`` is the number of tokens consumed so far (the same for every row of the batch). Caches are
    meant for inference: fill them under ``torch.no_grad()`` (or ``inference_mode``), since in-place writes
    of tensors that carry autograd history into a cache are not supported.
    """

    length: int

    @abstractmethod
    def clone(self) -> InferenceCache:
        """A deep copy (a state-cache snapshot that later steps do not change)."""

    @abstractmethod
    def memory_bytes(self) -> int:
        """Bytes held by the cache's tensors."""


class SequenceModel(nn.Module, ABC):
    """Base class: embedding -> architecture body -> head. Subclasses implement the body."""

    config: BaseModelConfig
    max_all_outputs_symbols: int | None = None
    """The longest input whose every-position labels (a server's outputs "all") should be computed, or None for
    no limit beyond the server's own: set where ``forward`` costs far more than ``final_logits``."""

    @abstractmethod
    def forward(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        """Per-position logits.

        tokens: (B, T) int64. With ``cache``, the tokens continue the cached sequences (prefill) and the
        cache is advanced by T. Returns (B, T, output_size).
        """

    @abstractmethod
    def new_cache(self, batch_size: int) -> InferenceCache:
        """An empty cache for ``batch_size`` sequences on the model's device and dtype."""

    @abstractmethod
    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """Consume one token per sequence. tokens: (B,) int64. Returns (B, output_size); advances cache."""

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Logits at each sequence's last real position.

        tokens: (B, T) right-padded; lengths: (B,) int64 in [1, T], default all T. Returns (B, output_size).
        The default runs the parallel pass and gathers; architectures with a cheaper exact path override it.
        """
        logits = self.forward(tokens)  # (B, T, V)
        return gather_last(logits, lengths)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


def gather_last(values: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """values: (B, T, ...) -> (B, ...) at index lengths - 1 per row (the last position if lengths is None)."""
    if lengths is None:
        return values[:, -1]
    check_lengths(lengths, values.shape[0], values.shape[1])
    index = (lengths.to(values.device) - 1).view(-1, *([1] * (values.dim() - 1)))
    index = index.expand(-1, 1, *values.shape[2:])  # (B, 1, ...)
    return values.gather(1, index).squeeze(1)


def check_lengths(lengths: torch.Tensor, batch_size: int, max_length: int) -> None:
    if lengths.shape != (batch_size,):
        raise ValueError(f"lengths must have shape ({batch_size},), got {tuple(lengths.shape)}")
    if bool((lengths < 1).any()) or bool((lengths > max_length).any()):
        raise ValueError(f"lengths must lie in [1, {max_length}], got {lengths.tolist()}")


class TokenEmbedding(nn.Module):
    """Token embedding plus the output head: tied to the embedding for a language model, a separate
    linear map for a transducer's labels."""

    def __init__(self, config: BaseModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.label_head = (
            None if config.is_language_model else nn.Linear(config.d_model, config.num_labels)
        )
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (B, T) -> (B, T, d_model)."""
        return self.embed(tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (..., d_model) -> (..., output_size)."""
        if self.label_head is None:
            return hidden @ self.embed.weight.t()
        return self.label_head(hidden)
