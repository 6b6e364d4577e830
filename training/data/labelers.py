"""Reference labelers: the label at every position of a string, written from the task definitions (docs/api.md,
Tasks); the ground truth for the automata, data and models. Symbols are assumed in the alphabet (``Task.label``
checks them).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

from automata.task_automata import CYCLE_MOVES, DIGITS, INDUCTION_MARK, NO_KEY, OPERATORS


def _binary(flags: list[bool]) -> list[str]:
    return ["1" if flag else "0" for flag in flags]


def parity_check(string: str) -> list[str]:
    """Number of 1s so far, mod 2."""
    return [str(ones % 2) for ones in accumulate(symbol == "1" for symbol in string)]


def even_pairs(string: str) -> list[str]:
    """1 while the number of adjacent unequal pairs so far is even."""
    changes = accumulate(position > 0 and string[position] != string[position - 1] for position in range(len(string)))
    return _binary([count % 2 == 0 for count in changes])


def cycle_navigation(string: str) -> list[str]:
    """Position on a 5-cycle starting at 0: "0" moves -1, "1" stays, "2" moves +1."""
    return [str(position % 5) for position in accumulate(CYCLE_MOVES[symbol] for symbol in string)]


def sum_mod5(string: str) -> list[str]:
    """Sum of the digits so far, mod 5."""
    return [str(total % 5) for total in accumulate(int(symbol) for symbol in string)]


def even_pair_mod5(string: str) -> list[str]:
    """1 where the symbol equals the first one."""
    return _binary([symbol == string[0] for symbol in string])


def first(string: str) -> list[str]:
    """1 everywhere if the first symbol is 1."""
    return _binary([string[:1] == "1"] * len(string))


def one(string: str) -> list[str]:
    """1 while exactly one 1 has been read."""
    return _binary([ones == 1 for ones in accumulate(symbol == "1" for symbol in string)])


def palindrome(string: str) -> list[str]:
    """1 where the prefix reads the same backwards."""
    return _binary([string[: end + 1] == string[end::-1] for end in range(len(string))])


def dyck(max_depth: int) -> Callable[[str], list[str]]:
    """The labeler of D_max_depth: D_0 = {empty}, D_n = (a D_{n-1} b)*.

    A prefix is in D_n when its a/b brackets are balanced, never close more than they opened, and never nest
    deeper than n.
    """

    def label(string: str) -> list[str]:
        depth, broken, flags = 0, False, []
        for symbol in string:
            depth += 1 if symbol == "a" else -1
            broken = broken or not 0 <= depth <= max_depth
            flags.append(depth == 0 and not broken)
        return _binary(flags)

    return label


def tomita3(string: str) -> list[str]:
    """1 while the prefix has no odd run of 1s immediately followed by an odd run of 0s.

    Runs are maximal within the prefix, so the run at its end counts with the length it has so far.
    """
    runs: list[tuple[str, int]] = []  # (symbol, length) of each run so far; only the last one can still grow
    violated_before_last_run, flags = False, []
    for symbol in string:
        if runs and runs[-1][0] == symbol:
            runs[-1] = (symbol, runs[-1][1] + 1)
        else:
            violated_before_last_run = violated_before_last_run or _odd_ones_then_odd_zeros(runs[-2:])
            runs.append((symbol, 1))
        flags.append(not (violated_before_last_run or _odd_ones_then_odd_zeros(runs[-2:])))
    return _binary(flags)


def _odd_ones_then_odd_zeros(two_runs: list[tuple[str, int]]) -> bool:
    return [(symbol, length % 2) for symbol, length in two_runs] == [("1", 1), ("0", 1)]


def tomita4(string: str) -> list[str]:
    """1 while the prefix has no 000."""
    start = string.find("000")
    return _binary([start == -1 or end < start + 2 for end in range(len(string))])


def tomita5(string: str) -> list[str]:
    """1 while both the number of 0s and the number of 1s are even."""
    ones = accumulate(symbol == "1" for symbol in string)
    return _binary([count % 2 == 0 and (length - count) % 2 == 0 for length, count in enumerate(ones, start=1)])


def tomita6(string: str) -> list[str]:
    """1 while #0 - #1 is divisible by 3."""
    return _binary([excess % 3 == 0 for excess in accumulate(1 if symbol == "0" else -1 for symbol in string)])


def modular_arithmetic(string: str) -> list[str]:
    """Value mod 5 of the expression read so far, "*" binding tighter than "+" and "-".

    Digits stand at even positions and operators at odd ones; at an operator the label repeats the previous one.
    The value is the sum of the finished terms plus the product being built (signed by the "+" or "-" before it).
    """
    finished_terms, product = 0, 0
    labels: list[str] = []
    for position, symbol in enumerate(string):
        expected = DIGITS if position % 2 == 0 else OPERATORS
        if symbol not in expected:
            raise ValueError(f"modular_arithmetic: expected one of {expected!r} at position {position}, got {symbol!r}")
        if position % 2 == 1:
            labels.append(labels[-1])
            continue
        operator = string[position - 1] if position > 0 else "+"
        if operator == "*":
            product *= int(symbol)
        else:
            finished_terms += product
            product = int(symbol) if operator == "+" else -int(symbol)
        labels.append(str((finished_terms + product) % 5))
    return labels


def s5_generators(string: str) -> list[str]:
    """The word problem of S5: five balls 0..4 in slots 0..4, in order at first; "e" leaves them, "t" swaps the
    balls of slots 0 and 1, "c" moves every ball one slot left (slot 0's to slot 4). The label is the row of balls,
    e.g. "10234": the running product of the generators in one-line notation (docs/api.md, Tasks)."""
    return _slot_moves(string, {"e": _stay, "t": _swap_first_two, "c": _rotate_left(5)})


def a5_generators(string: str) -> list[str]:
    """The word problem of A5, as :func:`s5_generators` with "r" in place of "t": the balls of slots 0, 1, 2 move
    one slot left (slot 0's to slot 2)."""
    return _slot_moves(string, {"e": _stay, "r": _rotate_left(3), "c": _rotate_left(5)})


def _slot_moves(string: str, moves: dict[str, Callable[[list[str]], list[str]]]) -> list[str]:
    row, labels = list("01234"), []
    for symbol in string:
        row = moves[symbol](row)
        labels.append("".join(row))
    return labels


def _stay(row: list[str]) -> list[str]:
    return row


def _swap_first_two(row: list[str]) -> list[str]:
    return [row[1], row[0], *row[2:]]


def _rotate_left(width: int) -> Callable[[list[str]], list[str]]:
    """Slot i of the first ``width`` takes the ball of slot i + 1, the last of them the ball of slot 0."""
    return lambda row: [*row[1:width], row[0], *row[width:]]


def induction_heads(string: str) -> list[str]:
    """The symbol that followed the first "#" once there is one, "-" before."""
    mark = string.find(INDUCTION_MARK)
    if mark == -1 or mark + 1 == len(string):
        return [NO_KEY] * len(string)
    return [NO_KEY] * (mark + 1) + [string[mark + 1]] * (len(string) - mark - 1)
