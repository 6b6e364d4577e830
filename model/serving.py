"""What a server asks of a model beside its numerics (:class:`Servable`, which every ``SequenceModel`` is): each
call's cost, a cache's bytes, a long input cut into slices, and the layouts switched to for serving."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

from model.cache import InferenceCache
from model.layers import TokenEmbedding
from model.ops import prepacked


@dataclass(frozen=True)
class Cost:
    """``flops`` multiply-adds and ``nbytes`` peak memory beyond the weights and given caches."""

    flops: float
    nbytes: int


CallPath = Literal["forward", "final", "cached"]
"""``forward``: the parallel pass over (rows, length) tokens; ``final``: ``final_logits`` over them; ``cached``:
``forward`` of a chunk of ``length`` tokens per row through a cache already holding ``context`` tokens per row
(``step`` is the chunk of length 1)."""


class _Model(Protocol):
    """What :class:`Servable`'s defaults read of the model they serve."""

    def forward(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor: ...
    def new_cache(self, batch_size: int) -> InferenceCache: ...
    def modules(self) -> Iterator[nn.Module]: ...
    def product_weights(self) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]: ...
    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost: ...
    def chunk_length(
        self, flops: float, context: int, limit: int, cost: Callable[..., Cost] | None = None, scored: bool = True
    ) -> int: ...


class Servable(ABC):
    """Costs and serving layouts; each architecture implements :meth:`cost` and :meth:`cache_nbytes`."""

    max_all_outputs_symbols: int | None = None
    """Longest input whose every-position outputs should be computed, or None for no limit of the model's own."""
    selects_positions: bool = False
    """``forward`` takes ``positions``, a (B, T) bool mask, and returns the (N, output_size) logits there only."""

    @abstractmethod
    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost:
        """The cost of one call on ``path`` for the implementation run at that size."""

    @abstractmethod
    def cache_nbytes(self, length: int) -> int:
        """Bytes of one row's cache after ``length`` tokens (what a server reserves for a sequence)."""

    def for_serving(self: _Model) -> list[str]:
        """Switch to the fastest implementations fit for any admissible input; returns a note per change. The default
        packs :meth:`product_weights` for oneDNN; overrides call it last."""
        sizes = [prepacked.prepack(weight, owners) for weight, owners in self.product_weights()]
        packed = [size for size in sizes if size]
        if not packed:
            return []
        megabytes = sum(packed) / 2**20
        return [f"{len(packed)} weight matrices ({megabytes:.1f} MiB) also kept packed for oneDNN's products (CPU)"]

    def product_weights(self: _Model) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """(weight, the parameters its values live in) for each matrix ``cpu_decode.linear`` multiplies by."""
        weights = [module.weight for module in self.modules() if isinstance(module, nn.Linear)]
        heads = [m.embed.weight for m in self.modules() if isinstance(m, TokenEmbedding) and m.label_head is None]
        return [(weight, (weight,)) for weight in [*weights, *heads]]

    def run_in_slices(
        self: _Model, tokens: torch.Tensor, all_outputs: bool, slice_flops: float
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
