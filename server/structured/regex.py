"""Python regular expressions -> the same language in a plain dialect every constraint library reads alike.

``structured_outputs.regex`` means what ``re.fullmatch`` means, whatever the library's dialect: the pattern is parsed by
Python's own parser and written back with groups, alternation, counted repetition and every single-character item as the
explicit code-point ranges ``re`` matches (``(?i)\\w`` becomes ``[0-9A-Z_a-z\\u{aa}...]``); lazy quantifiers become
greedy. :class:`PatternError` names what is refused: back-references, look-arounds, anchors, word boundaries,
conditionals, possessive quantifiers, atomic groups, and plain forms over ``max_length``.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

# re's private parser modules (typeshed has no stubs for them), as automata/regex.py imports them on 3.10 and 3.11+
from automata.regex import REFUSED_CONSTRUCTS, regex_compiler, regex_constants, regex_parser, single_character_item  # type: ignore[attr-defined]

LAST_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # not characters: no UTF-8 text holds them
# Every character in order, in two runs around the surrogates, so that a run of matches is a run of code points.
_CHARACTER_RUNS = (
    (0, "".join(map(chr, range(SURROGATES[0])))),
    (SURROGATES[1] + 1, "".join(map(chr, range(SURROGATES[1] + 1, LAST_CODE_POINT + 1)))),
)
_REPEATS = {regex_constants.MAX_REPEAT, regex_constants.MIN_REPEAT}
_SAFE_LITERALS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")

Ranges = tuple[tuple[int, int], ...]  # inclusive (first, last) code points, sorted, disjoint


class PatternError(ValueError):
    """A pattern that cannot be a constraint; the message names why. ``over_limit``: it is only too large or too
    slow to rewrite."""

    def __init__(self, message: str, over_limit: bool = False) -> None:
        super().__init__(message)
        self.over_limit = over_limit


def plain_regex(pattern: str, max_length: int = 1 << 20, deadline: float | None = None) -> str:
    """``pattern`` (Python syntax) as a plain regex matching the same strings whole; raises :class:`PatternError` if
    refused, longer than ``max_length`` characters or past ``deadline`` (``time.monotonic()``)."""
    try:
        parsed = regex_parser.parse(pattern)
        return _Writer(max_length, deadline).sequence(parsed, parsed.state.flags)
    except re.error as error:
        raise PatternError(f"invalid regular expression: {error}") from None
    except RecursionError:  # Python's parser, and the writer, recurse once per level of nesting
        raise PatternError("the pattern is nested too deeply", over_limit=True) from None


def literal_regex(text: str) -> str:
    """A plain regex matching exactly ``text``."""
    return "".join(_character(ord(character)) for character in text)


class _Writer:
    def __init__(self, max_length: int, deadline: float | None) -> None:
        self.max_length, self.deadline, self.length = max_length, deadline, 0

    def sequence(self, items: Iterable[tuple[object, Any]], flags: int) -> str:
        return "".join(self.item(op, argument, flags) for op, argument in items)

    def item(self, op: object, argument: Any, flags: int) -> str:
        if op is regex_constants.SUBPATTERN:
            _group, add_flags, del_flags, items = argument
            return self._grow(f"(?:{self.sequence(items, (flags | add_flags) & ~del_flags)})")
        if op is regex_constants.BRANCH:
            return self._grow("(?:" + "|".join(self.sequence(items, flags) for items in argument[1]) + ")")
        if op in _REPEATS:
            least, most, items = argument
            upper = "" if most is regex_constants.MAXREPEAT else str(most)
            return self._grow(f"(?:{self.sequence(items, flags)}){{{least},{upper}}}")
        if op in (regex_constants.LITERAL, regex_constants.NOT_LITERAL, regex_constants.ANY, regex_constants.IN):
            return self._grow(_class(self._characters(op, argument, flags)))
        reason = REFUSED_CONSTRUCTS.get(str(op), f"the construct {op}")
        raise PatternError(f"{reason} cannot be a structured-output constraint")

    def _grow(self, text: str) -> str:
        self.length += len(text)
        if self.length > self.max_length:
            raise PatternError(f"the pattern's plain form exceeds {self.max_length} characters", over_limit=True)
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise PatternError("rewriting the pattern took too long", over_limit=True)
        return text

    def _characters(self, op: object, argument: Any, flags: int) -> Ranges:
        if op is regex_constants.LITERAL and not flags & re.IGNORECASE:
            return ((argument, argument),)
        # A key without the parser state: ranges depend only on the item and the flags that change its meaning.
        key = repr((op, argument, flags & (re.IGNORECASE | re.DOTALL | re.ASCII | re.UNICODE)))
        return _matched_ranges(key, single_character_item(op, argument, flags), flags)


_RANGES: dict[str, Ranges] = {}  # item and flags -> its ranges (cached: finding them scans every character)
MAX_CACHED_ITEMS = 1024


def _matched_ranges(key: str, single: Any, flags: int) -> Ranges:
    """The code points ``re`` matches with the single-character item (compiled with ``flags``), as ranges."""
    if key in _RANGES:
        return _RANGES[key]
    one_or_more = (regex_constants.MAX_REPEAT, (1, regex_constants.MAXREPEAT, single))
    repeated = regex_parser.SubPattern(single.state, [one_or_more])
    matcher = regex_compiler.compile(repeated, flags)
    ranges = tuple(
        (first + match.start(), first + match.end() - 1)
        for first, characters in _CHARACTER_RUNS
        for match in matcher.finditer(characters)
    )
    if len(_RANGES) < MAX_CACHED_ITEMS:
        _RANGES[key] = ranges
    return ranges


def _class(ranges: Ranges) -> str:
    if len(ranges) == 1 and ranges[0][0] == ranges[0][1]:
        return _character(ranges[0][0])
    if not ranges:
        return f"[^\\u{{0}}-\\u{{{LAST_CODE_POINT:x}}}]"  # matches nothing
    members = "".join(_character(a) if a == b else f"{_character(a)}-{_character(b)}" for a, b in ranges)
    return f"[{members}]"


def _character(code_point: int) -> str:
    character = chr(code_point)
    return character if character in _SAFE_LITERALS else f"\\u{{{code_point:x}}}"
