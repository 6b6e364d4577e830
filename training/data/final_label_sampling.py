"""Drawing a string uniformly among those of a given length whose final label is a given one: count, per state,
the strings of each length that lead to the label, then walk from the start choosing each symbol in proportion to
those counts (exact, no rejection).
"""

from __future__ import annotations

import numpy as np

from automata.automaton import MooreMachine


class FinalLabelSampler:
    """Uniform sampler over the strings of a length whose final label (by ``machine``) is a given label; exact
    integer counts are kept per label up to the longest length asked."""

    def __init__(self, machine: MooreMachine) -> None:
        self.machine = machine
        self._index = {state: i for i, state in enumerate(machine.states)}
        # _successors[i][k]: index of the state reached from state i on symbol k of the alphabet
        self._successors = [
            [self._index[machine.delta[state][symbol]] for symbol in machine.alphabet] for state in machine.states
        ]
        # _completions[label][r][i]: strings of length r that lead from state i to a state labelled ``label``
        self._completions: dict[str, list[list[int]]] = {}

    def sample(self, rng: np.random.Generator, length: int, label: str) -> str | None:
        """A uniformly drawn string of ``length`` symbols whose final label is ``label``; None if there is none."""
        if length < 1:
            raise ValueError(f"length must be at least 1, got {length}")
        completions = self._completions_up_to(label, length)
        state = self._index[self.machine.start]
        if completions[length][state] == 0:
            return None
        symbols = []
        for remaining, uniform in zip(range(length, 0, -1), rng.random(length)):
            counts = [completions[remaining - 1][successor] for successor in self._successors[state]]
            k = _pick(counts, uniform)
            symbols.append(self.machine.alphabet[k])
            state = self._successors[state][k]
        return "".join(symbols)

    def _completions_up_to(self, label: str, length: int) -> list[list[int]]:
        if label not in self._completions:
            self._completions[label] = [[int(self.machine.output[state] == label) for state in self.machine.states]]
        table = self._completions[label]
        while len(table) <= length:
            shorter = table[-1]
            table.append([sum(shorter[successor] for successor in row) for row in self._successors])
        return table


def _pick(counts: list[int], uniform: float) -> int:
    """The index k chosen with probability counts[k] / sum(counts), given a uniform draw in [0, 1)."""
    total, cumulative = sum(counts), 0
    for k, count in enumerate(counts):
        cumulative += count
        if count and uniform < cumulative / total:
            return k
    raise AssertionError("unreachable: the last non-zero count brings the fraction to exactly 1")
