"""The states a state-passing run carries from one batch to the next, row by row."""

from __future__ import annotations

from typing import Any

import torch

from model.base import SequenceModel
from model.cache import InferenceCache


def reset_rows(model: SequenceModel, carried: InferenceCache, fresh: torch.Tensor) -> InferenceCache:
    """``carried`` with the rows where ``fresh`` (B,) holds back at the model's initial state."""
    with torch.no_grad():
        initial = model.new_cache(len(fresh))
    return type(carried).stack(
        [(initial if reset else carried).select([row]) for row, reset in enumerate(fresh.tolist())]
    )


def carried_values(carried: InferenceCache | None) -> list[Any] | None:
    """Carried states as a resumable save keeps them: nested lists (exact for float32); None for None."""
    if carried is None:
        return None
    return [state.cpu().tolist() for state in _step_state(carried)]


def restore_carried(carried: InferenceCache | None, values: list[Any] | None) -> None:
    """Put :func:`carried_values`' ``values`` back into ``carried``, in place (nothing where either is None)."""
    if carried is not None and values is not None:
        for tensor, state in zip(_step_state(carried), values):
            tensor.copy_(torch.tensor(state, dtype=tensor.dtype))


def new_carried_state(model: SequenceModel, rows: int) -> InferenceCache:
    """The states a state-passing run starts its rows from: the model's own initial ones. A model whose cache grows
    with the context (attention) cannot carry its state: a ValueError."""
    with torch.no_grad():
        cache = model.new_cache(rows)
    if cache.step_state() is None:
        raise ValueError(
            f"a {type(model).__name__}'s cache grows with the context: state passing needs a model "
            "with a fixed-size recurrent state"
        )
    return cache


def _step_state(carried: InferenceCache) -> list[torch.Tensor]:
    states = carried.step_state()
    assert states is not None  # new_carried_state refuses a cache without a fixed-size state
    return states
