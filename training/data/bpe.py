"""Byte-level BPE training that writes a tiktoken ``.tiktoken`` ranks file (``python -m training bpe``).

Pre-tokenised as ``model/tokenizer.py`` encodes; ranks 0..255 are the bytes, then each merge (most frequent pair,
ties to the smaller ids) takes the next rank. ``<|endoftext|>`` is not in the file.
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


def write_ranks(tokens: list[bytes], path: str | os.PathLike[str]) -> Path:
    """Write ``tokens`` (index = rank) as a ``.tiktoken`` file: "base64 rank" per line."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = (f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens))
    path.write_text("".join(lines))
    return path
