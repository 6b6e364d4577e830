"""Prompt-state cache: token prefix -> a snapshot of the model's state after that prefix (``cache.clone()`` and the
logits predicting the next token).

A prompt is snapshotted when its prefill ends, and also ``tail_tokens`` before its end where long enough
(:meth:`StateCache.tail_position`); a later prompt starting with a stored prefix (the longest wins) prefills only the
rest. Entries are evicted least recently used first, by count and by bytes (snapshot and key). Only the engine's worker
thread touches it.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

from model.cache import InferenceCache


@dataclass
class Snapshot:
    cache: InferenceCache
    logits: torch.Tensor  # (V,) predicting the token after the prefix
    length: int  # prefix tokens
    key_nbytes: int = 0  # its key's bytes, where it is stored

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes + self.logits.numel() * self.logits.element_size() + self.key_nbytes


@dataclass
class CacheStats:
    queries: int = 0  # lookups
    hits: int = 0  # lookups that found a prefix
    query_tokens: int = 0
    hit_tokens: int = 0


class StateCache:
    def __init__(self, max_entries: int, max_bytes: int, min_tokens: int, tail_tokens: int = 0) -> None:
        self.max_entries, self.max_bytes, self.min_tokens = max_entries, max_bytes, min_tokens
        self.tail_tokens = tail_tokens
        self._entries: OrderedDict[tuple[str, bytes], Snapshot] = OrderedDict()
        self._bytes = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, model_id: str, tokens: list[int]) -> Snapshot | None:
        """The snapshot of the longest stored prefix of ``tokens`` (a fresh clone of it), or None."""
        self.stats.queries += 1
        self.stats.query_tokens += len(tokens)
        best = self._longest(model_id, tokens)
        if best is None:
            return None
        self._entries.move_to_end(best)
        snapshot = self._entries[best]
        self.stats.hits += 1
        self.stats.hit_tokens += snapshot.length
        return Snapshot(snapshot.cache.clone(), snapshot.logits, snapshot.length)

    def peek(self, model_id: str, tokens: list[int]) -> int:
        """How many tokens :meth:`lookup` would take from the cache now (0: none); changes nothing."""
        best = self._longest(model_id, tokens)
        return 0 if best is None else self._entries[best].length

    def _longest(self, model_id: str, tokens: list[int]) -> tuple[str, bytes] | None:
        """The key of the longest stored prefix of ``tokens``, or None."""
        key = _key(tokens)
        best = None
        for entry_key in self._entries:
            entry_model, prefix = entry_key
            if entry_model == model_id and key.startswith(prefix) and (best is None or len(prefix) > len(best[1])):
                best = entry_key
        return best

    def tail_position(self, prompt_tokens: int) -> int | None:
        """Where a prompt of ``prompt_tokens`` tokens is also snapshotted: ``tail_tokens`` before its end, or None (off,
        or too short)."""
        position = prompt_tokens - self.tail_tokens
        if self.tail_tokens == 0 or self.max_entries == 0 or position < max(self.min_tokens, self.tail_tokens):
            return None
        return position

    def keeps(self, prompt_tokens: int) -> bool:
        """Whether :meth:`store` may keep a prompt of ``prompt_tokens`` tokens: not a short one, and the cache is on."""
        return prompt_tokens >= self.min_tokens and self.max_entries > 0

    def store(self, model_id: str, tokens: list[int], cache: InferenceCache, logits: torch.Tensor) -> None:
        """Keep a snapshot of ``cache`` after ``tokens`` (nothing for short prompts or when it cannot fit)."""
        if not self.keeps(len(tokens)):
            return
        key = (model_id, _key(tokens))
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if cache.nbytes + logits.numel() * logits.element_size() + len(key[1]) > self.max_bytes:
            return
        snapshot = Snapshot(cache.clone(), logits.detach().clone(), len(tokens), len(key[1]))
        self._entries[key] = snapshot
        self._bytes += snapshot.nbytes
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= evicted.nbytes


def _key(tokens: list[int]) -> bytes:
    """Fixed-width bytes of the token ids, so that "is a prefix of" is a byte-string prefix test."""
    return array("q", tokens).tobytes()
