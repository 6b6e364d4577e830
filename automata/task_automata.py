"""Moore machines for the regular tasks (docs/api.md, Tasks): each machine's label after every prefix is the task's
label. The binary-label ones are shipped as DFA files in ``automata/tasks``, the group word problems as Moore machine
files there (a DFA file with "output" in place of "accept"); ``python -m automata.task_automata [DIR]`` rewrites them.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Hashable
from pathlib import Path
from typing import Any

from automata.automaton import DFA, MooreMachine

AUTOMATA_DIR = Path(__file__).parent / "tasks"

CYCLE_MOVES = {"0": -1, "1": 0, "2": +1}  # cycle_navigation's moves, shared with the labelers
OPERATORS = "+-*"
DIGITS = "01234"
INDUCTION_LETTERS = "abcdefghijklmnop"
INDUCTION_MARK = "#"
NO_KEY = "-"  # the induction_heads label while no symbol has followed the first "#"

Permutation = tuple[int, ...]
"""A permutation of 0..4 in one-line notation: ``p[i]`` is the image of i."""

IDENTITY: Permutation = (0, 1, 2, 3, 4)
S5_GENERATORS: dict[str, Permutation] = {
    "e": IDENTITY,
    "t": (1, 0, 2, 3, 4),  # the transposition (0 1)
    "c": (1, 2, 3, 4, 0),  # the 5-cycle (0 1 2 3 4)
}
"""s5_generators' symbols: the identity and the two standard generators of S5 (docs/api.md, Tasks)."""

A5_GENERATORS: dict[str, Permutation] = {
    "e": IDENTITY,
    "r": (1, 2, 0, 3, 4),  # the 3-cycle (0 1 2)
    "c": (1, 2, 3, 4, 0),  # the 5-cycle (0 1 2 3 4)
}
"""a5_generators' symbols: the identity and two even permutations that generate A5."""


def _binary(flag: bool) -> str:
    return "1" if flag else "0"


def parity_check() -> MooreMachine:
    return MooreMachine.explore(
        "parity_check",
        "01",
        start=0,
        step=lambda ones, symbol: (ones + (symbol == "1")) % 2,
        output=str,
        state_name=lambda ones: ("even", "odd")[ones],
    )


def even_pairs() -> MooreMachine:
    """State: (first symbol, last symbol); the label is 1 when they are equal."""
    return MooreMachine.explore(
        "even_pairs",
        "ab",
        start=None,
        step=lambda seen, symbol: (symbol if seen is None else seen[0], symbol),
        output=lambda seen: _binary(seen is None or seen[0] == seen[1]),
        state_name=lambda seen: "start" if seen is None else f"first_{seen[0]}_last_{seen[1]}",
    )


def even_pair_mod5() -> MooreMachine:
    """State: (first symbol, whether the last symbol equals it)."""
    return MooreMachine.explore(
        "even_pair_mod5",
        DIGITS,
        start=None,
        step=lambda seen, symbol: (symbol, True) if seen is None else (seen[0], symbol == seen[0]),
        output=lambda seen: _binary(seen is not None and seen[1]),
        state_name=lambda seen: "start" if seen is None else f"first{seen[0]}_{'same' if seen[1] else 'other'}",
    )


def cycle_navigation() -> MooreMachine:
    return MooreMachine.explore(
        "cycle_navigation",
        "012",
        start=0,
        step=lambda position, symbol: (position + CYCLE_MOVES[symbol]) % 5,
        output=str,
        state_name=lambda position: f"at{position}",
    )


def sum_mod5() -> MooreMachine:
    return MooreMachine.explore(
        "sum_mod5",
        DIGITS,
        start=0,
        step=lambda total, symbol: (total + int(symbol)) % 5,
        output=str,
        state_name=lambda total: f"sum{total}",
    )


