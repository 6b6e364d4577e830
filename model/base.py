"""The interface every architecture implements, and the shared token embedding and output head.

A model maps token ids ``(B, T)`` to logits ``(B, T, output_size)``: label logits for a transducer, next-
token logits for a language model. Three ways to run it, which must agree:

- ``forward(tokens)``: the parallel pass over a whole (right-padded) batch;
- ``final_logits(tokens, lengths)``: only the logits at each sequence's last position, through the
  cheapest exact path the architecture has;
- ``new_cache(batch)`` then ``forward(chunk, cache=cache)`` (prefill, in chunks of any length) and
  ``step(token, cache)`` one token at a time: incremental decoding through the architecture's
  :class:`InferenceCache`, whose rows may hold different lengths.

Every model also declares what its calls cost (:meth:`SequenceModel.cost`, :meth:`SequenceModel.cache_nbytes`),
for the path it actually runs, so that a server can refuse what can never fit, size its slices of work and
reserve memory; and how to run one long input in bounded slices (:meth:`SequenceModel.run_in_slices`).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn

from model.config import BaseModelConfig
from model.ops import prepacked
from model.ops.cpu_decode import linear, linear_argmax, rows_argmax


@dataclass
class InferenceCache(ABC):
    """Per-model decoding state for a batch of rows, updated in place by ``forward``/``step``.

    ``lengths`` (B,) int64, on the CPU, counts the tokens each row has consumed; rows of one batch may hold
    different lengths, and a step or a prefill chunk advances every row by the same number of tokens. A cache
    describes itself, so a server never needs to know its class: :meth:`stack` joins caches row-wise,
    :meth:`select` takes some rows, :meth:`split` every row alone, :attr:`nbytes` is what it holds. Caches are
    meant for inference: fill them under ``torch.no_grad()`` (or ``inference_mode``), since in-place writes of
    tensors that carry autograd history into a cache are not supported.
    """

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
    def stack(cls, caches: Sequence[InferenceCache]) -> InferenceCache:
        """One cache whose rows are those of ``caches`` in order (each of any batch size and lengths); the
        inputs are left as they were."""

    @abstractmethod
    def select(self, rows: Sequence[int]) -> InferenceCache:
        """A new cache holding ``rows`` of this one, in that order (copies: later steps of either do not
        change the other)."""

    def split(self) -> list[InferenceCache]:
        """Every row as a cache of its own."""
        return [self.select([row]) for row in range(self.batch_size)]

    def clone(self) -> InferenceCache:
        """A deep copy (a state-cache snapshot that later steps do not change)."""
        return self.select(range(self.batch_size))

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held by the cache's tensors."""

    def step_state(self) -> list[torch.Tensor] | None:
        """The tensors a step reads and replaces, each with the rows first, (B, ...) (views where the cache keeps
        them otherwise), when no step changes their shapes; None for a cache that grows with the lengths. A decode
        step captured as a CUDA graph (model/cuda_graphs.py) copies them in and out."""
        return None


def long_tensor(values: Sequence[int] | int, batch_size: int | None = None) -> torch.Tensor:
    """(B,) int64 on the CPU (lengths, token ids, rows): ``values`` per row, or the one value ``values`` repeated
    ``batch_size`` times. Through numpy: ``torch.tensor`` of a list of 64 ints took 17-31 us, this 6.6 (a decode step
    builds one or two)."""
    if isinstance(values, int):
        return torch.full((batch_size,), values, dtype=torch.long)
    return torch.from_numpy(np.array(list(values), dtype=np.int64))


