"""Regular expressions as DFAs (automata/regex.py) and compiled models: the DFA labels every prefix as
``re.fullmatch`` does (hand-written and 240 random patterns), it is minimal, and its compiled models are exact at
every length tested up to 10**5 (``compile --regex``: tests/training/cli/test_compile_cli.py)."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from automata.automaton import AutomatonError, MooreMachine
from automata.compiler import COMPILERS
from automata.regex import regex_dfa
from tests.automata.helpers import assert_transduces, random_pattern

HAND_WRITTEN = [
    ("(ab)*c?", "abc"),
    ("(b*ab*a)*b*", "ab"),
    ("a{2,4}b+", "ab"),
    ("[^a]*a[^a]*", "abc"),
    ("(a|bc)*", "abc"),
    (".*aba.*", "ab"),
    ("(0|1(01*0)*1)*", "01"),
    ("a?b?c?", "abc"),
    ("x", "ab"),
    ("", "ab"),
    ("(?:ab|ba)+", "ab"),
    ("[ab]*c[ab]*c[ab]*", "abc"),
    ("\\d+", "0a"),
    ("a.b", "ab\n"),
    ("(a*b*)*", "ab"),
    ("(?i:a)b", "aAbB"),
    ("(?i)a(?-i:b)", "aAbB"),
    ("a(?s:.)b.", "ab\n"),
]


def assert_matches_fullmatch(pattern: str, alphabet: str, strings: list[str]) -> None:
    dfa = regex_dfa(pattern, alphabet)
    compiled = re.compile(pattern)
    for string in strings:
        expected = [compiled.fullmatch(string[:end]) is not None for end in range(1, len(string) + 1)]
        assert dfa.run(string) == expected, (pattern, string)


def every_string(alphabet: str, longest: int) -> list[str]:
    return ["".join(s) for n in range(1, longest + 1) for s in itertools.product(alphabet, repeat=n)]


@pytest.mark.parametrize(("pattern", "alphabet"), HAND_WRITTEN)
def test_hand_written_patterns_label_every_prefix_like_re_fullmatch(pattern: str, alphabet: str) -> None:
    rng = np.random.default_rng(0)
    randoms = ["".join(rng.choice(list(alphabet), size=40)) for _ in range(20)]
    assert_matches_fullmatch(pattern, alphabet, every_string(alphabet, 6) + randoms)


def test_random_patterns_label_every_prefix_like_re_fullmatch() -> None:
    rng = np.random.default_rng(1)
    for index in range(240):
        alphabet = "ab" if index % 2 else "abc"
        pattern = random_pattern(rng, alphabet)
        # longer strings would make re itself the slow part: it backtracks exponentially on nested quantifiers
        strings = every_string(alphabet, 4) + ["".join(rng.choice(list(alphabet), size=12)) for _ in range(8)]
        assert_matches_fullmatch(pattern, alphabet, strings)


def test_the_dfa_is_minimal() -> None:
    assert len(regex_dfa("(b*ab*a)*b*", "ab").states) == 2  # even number of a: parity
    assert len(regex_dfa("(a|b)*", "ab").states) == 1
    assert len(regex_dfa("x", "ab").states) == 1  # nothing over this alphabet matches: one dead state
    assert len(regex_dfa("(0|1(01*0)*1)*", "01").states) == 3  # binary multiples of 3
    # a machine with duplicated states shrinks to the minimal one and keeps its outputs
    doubled = MooreMachine.explore("twice", "ab", 0, lambda q, s: (q + (s == "a")) % 4, lambda q: str(q % 2))
    assert len(doubled.states) == 4 and len(doubled.minimal().states) == 2
    assert doubled.minimal().transduce("aabab") == doubled.transduce("aabab")


@pytest.mark.parametrize(
    ("pattern", "problem"),
    [
        ("(a", "invalid regular expression"),
        ("a$", "anchors and word boundaries"),
        ("(a)\\1", "back-references"),
        ("(?=a)a", "look-ahead"),
        ("a*+", "possessive"),
        ("a{100000}b{100000}c{100000}", "more than 200000 NFA states"),
    ],
)
def test_bad_patterns_are_refused_with_a_message(pattern: str, problem: str) -> None:
    with pytest.raises(AutomatonError, match=problem):
        regex_dfa(pattern, "ab")


@pytest.mark.slow
def test_a_compiled_regex_is_exact_at_a_hundred_thousand_symbols() -> None:
    dfa = regex_dfa("(0|1(01*0)*1)*", "01")  # multiples of three in binary: never dies
    string = "".join(np.random.default_rng(3).choice(["0", "1"], size=100_000))
    expected = torch.tensor(
        [re.fullmatch("(0|1(01*0)*1)*", string[:end]) is not None for end in (1, 2, 99_999, 100_000)]
    )
    assert dfa.run(string[:2]) + dfa.run(string)[-2:] == expected.tolist()
    for arch in sorted(COMPILERS):
        model, _ = COMPILERS[arch](dfa)
        assert_transduces(model, dfa, [string])