def modular_arithmetic() -> MooreMachine:
    """State: (finished terms mod 5, product being built mod 5, the operator just read or None), starting as if
    "0+" had been read. A symbol in the wrong place leads to a "malformed" sink labelled "0"."""
    start, malformed = (0, 0, "+"), "malformed"

    def step(state: Any, symbol: str) -> Hashable:
        if state == malformed or (symbol in OPERATORS) != (state[2] is None):
            return malformed
        finished, product, operator = state
        if symbol in OPERATORS:
            return (finished, product, "*") if symbol == "*" else ((finished + product) % 5, 0, symbol)
        digit = int(symbol)
        if operator == "*":
            return finished, product * digit % 5, None
        return finished, (digit if operator == "+" else -digit) % 5, None

    def state_name(state: Any) -> str:
        if state == malformed:
            return malformed
        finished, product, operator = state
        after = {None: "", "+": "_plus", "-": "_minus", "*": "_times"}[operator]
        return f"terms{finished}_product{product}{after}"

    return MooreMachine.explore(
        "modular_arithmetic",
        DIGITS + OPERATORS,
        start=start,
        step=step,
        output=lambda state: "0" if state == malformed else str(sum(state[:2]) % 5),
        state_name=state_name,
    )


def dyck(max_depth: int) -> MooreMachine:
    """State: the nesting depth, or "dead" once the prefix closed more than it opened or nested too deep."""
    return MooreMachine.explore(
        f"d{max_depth}",
        "ab",
        start=0,
        step=lambda depth, symbol: _dyck_step(depth, symbol, max_depth),
        output=lambda depth: _binary(depth == 0),
        state_name=lambda depth: "dead" if depth is None else f"depth{depth}",
    )


def _dyck_step(depth: int | None, symbol: str, max_depth: int) -> int | None:
    if depth is None:
        return None
    depth += 1 if symbol == "a" else -1
    return depth if 0 <= depth <= max_depth else None


def tomita3() -> MooreMachine:
    """The last run decides: "odd_zeros" is an odd 0-run right after an odd 1-run, and a 1 after it is fatal."""
    return MooreMachine(
        name="tomita3",
        alphabet="01",
        states=("clean", "odd_ones", "odd_zeros", "even_zeros", "dead"),
        start="clean",
        delta={
            "clean": {"0": "clean", "1": "odd_ones"},
            "odd_ones": {"0": "odd_zeros", "1": "clean"},
            "odd_zeros": {"0": "even_zeros", "1": "dead"},
            "even_zeros": {"0": "odd_zeros", "1": "odd_ones"},
            "dead": {"0": "dead", "1": "dead"},
        },
        output={"clean": "1", "odd_ones": "1", "odd_zeros": "0", "even_zeros": "1", "dead": "0"},
    )


def tomita4() -> MooreMachine:
    """State: the number of trailing 0s (below 3), or "dead" after 000."""
    return MooreMachine.explore(
        "tomita4",
        "01",
        start=0,
        step=lambda zeros, symbol: (
            None if zeros is None or zeros + (symbol == "0") == 3 else (zeros + 1 if symbol == "0" else 0)
        ),
        output=lambda zeros: _binary(zeros is not None),
        state_name=lambda zeros: "dead" if zeros is None else f"q{zeros}",
    )


def tomita5() -> MooreMachine:
    """State: (#0 mod 2, #1 mod 2)."""
    return MooreMachine.explore(
        "tomita5",
        "01",
        start=(0, 0),
        step=lambda counts, symbol: (counts[0] ^ (symbol == "0"), counts[1] ^ (symbol == "1")),
        output=lambda counts: _binary(counts == (0, 0)),
        state_name=lambda counts: f"zeros{'_odd' if counts[0] else '_even'}_ones{'_odd' if counts[1] else '_even'}",
    )


def tomita6() -> MooreMachine:
    """State: (#0 - #1) mod 3."""
    return MooreMachine.explore(
        "tomita6",
        "01",
        start=0,
        step=lambda excess, symbol: (excess + (1 if symbol == "0" else -1)) % 3,
        output=lambda excess: _binary(excess == 0),
        state_name=lambda excess: f"excess{excess}",
    )


def first() -> MooreMachine:
    return MooreMachine.explore(
        "first",
        "01",
        start="start",
        step=lambda state, symbol: f"first_{symbol}" if state == "start" else state,
        output=lambda state: _binary(state == "first_1"),
        state_name=str,
    )


def one() -> MooreMachine:
    """State: the number of 1s, counted up to 2 ("many")."""
    return MooreMachine.explore(
        "one",
        "01",
        start=0,
        step=lambda ones, symbol: min(ones + (symbol == "1"), 2),
        output=lambda ones: _binary(ones == 1),
        state_name=lambda ones: ("no_one", "one", "many")[ones],
    )


