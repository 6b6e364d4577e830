"""Python patterns rewritten in the plain dialect (server/structured/regex.py) match exactly what re.fullmatch
matches, where the dialects differ (\\s, (?i), {,n}, scoped flags, Unicode classes) and on random patterns, as read
by llguidance over a byte-level vocabulary; non-regular constructs and oversized patterns are refused."""

from __future__ import annotations

import re
import time

import llguidance
import llguidance.tiktoken
import numpy as np
import pytest

from model.tokenizer import byte_encoding
from server.structured.regex import PatternError, literal_regex, plain_regex
from tests.automata.helpers import random_pattern

BYTES = llguidance.tiktoken.lltokenizer_from_encoding(byte_encoding(), n_vocab=257, eos_token=256)
TRICKY = ["", "a", "K", "k", "\u212a", "\x1c", " ", "\u2028", "\n", "é", "É", "٣", "3", "_", "ß", "SS", "ǅ", "😀"]


def matcher(plain: str) -> llguidance.LLMatcher:
    compiled = llguidance.LLMatcher(BYTES, llguidance.LLMatcher.grammar_from_regex(plain), log_level=0)
    assert not compiled.is_error(), compiled.get_error()
    return compiled


def accepts(compiled: llguidance.LLMatcher, text: str) -> bool:
    """Whether llguidance lets exactly ``text``'s bytes through and then end."""
    copy = compiled.deep_copy()
    return copy.consume_tokens(list(text.encode())) and copy.is_accepting()


def assert_same_language(pattern: str, probes: list[str]) -> None:
    plain, expected = plain_regex(pattern), re.compile(pattern)
    compiled = matcher(plain)
    for text in probes:
        assert accepts(compiled, text) == bool(expected.fullmatch(text)), (pattern, plain, text)


@pytest.mark.parametrize(
    "pattern",
    [
        r"\s",
        r"\S+",
        r"(?i)k",
        r"(?i:a)b",
        r"a{,3}",
        r"x*?y?",
        r".",
        r"(?s).",
        r"\d",
        r"(?a)\w",
        r"\w",
        r"[^a-c]",
        r"[\W\d]",
        r"(?i)[é-ê]",
        r"(?i)ß",
        r"é+|😀{2}",
        r"a|",
        r"(a|b)*c{2,}",
        r"\u212a",
        r"(?x) a  b # comment",
        r"[\s\S]",
        r"\x1c|\n",
        r"(?i)ǆ",
        r"(?i)a(?-i:b)k",
        r"(?s:.)(?a:\w)\w",
    ],
)
def test_plain_form_matches_what_re_fullmatch_matches(pattern: str) -> None:
    probes = TRICKY + [a + b for a in TRICKY[:12] for b in TRICKY[:12]] + ["aaa", "aaaa", "xy", "ccc", "ab", "Ab"]
    assert_same_language(pattern, probes)


def test_random_patterns_match_what_re_fullmatch_matches() -> None:
    rng = np.random.default_rng(2)
    for index in range(120):
        alphabet = ["ab", "abc", "a\n", "aB"][index % 4]
        pattern = random_pattern(rng, alphabet)
        probes = ["".join(rng.choice(list(alphabet + "K\u212a"), size=int(rng.integers(0, 7)))) for _ in range(25)]
        assert_same_language(pattern, probes)


def test_literals_are_taken_literally() -> None:
    for text in ["a.b*c", "(x)", "[^]", "\\d", "é 😀", ""]:
        assert accepts(matcher(literal_regex(text)), text)
        assert not accepts(matcher(literal_regex(text)), text + "x")


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("(?=a)a", "look-ahead"),
        ("(?<!a)b", "look-behind"),
        (r"(a)\1", "back-references"),
        ("^a", "anchors"),
        (r"a\b", "word boundaries"),
        ("(a)?(?(1)b|c)", "conditional"),
        ("a*+", "possessive"),
        ("(?>a)", "atomic"),
        ("(ab", "missing )"),
        ("a{2,1}", "min repeat greater than max repeat"),
    ],
)
def test_what_cannot_be_a_constraint_is_refused_by_name(pattern: str, words: str) -> None:
    with pytest.raises(PatternError, match=re.escape(words)) as refused:
        plain_regex(pattern)
    assert not refused.value.over_limit


def test_size_and_time_limits() -> None:
    with pytest.raises(PatternError, match="exceeds 100 characters") as refused:
        plain_regex(r"(\w|x){1,3}", max_length=100)
    assert refused.value.over_limit
    with pytest.raises(PatternError, match="took too long") as refused:
        plain_regex("a" * 50, deadline=time.monotonic() - 1)
    assert refused.value.over_limit
