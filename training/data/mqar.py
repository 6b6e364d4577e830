"""Multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"): a row opens with key-value pairs, a key one
token and a value a run of one or more, text follows, and the row ends in every key again, each followed by its
value. The tokenizer's ordinary ids are split by residue: ids divisible by ``HELD_OUT_MODULUS`` are the held-out
split, never a key or a value of a trained row, so a model right on them copies a token rather than recalling one it
was taught to answer."""

from __future__ import annotations

import numpy as np
import torch

from model.tokenizer import Tokenizer
from training.data.batches import IGNORE_INDEX

HELD_OUT_MODULUS = 8
TRAINED, HELD_OUT = "trained", "held-out"
MAX_PAIRS = 64
MAX_VALUE_TOKENS = 16


def split_ids(tokenizer: Tokenizer, split: str) -> np.ndarray:
    """The ordinary (not special) token ids of ``split``, ascending: (N,) int64."""
    if split not in (TRAINED, HELD_OUT):
        raise ValueError(f"unknown split {split!r}: {TRAINED!r} or {HELD_OUT!r}")
    special = [tokenizer.encoding.encode_single_token(text) for text in tokenizer.encoding.special_tokens_set]
    ids = np.setdiff1d(np.arange(tokenizer.vocab_size, dtype=np.int64), np.asarray(special, dtype=np.int64))
    held = ids % HELD_OUT_MODULUS == 0
    chosen: np.ndarray = ids[held] if split == HELD_OUT else ids[~held]
    return chosen


def row_ids(pairs: int, value_tokens: int = 1) -> int:
    """How many distinct ids a row of ``pairs`` pairs of ``value_tokens``-token values draws: its keys and values."""
    return pairs * (1 + value_tokens)


def shortest_row(pairs: int, value_tokens: int = 1) -> int:
    """The fewest tokens a row of ``pairs`` pairs of ``value_tokens``-token values takes: the pairs, one token of
    text, the queries and answers."""
    return 2 * row_ids(pairs, value_tokens) + 1


def mqar_row(
    rng: np.random.Generator, ids: np.ndarray, size: int, pairs: int, text: np.ndarray, value_tokens: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(size,) tokens and (size - 1,) targets: ``pairs`` keys and values of ``value_tokens`` tokens, all distinct
    tokens drawn from ``ids`` (k1 v1 ... kn vn), then ``text`` up to the last ``pairs * (1 + value_tokens)`` tokens,
    then the keys in a random order, each followed by its value; scored on those values only (target j is token
    j + 1). ``text`` holds at least ``size`` tokens."""
    shortest, distinct = shortest_row(pairs, value_tokens), row_ids(pairs, value_tokens)
    if size < shortest:
        raise ValueError(
            f"a row of {pairs} pairs of {value_tokens}-token values needs at least {shortest} tokens, not {size}"
        )
    if len(ids) < distinct:
        raise ValueError(
            f"a row of {pairs} pairs of {value_tokens}-token values needs {distinct} distinct ids, not {len(ids)}"
        )
    drawn = rng.choice(ids, size=distinct, replace=False)
    keys, values = drawn[:pairs, None], drawn[pairs:].reshape(pairs, value_tokens)
    order = rng.permutation(pairs)
    opening = np.concatenate([keys, values], axis=1).reshape(-1)  # k1 v1 ... kn vn
    closing = np.concatenate([keys[order], values[order]], axis=1).reshape(-1)
    filler = text[: size - 2 * distinct]
    tokens = torch.from_numpy(np.concatenate([opening, filler, closing]).astype(np.int64))
    targets = torch.full((size - 1,), IGNORE_INDEX, dtype=torch.long)
    scored = torch.ones(pairs, 1 + value_tokens, dtype=torch.bool)
    scored[:, 0] = False  # the keys
    answers = (size - distinct) + scored.reshape(-1).nonzero().flatten()  # the values' positions in the closing
    targets[answers - 1] = tokens[answers]
    return tokens, targets