def induction_heads() -> MooreMachine:
    """State: "before_mark" until the first "#", "after_mark" just after it, then "key_x" for good, x the symbol
    that followed it (the label; "-" before). 19 states: the key may be any symbol, "#" included."""

    def step(key: str | None, symbol: str) -> str | None:  # None: no "#" yet; "": just after the first one
        if key is None:
            return "" if symbol == INDUCTION_MARK else None
        return key or symbol

    return MooreMachine.explore(
        "induction_heads",
        INDUCTION_LETTERS + INDUCTION_MARK,
        start=None,
        step=step,
        output=lambda key: key or NO_KEY,
        state_name=lambda key: "before_mark" if key is None else f"key_{key}" if key else "after_mark",
    )


def compose(product: Permutation, generator: Permutation) -> Permutation:
    """``product`` then multiplied by ``generator`` on the right: the function product(generator(i)), in one-line
    notation. Read as five balls in five slots, slot i takes the ball that was in slot generator[i]."""
    return tuple(product[image] for image in generator)


def arrangement(permutation: Permutation) -> str:
    """A group task's label and state name: the one-line notation as a string of digits, e.g. "10234"."""
    return "".join(map(str, permutation))


def word_problem(name: str, generators: dict[str, Permutation]) -> MooreMachine:
    """The right Cayley graph of the group the permutations ``generators`` generate: states are the group's
    elements (named and labelled by :func:`arrangement`), the start is the identity, and symbol s takes the running
    product p to p * generators[s] (:func:`compose`)."""
    return MooreMachine.explore(
        name,
        "".join(generators),
        start=IDENTITY,
        step=lambda product, symbol: compose(product, generators[symbol]),
        output=arrangement,
        state_name=arrangement,
    )


def s5_generators() -> MooreMachine:
    """The word problem of S5 over the identity, (0 1) and (0 1 2 3 4): 120 states."""
    return word_problem("s5_generators", S5_GENERATORS)


def a5_generators() -> MooreMachine:
    """The word problem of A5 over the identity, (0 1 2) and (0 1 2 3 4): 60 states."""
    return word_problem("a5_generators", A5_GENERATORS)


def task_machines() -> dict[str, MooreMachine]:
    """The machine of every regular task (all but palindrome), by task name."""
    machines = [cycle_navigation(), modular_arithmetic(), sum_mod5(), induction_heads()]
    return {**binary_task_machines(), **{machine.name: machine for machine in machines}, **group_task_machines()}


def group_task_machines() -> dict[str, MooreMachine]:
    """The Cayley graphs of the group word problems, by task name: the Moore machine files in AUTOMATA_DIR."""
    return {machine.name: machine for machine in (s5_generators(), a5_generators())}


def binary_task_machines() -> dict[str, MooreMachine]:
    """The machine of every regular task whose labels are "0"/"1", by task name."""
    machines = [
        parity_check(),
        even_pairs(),
        even_pair_mod5(),
        *(dyck(depth) for depth in (2, 3, 4, 12)),
        tomita3(),
        tomita4(),
        tomita5(),
        tomita6(),
        first(),
        one(),
    ]
    return {machine.name: machine for machine in machines}


def binary_task_dfas() -> dict[str, DFA]:
    """The DFA of every regular task whose labels are "0"/"1", by task name: the files in AUTOMATA_DIR."""
    return {name: DFA.from_moore(machine) for name, machine in binary_task_machines().items()}


def write_automaton_files(directory: Path = AUTOMATA_DIR) -> list[Path]:
    """Write ``<task>.json`` for each DFA of :func:`binary_task_dfas` and each machine of
    :func:`group_task_machines`; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    automata: list[DFA | MooreMachine] = [*binary_task_dfas().values(), *group_task_machines().values()]
    paths = []
    for automaton in automata:
        path = directory / f"{automaton.name}.json"
        path.write_text(json.dumps(automaton.to_json(), indent=2) + "\n")
        paths.append(path)
    return paths


if __name__ == "__main__":
    for written in write_automaton_files(Path(sys.argv[1]) if len(sys.argv) > 1 else AUTOMATA_DIR):
        print(written)
