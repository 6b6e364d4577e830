"""The decoding state every architecture's cache implements (:class:`InferenceCache`) and row lengths as tensors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

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
