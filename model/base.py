"""The interface every architecture implements (:class:`SequenceModel`, :class:`InferenceCache`, :class:`Cost`) and the
shared token embedding and head. ``forward``, ``final_logits`` and cached ``step``s must agree."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from torch import nn

from model.config import BaseModelConfig
from model.ops import prepacked
from model.ops.cpu.cpu_decode import linear, linear_argmax, rows_argmax

if TYPE_CHECKING:  # typing.Self is Python 3.11+; the annotations are strings at run time
    from typing_extensions import Self


@dataclass
class InferenceCache(ABC):
    """Decoding state of B rows, updated in place by ``forward``/``step``; ``lengths`` (B,) int64 on the CPU counts each
    row's tokens (rows may differ). Fill it under ``no_grad``."""

    lengths: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    @property
    def length(self) -> int:
        """The common length of the rows; an error when they differ (then read ``lengths``)."""
        if self.batch_size and bool((self.lengths != self.lengths[0]).any()):
            raise ValueError(f"the rows hold different lengths {self.lengths.tolist()}; read cache.lengths")
        return int(self.lengths[0]) if self.batch_size else 0

    @classmethod
    @abstractmethod
    def stack(cls, caches: Sequence[Self]) -> Self:
        """One cache whose rows are those of ``caches`` (of this kind) in order; the inputs are left unchanged."""

    @abstractmethod
    def select(self, rows: Sequence[int]) -> InferenceCache:
        """A copy holding ``rows`` in that order."""

    def split(self) -> list[InferenceCache]:
        """Every row as a cache of its own."""
        return [self.select([row]) for row in range(self.batch_size)]

    def clone(self) -> InferenceCache:
        """A deep copy."""
        return self.select(range(self.batch_size))

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held by the cache's tensors."""

    def step_state(self) -> list[torch.Tensor] | None:
        """The tensors a step reads and replaces, rows first, if their shapes never change; else None (no CUDA graph)."""
        return None


def long_tensor(values: Sequence[int] | int, batch_size: int | None = None) -> torch.Tensor:
    """(B,) int64 on the CPU: ``values`` per row, or the int ``values`` repeated ``batch_size`` times."""
    if isinstance(values, int):
        assert batch_size is not None, "an int value needs batch_size"
        return torch.full((batch_size,), values, dtype=torch.long)
    return torch.from_numpy(np.array(list(values), dtype=np.int64))


@dataclass(frozen=True)
class Cost:
    """``flops`` multiply-adds and ``nbytes`` peak memory beyond the weights and given caches."""

    flops: float
    nbytes: int


CallPath = Literal["forward", "final", "cached"]
"""``forward``: the parallel pass over (rows, length) tokens; ``final``: ``final_logits`` over them; ``cached``:
``forward`` of a chunk of ``length`` tokens per row through a cache already holding ``context`` tokens per row
(``step`` is the chunk of length 1)."""


