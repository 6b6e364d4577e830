"""The million-token benchmark's retrieval prompts (the server run itself is the benchmark's, not a test's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.serve.long_context.bench_million import retrieval_prompts
from model.checkpoint import read_config
from model.tokenizer import load_tokenizer
from training.data.retrieval import HELD_OUT, NUMBER_DIGITS

CHECKPOINT = Path(__file__).resolve().parents[2] / "checkpoints" / "text-lrnn"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(read_config(CHECKPOINT).tokenizer, CHECKPOINT)


def test_retrieval_prompts_ask_held_out_values_and_share_a_prefix(tokenizer) -> None:
    prompts = retrieval_prompts(tokenizer, 2048, "number", seed=3)
    (a, value_a), (other, value_other), (b, _) = prompts["A"], prompts["A other"], prompts["B"]
    for text, value in prompts.values():
        assert len(value) in NUMBER_DIGITS[HELD_OUT] and value.isdigit() and value in text  # in its needle
    assert value_a != value_other and len(tokenizer.encode(a)) == 2048 and len(tokenizer.encode(b)) == 2048
    shared = 0
    while a[shared] == other[shared]:
        shared += 1
    assert len(a) - shared < 80  # only the question differs: the cache serves the second question
    assert retrieval_prompts(tokenizer, 2048, "number", seed=3) == prompts  # drawn from the seed alone


def test_a_format_outside_the_held_out_split_is_refused(tokenizer) -> None:
    with pytest.raises(ValueError, match="number-5"):
        retrieval_prompts(tokenizer, 2048, "number-5", seed=0)
