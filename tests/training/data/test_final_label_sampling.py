"""Sampling conditioned on the final label: exactly the right strings, each about equally often."""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest

from automata.task_automata import dyck, tomita6
from training.data.final_label_sampling import FinalLabelSampler


def strings_with_final_label(machine, length: int, label: str) -> set[str]:
    every = map("".join, itertools.product(machine.alphabet, repeat=length))
    return {string for string in every if machine.transduce(string)[-1] == label}


@pytest.mark.parametrize("label", ["0", "1"])
def test_draws_cover_exactly_the_strings_with_that_label_uniformly(label: str) -> None:
    machine, length = tomita6(), 6
    sampler, rng = FinalLabelSampler(machine), np.random.default_rng(0)
    expected = strings_with_final_label(machine, length, label)
    counts = Counter(sampler.sample(rng, length, label) for _ in range(100 * len(expected)))
    assert set(counts) == expected
    assert min(counts.values()) > 60 and max(counts.values()) < 140  # 100 expected each; a 4-sigma band


def test_none_when_no_string_has_that_label() -> None:
    sampler = FinalLabelSampler(dyck(2))
    assert sampler.sample(np.random.default_rng(0), 5, "1") is None


def test_lengths_shorter_than_one_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FinalLabelSampler(dyck(2)).sample(np.random.default_rng(0), 0, "1")
