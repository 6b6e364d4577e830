"""Stacked decode steps equal steps taken one sequence at a time, whatever each sequence's length."""

from __future__ import annotations

import pytest
import torch

from server.cache_stacking import can_stack, split_cache, stack_caches
from tests.model.tiny_models import build_tiny


@pytest.mark.parametrize("model_id", ["lrnn", "diagonal_lrnn", "lstm"])
def test_stacked_step_equals_single_steps(model_id: str) -> None:
    torch.manual_seed(0)
    model = build_tiny(model_id, vocab_size=7, num_labels=0).double().eval()
    prompts = [torch.randint(0, 7, (1, length)) for length in (1, 5, 12)]
    caches = []
    for prompt in prompts:
        cache = model.new_cache(1)
        model(prompt, cache=cache)
        caches.append(cache)
    alone = [cache.clone() for cache in caches]
    tokens = torch.tensor([3, 0, 6])
    for _ in range(3):
        stacked = stack_caches(caches)
        batched = model.step(tokens, stacked)  # (3, V)
        split_cache(stacked, caches)
        single = torch.cat([model.step(tokens[i : i + 1], alone[i]) for i in range(3)])  # (3, V)
        torch.testing.assert_close(batched, single)
        tokens = batched.argmax(-1)
    assert [cache.length for cache in caches] == [1 + 3, 5 + 3, 12 + 3]
    assert [cache.memory_bytes() for cache in caches] == [cache.memory_bytes() for cache in alone]


@pytest.mark.parametrize("model_id", ["transformer-alibi", "regulargpt-c2"])
def test_length_dependent_caches_are_not_stacked(model_id: str) -> None:
    model = build_tiny(model_id, vocab_size=7, num_labels=0)
    assert not can_stack(model.new_cache(1))
