"""Argument types and the error style of every ``python -m training`` subcommand.

Bad input is a :class:`UsageError` (argparse's own errors become one through :class:`Parser`): the command
prints its message as one line on stderr and exits with status 2 (training/cli/main.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

_Number = TypeVar("_Number", int, float)


class UsageError(Exception):
    """Bad input: the message is printed as one line and the command exits with status 2."""


class Parser(argparse.ArgumentParser):
    """argparse's own errors become a UsageError; no abbreviated flags (``--res`` is not ``--resume``)."""

    def __init__(self, **kwargs: Any) -> None:  # keywords only, as add_subparsers' add_parser passes them
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}")


def length_range(text: str) -> tuple[int, int]:
    """ "A-B" -> (A, B) with 1 <= A <= B."""
    parts = text.split("-")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"invalid length range {text!r}: expected A-B, e.g. 41-500")
    shortest, longest = int(parts[0]), int(parts[1])
    if shortest < 1:
        raise argparse.ArgumentTypeError(f"invalid length range {text!r}: lengths start at 1")
    if shortest > longest:
        raise argparse.ArgumentTypeError(f"invalid length range {text!r}: {shortest} > {longest}")
    return shortest, longest


def band_spec(text: str) -> int | list[tuple[int, int]]:
    """ "N" (that many bands) or "A-B,C-D,..." (explicit bands)."""
    if text.isdigit():
        return positive_int(text)
    return [length_range(part) for part in text.split(",")]


def _checked_number(
    kind: type[_Number], accept: Callable[[_Number], bool], requirement: str
) -> Callable[[str], _Number]:
    """An argparse type: ``text`` read as ``kind``, refused unless ``accept(value)``."""

    def parse(text: str) -> _Number:
        value = _number(text, kind)
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value

    return parse


positive_int = _checked_number(int, lambda value: value >= 1, "a positive integer")
non_negative_int = _checked_number(int, lambda value: value >= 0, "0 or more")
positive_float = _checked_number(float, lambda value: value > 0, "positive")
non_negative_float = _checked_number(float, lambda value: 0 <= value < float("inf"), "a finite number, 0 or more")
probability = _checked_number(float, lambda value: 0.0 <= value <= 1.0, "a probability in [0, 1]")


def probability_or_range(text: str) -> float | tuple[float, float]:
    """ "P" -> P, or "A-B" -> (A, B) with 0 <= A <= B <= 1."""
    if "-" not in text:
        return probability(text)
    parts = text.split("-")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"invalid probability range {text!r}: expected P or A-B, e.g. 0.05-0.95")
    lo, hi = (probability(part) for part in parts)
    if lo > hi:
        raise argparse.ArgumentTypeError(f"invalid probability range {text!r}: {lo} > {hi}")
    return lo, hi


def _number(text: str, kind: type[_Number]) -> _Number:
    try:
        return kind(text)
    except ValueError:
        expected = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def multiples(text: str) -> tuple[float, ...]:
    """ "1,2,4": positive, increasing numbers."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, e.g. 1,2,4,8,16, got {text!r}") from None
    if any(value <= 0 for value in values) or list(values) != sorted(values):
        raise argparse.ArgumentTypeError(f"multiples must be positive and increasing, got {text!r}")
    return values


def token_counts(text: str) -> tuple[int, ...]:
    """ "1k,8k,64k,1M": positive token counts, k = 1024 and M = 1048576 (plain integers too), increasing."""
    units = {"k": 2**10, "M": 2**20}
    values = []
    for part in text.split(","):
        digits, unit = (part[:-1], units[part[-1]]) if part[-1:] in units else (part, 1)
        if not digits.isdigit() or int(digits) < 1:
            raise argparse.ArgumentTypeError(f"expected token counts like 1k,8k,64k,1M or 1000, got {part!r}")
        values.append(int(digits) * unit)
    if values != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"token counts must increase, got {text!r}")
    return tuple(values)


def fractions(text: str) -> tuple[float, ...]:
    """ "0,0.5,1": distinct numbers in [0, 1]."""
    values = tuple(probability(part) for part in text.split(","))
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"fractions must differ, got {text!r}")
    return values


def add_threads(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--threads",
        type=positive_int,
        help="torch intra-op threads (default: max(1, (cores - 1) // processes), model/threads.py)",
    )