class SequenceModel(nn.Module, ABC):
    """Base class: embedding -> architecture body -> head. Subclasses implement the body."""

    config: BaseModelConfig
    max_all_outputs_symbols: int | None = None
    """Longest input whose every-position outputs should be computed, or None for no limit of the model's own."""
    selects_positions: bool = False
    """``forward`` takes ``positions``, a (B, T) bool mask, and returns the (N, output_size) logits there only."""

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

    @abstractmethod
    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost:
        """The cost of one call on ``path`` for the implementation run at that size."""

    @abstractmethod
    def cache_nbytes(self, length: int) -> int:
        """Bytes of one row's cache after ``length`` tokens (what a server reserves for a sequence)."""

    def for_serving(self) -> list[str]:
        """Switch to the fastest implementations fit for any admissible input; returns a note per change. The default
        packs :meth:`product_weights` for oneDNN; overrides call it last."""
        sizes = [prepacked.prepack(weight, owners) for weight, owners in self.product_weights()]
        packed = [size for size in sizes if size]
        if not packed:
            return []
        megabytes = sum(packed) / 2**20
        return [f"{len(packed)} weight matrices ({megabytes:.1f} MiB) also kept packed for oneDNN's products (CPU)"]

    def product_weights(self) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """(weight, the parameters its values live in) for each matrix ``cpu_decode.linear`` multiplies by."""
        weights = [module.weight for module in self.modules() if isinstance(module, nn.Linear)]
        heads = [m.embed.weight for m in self.modules() if isinstance(m, TokenEmbedding) and m.label_head is None]
        return [(weight, (weight,)) for weight in [*weights, *heads]]

    def run_in_slices(
        self, tokens: torch.Tensor, all_outputs: bool, slice_flops: float
    ) -> Generator[float, None, tuple[torch.Tensor, torch.Tensor | None]]:
        """One input (1, T) in slices of about ``slice_flops``, yielding each slice's multiply-adds; returns (final
        logits, per-position argmax (T,) or None), equal to ``final_logits``/``forward``."""
        length = tokens.shape[1]
        cache = self.new_cache(1)
        labels: list[torch.Tensor] = []
        position, last = 0, None
        while position < length:
            chunk = self.chunk_length(slice_flops, context=position, limit=length - position)
            logits = self.forward(tokens[:, position : position + chunk], cache=cache)  # (1, chunk, V)
            if all_outputs:
                labels.append(logits[0].argmax(-1))
            last = logits[0, -1]
            yield self.cost("cached", 1, chunk, context=position).flops
            position += chunk
        assert last is not None, "an input of at least one token"
        return last, torch.cat(labels) if all_outputs else None

    def slices_cost(
        self, length: int, all_outputs: bool, slice_flops: float, cost: Callable[..., Cost] | None = None
    ) -> Cost:
        """Total cost of :meth:`run_in_slices`; ``cost``: :meth:`cost` or a memo of it."""
        return self.cached_slices_cost(length, slice_flops, cost)

    def cached_slices_cost(self, length: int, slice_flops: float, cost: Callable[..., Cost] | None = None) -> Cost:
        """Cost of ``length`` tokens through the cache in chunks of ``slice_flops``."""
        cost = cost or self.cost
        chunk = self.chunk_length(slice_flops, context=length, limit=length, cost=cost)
        return Cost(
            flops=cost("cached", 1, length).flops,
            nbytes=self.cache_nbytes(length) + cost("cached", 1, chunk, context=length).nbytes,
        )

    def measure_fixed_costs(self) -> None:
        """Measure, on this device, work that :meth:`cost`'s multiply-adds do not show, so that :meth:`cost` counts
        it (RegularGPT's per-block fixed work); nothing for a model whose multiply-adds say it all."""

    def chunk_length(
        self, flops: float, context: int, limit: int, cost: Callable[..., Cost] | None = None, scored: bool = True
    ) -> int:
        """The longest chunk in [1, ``limit``] costing at most ``flops`` after ``context`` tokens (unscored if not
        ``scored``)."""
        cost = cost or self.cost
        if scored:
            return largest_fitting(lambda chunk: cost("cached", 1, chunk, context).flops <= flops, limit)
        return largest_fitting(lambda chunk: self.prefill_cost(1, chunk, context, cost).flops <= flops, limit)

    def prefill_cost(self, rows: int, length: int, context: int = 0, cost: Callable[..., Cost] | None = None) -> Cost:
        """An unscored prompt chunk's cost: "cached", less the head on all but the last position if
        ``selects_positions``."""
        cached = (cost or self.cost)("cached", rows, length, context)
        if not self.selects_positions or length <= 1:
            return cached
        skipped = self.head_cost(rows * (length - 1))
        return Cost(flops=cached.flops - skipped.flops, nbytes=cached.nbytes - skipped.nbytes)

    def head_cost(self, positions: int) -> Cost:
        """The head's cost at ``positions`` positions; required where ``selects_positions``."""
        raise NotImplementedError(f"{type(self).__name__} selects positions but does not say what its head costs")

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


def largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
    """The largest n in [1, limit] with ``fits(n)`` (monotone), by bisection; at least 1."""
    low, high = 1, limit
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


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


class TokenEmbedding(nn.Module):
    """Token embedding plus the output head: tied for a language model, a separate linear map for labels."""

    def __init__(self, config: BaseModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.label_head = None if config.is_language_model else nn.Linear(config.d_model, config.num_labels)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (B, T) -> (B, T, d_model)."""
        embedded: torch.Tensor = self.embed(tokens)
        return embedded

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (..., d_model) -> (..., output_size)."""
        if self.label_head is None:
            return linear(hidden, self.embed.weight)  # tied: hidden @ embed.weight^T
        return linear(hidden, self.label_head.weight, self.label_head.bias)

    def greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (B, d_model) -> (ids (B,) int64, values (B,)) of each row's largest logit."""
        if self.label_head is None:
            return linear_argmax(hidden, self.embed.weight)
        return linear_argmax(hidden, self.label_head.weight, self.label_head.bias)
