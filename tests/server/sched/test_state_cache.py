"""The prompt-state cache: longest prefix, LRU by count and bytes, snapshots that later steps do not touch."""

from __future__ import annotations

import torch

from server.sched.state_cache import StateCache
from tests.model.tiny_models import build_tiny


def prefilled(model, tokens: list[int]):
    cache = model.new_cache(1)
    logits = model(torch.tensor([tokens]), cache=cache)[0, -1]  # (V,)
    return cache, logits


def test_longest_prefix_wins_and_suffix_prefill_is_exact() -> None:
    torch.manual_seed(0)
    model = build_tiny("lrnn", vocab_size=11, num_labels=0).double().eval()
    store = StateCache(max_entries=8, max_bytes=2**20, min_tokens=2)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    for length in (3, 6):
        store.store("m", prompt[:length], *prefilled(model, prompt[:length]))
    snapshot = store.lookup("m", prompt + [9])
    assert snapshot.length == 6
    suffix_logits = model(torch.tensor([prompt[6:] + [9]]), cache=snapshot.cache)[0, -1]
    torch.testing.assert_close(suffix_logits, model(torch.tensor([prompt + [9]]))[0, -1])
    again = store.lookup("m", prompt)  # the stored snapshot was cloned, not advanced
    assert again.cache.length == 6
    assert store.lookup("other-model", prompt) is None
    assert store.lookup("m", [2, 1, 3]) is None
    assert (store.stats.queries, store.stats.hits, store.stats.hit_tokens) == (4, 2, 12)


def test_exact_prompt_hit_gives_the_next_token_logits() -> None:
    model = build_tiny("lstm", vocab_size=11, num_labels=0).eval()
    store = StateCache(max_entries=8, max_bytes=2**20, min_tokens=2)
    cache, logits = prefilled(model, [4, 5, 6])
    store.store("m", [4, 5, 6], cache, logits)
    torch.testing.assert_close(store.lookup("m", [4, 5, 6]).logits, logits)


def test_eviction_by_count_and_bytes_and_short_prompts_skipped() -> None:
    model = build_tiny("lrnn", vocab_size=11, num_labels=0).eval()
    cache, logits = prefilled(model, [1, 2, 3])
    size = cache.nbytes + logits.numel() * logits.element_size()
    store = StateCache(max_entries=2, max_bytes=10 * size, min_tokens=3)
    store.store("m", [1, 2], cache, logits)  # too short
    assert len(store) == 0
    for first in (1, 2, 3):
        store.store("m", [first, 0, 0], cache, logits)
    assert len(store) == 2 and store.lookup("m", [1, 0, 0]) is None  # least recently used went first
    by_bytes = StateCache(max_entries=10, max_bytes=2 * (size + 8), min_tokens=1)  # each key: 8 bytes a token
    for first in (1, 2, 3):
        by_bytes.store("m", [first], cache, logits)
    assert len(by_bytes) == 2
