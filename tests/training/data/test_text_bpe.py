"""The BPE trainer: a ranks file that tiktoken loads, learned merges, determinism, and round trips of
arbitrary Unicode through the trained encoding. No network."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from model.tokenizer import load_tokenizer
from training.data.bpe import count_pieces, train_bpe, write_ranks

CORPUS = [
    "the cat sat on the mat. the cat ate the rat.\n\nThe mat was flat; the rat was fat. " * 20,
    "naïve café — 日本語 👋 the the the",
]

pytestmark = pytest.mark.usefixtures("no_network")


def random_unicode(seed: int, length: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(length):
        code = rng.randrange(0x110000 - 0x800)
        out.append(chr(code + 0x800 if code >= 0xD800 else code))  # no lone surrogates
    return "".join(out)


@pytest.fixture
def trained(tmp_path):
    tokens = train_bpe(count_pieces(CORPUS), 300)
    write_ranks(tokens, tmp_path / "tiny.tiktoken")
    return tokens, load_tokenizer("file:tiny.tiktoken", tmp_path)


def test_ranks_are_bytes_then_merges(trained) -> None:
    tokens, tokenizer = trained
    assert tokens[:256] == [bytes([value]) for value in range(256)]
    assert len(set(tokens)) == len(tokens)
    assert 256 < len(tokens) <= 300
    assert tokenizer.vocab_size == len(tokens) + 1 and tokenizer.eot_token == len(tokens)
    assert b" the" in tokens and b" cat" in tokens
    assert tokenizer.encode(" cat") == [tokens.index(b" cat")]


def test_training_is_deterministic() -> None:
    assert train_bpe(count_pieces(CORPUS), 300) == train_bpe(count_pieces(reversed(CORPUS)), 300)


def test_merges_stop_when_no_pair_repeats() -> None:
    tokens = train_bpe(Counter({b"ab": 1, b"cd": 1}), 1000)
    assert len(tokens) == 256


@pytest.mark.parametrize(
    "text", CORPUS + ["", "\x00\t\r\n  ", "<|endoftext|>"] + [random_unicode(s, 400) for s in range(5)]
)
def test_round_trip(trained, text: str) -> None:
    _, tokenizer = trained
    tokens = tokenizer.encode(text)
    assert tokenizer.decode(tokens) == text
    assert all(0 <= token < tokenizer.vocab_size - 1 for token in tokens)  # never the special token


def test_compresses_the_training_text(trained) -> None:
    _, tokenizer = trained
    assert len(tokenizer.encode(CORPUS[0])) < len(CORPUS[0].encode()) / 3


def test_too_few_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="256"):
        train_bpe(Counter({b"a": 1}), 100)
