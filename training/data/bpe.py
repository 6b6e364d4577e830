"""Byte-level BPE training that writes a tiktoken ``.tiktoken`` ranks file (``python -m training bpe``).

tiktoken encodes but cannot train, so this is a compact trainer with tiktoken's semantics built in:

- text is pre-tokenised with the same GPT-2 pattern that ``model/tokenizer.py`` gives every ``file:`` encoding,
  so merges never cross a piece boundary that the encoder will draw;
- ranks 0..255 are the single bytes (rank = byte value), then each merge gets the next rank in the order it
  is learned: the most frequent adjacent pair of tokens, ties broken by the smaller pair of ids;
- a token is a byte string: a merge whose bytes already form a token reuses that token's rank, as tiktoken
  (which merges by the rank of the concatenated bytes) would.

Pair counts are updated incrementally (only the words that hold the merged pair are recounted) and the best
pair is read off a heap with lazy invalidation, so 8k merges over the ~30k distinct words of a few MB of
English take seconds. ``<|endoftext|>`` is not in the file: ``model/tokenizer.py`` adds it after the last rank.
"""

from __future__ import annotations

import base64
import heapq
import itertools
import os
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

import regex

from model.tokenizer import GPT2_PATTERN

Pair = tuple[int, int]


def count_pieces(texts: Iterable[str]) -> Counter[bytes]:
    """How often each pre-tokenised piece (as UTF-8 bytes) occurs in ``texts``."""
    pattern = regex.compile(GPT2_PATTERN)
    counts: Counter[bytes] = Counter()
    for text in texts:
        counts.update(piece.encode() for piece in pattern.findall(text))
    return counts


def train_bpe(piece_counts: Counter[bytes], num_ranks: int) -> list[bytes]:
    """The tokens by rank: the 256 single bytes, then up to ``num_ranks - 256`` learned merges.

    Stops early when no adjacent pair occurs twice. ``num_ranks`` must be at least 256.
    """
    if num_ranks < 256:
        raise ValueError(f"num_ranks must be >= 256 (the single bytes), got {num_ranks}")
    tokens: list[bytes] = [bytes([value]) for value in range(256)]
    rank_of: dict[bytes, int] = {token: rank for rank, token in enumerate(tokens)}
    words = [list(piece) for piece in piece_counts]  # each word as token ids (initially its bytes)
    frequency = list(piece_counts.values())
    pair_count: Counter[Pair] = Counter()
    holders: defaultdict[Pair, set[int]] = defaultdict(set)  # pair -> indices of the words that hold it
    for index, word in enumerate(words):
        for pair in itertools.pairwise(word):
            pair_count[pair] += frequency[index]
            holders[pair].add(index)
    heap = [(-count, pair) for pair, count in pair_count.items()]
    heapq.heapify(heap)

    while len(tokens) < num_ranks and heap:
        negative, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -negative:
            continue  # a stale entry: the pair's count changed since it was pushed
        if -negative < 2:
            break
        merged = tokens[pair[0]] + tokens[pair[1]]
        new_id = rank_of.get(merged)
        if new_id is None:
            new_id = len(tokens)
            tokens.append(merged)
            rank_of[merged] = new_id
        changed: set[Pair] = set()
        for index in list(holders[pair]):
            word, weight = words[index], frequency[index]
            for old in itertools.pairwise(word):
                pair_count[old] -= weight
                holders[old].discard(index)
                changed.add(old)
            words[index] = word = _merge(word, pair, new_id)
            for new in itertools.pairwise(word):
                pair_count[new] += weight
                holders[new].add(index)
                changed.add(new)
        for changed_pair in changed:
            count = pair_count[changed_pair]
            if count > 0:
                heapq.heappush(heap, (-count, changed_pair))
            else:
                del pair_count[changed_pair]
    return tokens


def _merge(word: list[int], pair: Pair, new_id: int) -> list[int]:
    """``word`` with every non-overlapping occurrence of ``pair``, left to right, replaced by ``new_id``."""
    out, position = [], 0
    while position < len(word):
        if position + 1 < len(word) and word[position] == pair[0] and word[position + 1] == pair[1]:
            out.append(new_id)
            position += 2
        else:
            out.append(word[position])
            position += 1
    return out


def write_ranks(tokens: list[bytes], path: str | os.PathLike) -> Path:
    """Write ``tokens`` (index = rank) as a ``.tiktoken`` file: "base64 rank" per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens))
    path.write_text("".join(lines))
    return path
