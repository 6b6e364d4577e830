"""Regular expressions as DFAs (training/regex.py) and compiled models: the DFA labels every prefix as
``re.fullmatch`` does (hand-written and 240 random patterns), it is minimal, and ``compile --regex`` writes a
model exact at every length tested up to 10**5."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from benchmarks.compiler_sweep import live_string
from model.checkpoint import load_checkpoint
from tests.training.test_compiler import assert_exact_on_every_string, assert_transduces
from training.automaton import AutomatonError, MooreMachine
from training.compile_cli import main
from training.compiler import COMPILERS
from training.regex import regex_dfa

HAND_WRITTEN = [
    ("(ab)*c?", "abc"), ("(b*ab*a)*b*", "ab"), ("a{2,4}b+", "ab"), ("[^a]*a[^a]*", "abc"), ("(a|bc)*", "abc"),
    (".*aba.*", "ab"), ("(0|1(01*0)*1)*", "01"), ("a?b?c?", "abc"), ("x", "ab"), ("", "ab"), ("(?:ab|ba)+", "ab"),
    ("[ab]*c[ab]*c[ab]*", "abc"), ("\\d+", "0a"), ("a.b", "ab\n"), ("(a*b*)*", "ab"),
    ("(?i:a)b", "aAbB"), ("(?i)a(?-i:b)", "aAbB"), ("a(?s:.)b.", "ab\n"),
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


def random_pattern(rng: np.random.Generator, alphabet: str, depth: int = 0) -> str:
    """A random regular expression over ``alphabet``: symbols, classes, '.', concatenation, alternation,
    optional, star, plus and bounded repetition, nested three deep. (interegular builds its automaton over every
    character before we restrict it to the alphabet, and counted repetitions of starred groups inside a starred
    group take it 10-20 s and 10,000 states: counted repetition is kept to the innermost groups here.)"""
    if depth >= 3 or rng.random() < 0.3:
        kind = rng.integers(4)
        if kind == 0:
            return "."
        if kind == 1:
            members = "".join(sorted(set(rng.choice(list(alphabet), size=2))))
            return f"[{'^' if rng.random() < 0.3 else ''}{members}]"
        return re.escape(str(rng.choice(list(alphabet))))
    kind = rng.integers(6)
    parts = [random_pattern(rng, alphabet, depth + 1) for _ in range(int(rng.integers(1, 4)))]
    if kind == 0:
        return "".join(parts)
    if kind == 1:
        return "(" + "|".join(parts) + ")"
    counted = f"{{{rng.integers(0, 3)},{rng.integers(3, 5)}}}" if depth == 2 else "?"
    suffix = ["*", "+", "?", counted][kind - 2]
    return "(" + "".join(parts) + ")" + suffix


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


@pytest.mark.parametrize(("pattern", "problem"), [
    ("(a", "invalid regular expression"), ("a$", "anchors and word boundaries"), ("(a)\\1", "back-references"),
    ("(?=a)a", "look-ahead"), ("a*+", "possessive"), ("a{100000}b{100000}c{100000}", "more than 200000 NFA states"),
])
def test_bad_patterns_are_refused_with_a_message(pattern: str, problem: str) -> None:
    with pytest.raises(AutomatonError, match=problem):
        regex_dfa(pattern, "ab")


@pytest.mark.parametrize("arch", sorted(COMPILERS))
def test_compile_regex_writes_an_exact_model(arch: str, tmp_path, capsys) -> None:
    out = tmp_path / arch
    assert main(["--regex", "(ab|b)*a?", "--alphabet", "ab", "--arch", arch, "--out", str(out)]) == 0
    loaded = load_checkpoint(out, device="cpu")
    assert loaded.config.alphabet == "ab" and loaded.config.labels == ("0", "1")
    dfa = regex_dfa("(ab|b)*a?", "ab")
    assert_exact_on_every_string(loaded.model, dfa, 8)
    rng = np.random.default_rng(0)
    assert_transduces(loaded.model, dfa, [live_string(dfa, 3000, rng)])


@pytest.mark.slow
def test_a_compiled_regex_is_exact_at_a_hundred_thousand_symbols() -> None:
    dfa = regex_dfa("(0|1(01*0)*1)*", "01")  # multiples of three in binary: never dies
    string = "".join(np.random.default_rng(3).choice(["0", "1"], size=100_000))
    expected = torch.tensor([re.fullmatch("(0|1(01*0)*1)*", string[:end]) is not None
                             for end in (1, 2, 99_999, 100_000)])
    assert dfa.run(string[:2]) + dfa.run(string)[-2:] == expected.tolist()
    for arch in sorted(COMPILERS):
        model, _ = COMPILERS[arch](dfa)
        assert_transduces(model, dfa, [string])


@pytest.mark.parametrize(("argv", "message"), [
    (["--regex", "a"], "--regex needs --alphabet"),
    (["--alphabet", "ab"], "give a DFA JSON file or --regex PATTERN"),
    (["--regex", "(a", "--alphabet", "ab"], "invalid regular expression '(a'"),
])
def test_compile_regex_refuses_bad_input_with_exit_2(argv: list[str], message: str, tmp_path, capsys) -> None:
    assert main([*argv, "--arch", "lrnn", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