@dataclass(frozen=True)
class Cost:
    """What one model call costs: ``flops`` multiply-adds (a server turns them into seconds with a rate it
    measures) and ``nbytes``, the peak memory the call allocates beyond the weights and the caches it is given."""

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
    """The longest input whose every-position labels (a server's outputs "all") should be computed, or None for
    no limit beyond the server's own: set where ``forward`` costs far more than ``final_logits``."""
    selects_positions: bool = False
    """``forward`` takes ``positions``, a (B, T) bool mask, and returns the (N, output_size) logits there only."""

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

    def advance(self, tokens: torch.Tensor, cache: InferenceCache) -> None:
        """``step`` without the logits: the cache consumes one token per sequence (tokens: (B,) int64), as ``step``
        advances it. A model whose step ends in its head overrides it to skip the head (a prompt's tokens before its
        last, stepped: server/execution/generation.py)."""
        self.step(tokens, cache)

    def step_greedy(self, tokens: torch.Tensor, cache: InferenceCache) -> tuple[torch.Tensor, torch.Tensor]:
        """``step``, then each row's largest logit (``cpu_decode.rows_argmax``: the first of ties, a NaN before any
        number): (ids (B,) int64, their logits (B,)). A model whose step ends in its head overrides it to take the
        picks without the logits where the head can (``TokenEmbedding.greedy``); the picks are the same."""
        return rows_argmax(self.step(tokens, cache))

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Logits at each sequence's last real position.

        tokens: (B, T) right-padded; lengths: (B,) int64 in [1, T], default all T. Returns (B, output_size).
        The default runs the parallel pass and gathers; architectures with a cheaper exact path override it.
        """
        logits = self.forward(tokens)  # (B, T, V)
        return gather_last(logits, lengths)

    @abstractmethod
    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost:
        """The cost of one call on ``path`` (see :data:`CallPath`), for the implementation this model will run
        at that size (e.g. RegularGPT's reference attention is O(T^2) in memory, its fast one O(T))."""

    @abstractmethod
    def cache_nbytes(self, length: int) -> int:
        """Bytes of one row's cache after ``length`` tokens (what a server reserves for a sequence)."""

    def for_serving(self) -> list[str]:
        """Switch to the implementations that scale to any input a server may admit and run fastest; returns a note
        per change (e.g. "attention_impl reference -> auto"). The default packs the weights of the products for
        oneDNN (:meth:`product_weights`, model/ops/prepacked.py: on the CPU, 1.1-2.4x faster products of more
        rows than the streaming kernel takes, for one more copy of each packed weight); subclasses that change
        more call it last, once their weights are where they will stay."""
        sizes = [prepacked.prepack(weight, owners) for weight, owners in self.product_weights()]
        packed = [size for size in sizes if size]
        if not packed:
            return []
        megabytes = sum(packed) / 2**20
        return [f"{len(packed)} weight matrices ({megabytes:.1f} MiB) also kept packed for oneDNN's products (CPU)"]

    def product_weights(self) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """The weights :func:`model.ops.cpu_decode.linear` multiplies by when the model runs without gradients, each
        with the parameters its values live in: by default every ``nn.Linear``'s and a language model's tied head.
        Subclasses whose served products use other weights (e.g. a view joining two) say so here."""
        weights = [module.weight for module in self.modules() if isinstance(module, nn.Linear)]
        heads = [m.embed.weight for m in self.modules() if isinstance(m, TokenEmbedding) and m.label_head is None]
        return [(weight, (weight,)) for weight in [*weights, *heads]]

    def run_in_slices(
        self, tokens: torch.Tensor, all_outputs: bool, slice_flops: float
    ) -> Generator[float, None, tuple[torch.Tensor, torch.Tensor | None]]:
        """Compute one input in slices of about ``slice_flops`` each, yielding after every slice (the last one
        included) the multiply-adds that slice did, so that a caller can interleave other work, time each slice
        against the work it really did, and stop between slices (close the generator). Once every slice has run,
        the generator returns without more work.

        tokens: (1, T). Returns (final logits (output_size,), per-position logits argmax (T,) when
        ``all_outputs`` else None), equal to ``final_logits``/``forward``. The default, for causal models,
        runs chunks through a cache, each as long as fits ``slice_flops`` (at least one token);
        non-causal models override it.
        """
        length = tokens.shape[1]
        cache = self.new_cache(1)
        labels, position, last = [], 0, None
        while position < length:
            chunk = self.chunk_length(slice_flops, context=position, limit=length - position)
            logits = self.forward(tokens[:, position : position + chunk], cache=cache)  # (1, chunk, V)
            if all_outputs:
                labels.append(logits[0].argmax(-1))
            last = logits[0, -1]
            yield self.cost("cached", 1, chunk, context=position).flops
            position += chunk
        return last, torch.cat(labels) if all_outputs else None

    def slices_cost(
        self, length: int, all_outputs: bool, slice_flops: float, cost: Callable[..., Cost] | None = None
    ) -> Cost:
        """What :meth:`run_in_slices` costs for one input of ``length`` symbols: all its slices' multiply-adds,
        and the peak bytes it holds (for causal models the cache at full length plus the largest chunk's
        activations: :meth:`cached_slices_cost`). ``cost``: :meth:`cost` or a memo of it."""
        return self.cached_slices_cost(length, slice_flops, cost)

    def cached_slices_cost(self, length: int, slice_flops: float, cost: Callable[..., Cost] | None = None) -> Cost:
        """``length`` tokens through the cache in chunks of about ``slice_flops``: a prompt's prefill (what a
        language model's context costs), and the default :meth:`run_in_slices`."""
        cost = cost or self.cost
        chunk = self.chunk_length(slice_flops, context=length, limit=length, cost=cost)
        return Cost(
            flops=cost("cached", 1, length).flops,
            nbytes=self.cache_nbytes(length) + cost("cached", 1, chunk, context=length).nbytes,
        )

    def chunk_length(
        self, flops: float, context: int, limit: int, cost: Callable[..., Cost] | None = None, scored: bool = True
    ) -> int:
        """The longest chunk (at most ``limit``, at least 1) whose cached forward after ``context`` tokens costs at
        most ``flops`` (:meth:`cost` grows with the chunk length); ``scored`` False: a prompt chunk none of whose
        positions is scored (:meth:`prefill_cost`). ``cost``: :meth:`cost` or a memo of it."""
        cost = cost or self.cost
        if scored:
            return largest_fitting(lambda chunk: cost("cached", 1, chunk, context).flops <= flops, limit)
        return largest_fitting(lambda chunk: self.prefill_cost(1, chunk, context, cost).flops <= flops, limit)

    def prefill_cost(self, rows: int, length: int, context: int = 0, cost: Callable[..., Cost] | None = None) -> Cost:
        """A prompt chunk of ``length`` tokens a row through a cache holding ``context``, none of its positions
        scored: the "cached" call, less the head's work on all but each row's last position where the model
        ``selects_positions`` (server/execution/generation.py then runs the head there alone). ``cost``: :meth:`cost` or a
        memo of it."""
        cached = (cost or self.cost)("cached", rows, length, context)
        if not self.selects_positions or length <= 1:
            return cached
        skipped = self.head_cost(rows * (length - 1))
        return Cost(flops=cached.flops - skipped.flops, nbytes=cached.nbytes - skipped.nbytes)

    def head_cost(self, positions: int) -> Cost:
        """The head's multiply-adds and logits' bytes at ``positions`` positions: needed where ``selects_positions``."""
        raise NotImplementedError(f"{type(self).__name__} selects positions but does not say what its head costs")

    @property
    def device(self) -> torch.device:
        return self._reference_parameter.device

    @property
    def dtype(self) -> torch.dtype:
        return self._reference_parameter.dtype

    @functools.cached_property
    def _reference_parameter(self) -> nn.Parameter:
        """The first parameter, found once: a walk of the modules took ~5-15 us, and a server's cost questions read the
        device and dtype many times per request (a new sequence's cache reservation was ~1 ms of such walks). ``.to()``
        and ``.half()`` change a parameter's data in place, so its device and dtype stay the model's; only replacing
        the parameter objects (``load_state_dict(..., assign=True)``) would leave it behind, which nothing here does."""
        return next(self.parameters())


def parameter_count(*modules: nn.Module) -> int:
    """Elements of the modules' parameters (what a cost formula multiplies per token)."""
    return sum(parameter.numel() for module in modules for parameter in module.parameters())


def largest_fitting(fits: Callable[[int], bool], limit: int) -> int:
    """The largest n in [1, limit] with ``fits(n)``, for a predicate that holds up to some n and fails beyond
    (bisection: O(log limit) calls); 1 when even ``fits(1)`` fails."""
    low, high = 1, limit
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


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
            return linear(hidden, self.embed.weight)  # tied: hidden @ embed.weight^T
        return linear(hidden, self.label_head.weight, self.label_head.bias)

    def greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden: (B, d_model) -> each row's largest logit of ``logits(hidden)`` and where it is, (ids (B,) int64,
        values (B,)), without writing the logits where ``cpu_decode.linear_argmax`` can."""
        if self.label_head is None:
            return linear_argmax(hidden, self.embed.weight)
        return linear_argmax(hidden, self.label_head.weight, self.label_head.bias)
