"""The numerics every architecture implements (:class:`SequenceModel`: the parallel pass, cached steps and final
logits, which must agree) and the helpers they share."""

from __future__ import annotations

import functools
from abc import abstractmethod

import torch
from torch import nn

from model.cache import InferenceCache
from model.config import BaseModelConfig
from model.ops.cpu.cpu_decode import rows_argmax
from model.serving import Servable


class SequenceModel(nn.Module, Servable):
    """Base class: embedding -> architecture body -> head. Subclasses implement the body, and what :class:`Servable`
    asks of it."""

    config: BaseModelConfig

    @abstractmethod
    def forward(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, output_size); with ``cache``, continue its rows and advance it by T."""

    @abstractmethod
    def new_cache(self, batch_size: int) -> InferenceCache:
        """An empty cache for ``batch_size`` sequences on the model's device and dtype."""

    @abstractmethod
    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """Consume one token per sequence. tokens: (B,) int64. Returns (B, output_size); advances cache."""

    def advance(self, tokens: torch.Tensor, cache: InferenceCache) -> None:
        """``step`` without the logits (the cache advances by one token per row); overridden to skip the head."""
        self.step(tokens, cache)

    def step_greedy(self, tokens: torch.Tensor, cache: InferenceCache) -> tuple[torch.Tensor, torch.Tensor]:
        """``step``, then each row's largest logit (first of ties, NaN first): (ids (B,) int64, logits (B,))."""
        return rows_argmax(self.step(tokens, cache))

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T) right-padded, lengths (B,) in [1, T] (default T) -> (B, output_size) at each last position."""
        logits = self.forward(tokens)  # (B, T, V)
        return gather_last(logits, lengths)

    @property
    def device(self) -> torch.device:
        return self._reference_parameter.device

    @property
    def dtype(self) -> torch.dtype:
        return self._reference_parameter.dtype

    @functools.cached_property
    def _reference_parameter(self) -> nn.Parameter:
        """The first parameter, cached; valid while parameters are changed in place (``.to()``), not replaced."""
        return next(self.parameters())


def parameter_count(*modules: nn.Module) -> int:
    """Elements of the modules' parameters (what a cost formula multiplies per token)."""
    return sum(parameter.numel() for module in modules for parameter in module.parameters())


def gather_last(values: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """values (B, T, ...) -> (B, ...) at lengths - 1 per row (the last position if None)."""
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
