"""Stacking the decoding caches of several sequences into one batch, and splitting it back.

A cache has one ``length`` for all its rows, so only caches whose step does not depend on the length can be
stacked whatever each sequence's length: the O(1)-state caches of the LRNNs (``LRNNCache``: per layer
(B, H, b), batch first) and of the LSTM (``LSTMCache``: (n_layers, B, hidden), batch second). A KV cache
(transformer) or RegularGPT's dilated windows depend on the length, so the engine steps those sequences one
at a time instead (see ``server/engine.py``).
"""

from __future__ import annotations

import torch

from model.base import InferenceCache
from model.lrnn import LRNNCache
from model.lstm import LSTMCache

# cache class -> {field: batch dimension}; a field holds a tensor or a list of tensors (one per layer).
BATCH_DIMS: dict[type[InferenceCache], dict[str, int]] = {
    LRNNCache: {"states": 0},
    LSTMCache: {"hidden": 1, "cell": 1},
}


def can_stack(cache: InferenceCache) -> bool:
    return type(cache) in BATCH_DIMS


def stack_caches(caches: list[InferenceCache]) -> InferenceCache:
    """One cache whose row i is ``caches[i]`` (all of one stackable class, one row each); its length is 0 and
    counts the steps taken on the stack."""
    cache_class = type(caches[0])
    fields = {}
    for name, dim in BATCH_DIMS[cache_class].items():
        values = [getattr(cache, name) for cache in caches]
        if isinstance(values[0], list):
            fields[name] = [torch.cat(layer, dim) for layer in zip(*values)]  # per layer, B rows along dim
        else:
            fields[name] = torch.cat(values, dim)
    return cache_class(length=0, **fields)


def split_cache(stacked: InferenceCache, caches: list[InferenceCache]) -> None:
    """Write row i of ``stacked`` back into ``caches[i]`` and advance each by the steps taken on the stack."""
    for row, cache in enumerate(caches):
        for name, dim in BATCH_DIMS[type(stacked)].items():
            value = getattr(stacked, name)
            if isinstance(value, list):
                setattr(cache, name, [layer.narrow(dim, row, 1) for layer in value])
            else:
                setattr(cache, name, value.narrow(dim, row, 1))
        cache.length += stacked.length
