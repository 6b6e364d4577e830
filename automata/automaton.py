"""Finite automata over single-character symbols: Moore machines and the DFA JSON files (docs/api.md, Automaton
files). A :class:`DFA` is the Moore machine labelled "1" on accepting states and "0" elsewhere. Anything malformed
is refused with an :class:`AutomatonError` whose message names it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import numpy as np

MAX_STATES = 1024
"""The most states an automaton may have: compiled weights grow as n**2 per symbol, compositions as n**3."""

JSON_KEYS = ("name", "alphabet", "states", "start", "accept", "delta")
MOORE_JSON_KEYS = ("name", "alphabet", "states", "start", "output", "delta")

Transitions = Mapping[str, Mapping[str, str]]
Parsed = TypeVar("Parsed")


class AutomatonError(ValueError):
    """An automaton that is malformed, or a string it cannot read; the message names the problem."""


class AutomatonTooLarge(AutomatonError):
    """A well-formed automaton (or regular expression) beyond a size limit; the message names the limit."""


@dataclass(frozen=True)
class MooreMachine:
    """A deterministic automaton that outputs ``output[state]`` after every symbol it reads; ``delta`` is total."""

    name: str
    alphabet: str
    states: tuple[str, ...]
    start: str
    delta: Transitions
    output: Mapping[str, str]

    def __post_init__(self) -> None:
        _check_alphabet(self.alphabet)
        _check_states(self.states)
        if self.start not in self.states:
            raise AutomatonError(f"start state {self.start!r} is not one of the states")
        _check_delta(self.delta, self.alphabet, self.states)
        for state in self.output:
            if state not in self.states:
                raise AutomatonError(f"output names unknown state {state!r}")
        for state in self.states:
            if not isinstance(self.output.get(state), str):
                raise AutomatonError(f"state {state!r} has no output label")
        object.__setattr__(self, "states", tuple(self.states))
        frozen_delta = {state: MappingProxyType(dict(self.delta[state])) for state in self.states}
        object.__setattr__(self, "delta", MappingProxyType(frozen_delta))
        object.__setattr__(self, "output", MappingProxyType(dict(self.output)))

    @classmethod
    def explore(
        cls,
        name: str,
        alphabet: str,
        start: Hashable,
        step: Callable[[Any, str], Hashable],
        output: Callable[[Any], str],
        state_name: Callable[[Any], str] = str,
        max_states: int = MAX_STATES,
    ) -> MooreMachine:
        """The machine on the states reachable from ``start`` by ``step``, numbered in breadth-first order;
        AutomatonTooLarge beyond ``max_states``."""
        order, seen = [start], {start}
        successors: dict[Hashable, dict[str, Hashable]] = {}
        for state in order:  # ``order`` grows while it is read: a breadth-first search
            successors[state] = {symbol: step(state, symbol) for symbol in alphabet}
            for successor in successors[state].values():
                if successor not in seen:
                    seen.add(successor)
                    order.append(successor)
            if len(order) > max_states:
                bound = f"MAX_STATES = {MAX_STATES}" if max_states == MAX_STATES else str(max_states)
                raise AutomatonTooLarge(f"{name}: more than {bound} reachable states")
        return cls(
            name=name,
            alphabet=alphabet,
            states=tuple(state_name(state) for state in order),
            start=state_name(start),
            delta={state_name(q): {s: state_name(nxt) for s, nxt in row.items()} for q, row in successors.items()},
            output={state_name(state): output(state) for state in order},
        )

    def minimal(self) -> MooreMachine:
        """The equivalent machine with the fewest states (Moore's partition refinement), keeping only states
        reachable from the start, numbered in breadth-first order."""
        block = {state: self.output[state] for state in self.states}  # a state's block: its label, then refined
        while True:
            signature = {
                state: (block[state], *(block[self.delta[state][s]] for s in self.alphabet)) for state in self.states
            }
            numbering = {key: str(i) for i, key in enumerate(dict.fromkeys(signature.values()))}
            refined = {state: numbering[signature[state]] for state in self.states}
            if len(set(refined.values())) == len(set(block.values())):
                break
            block = refined
        representative = {block[state]: state for state in reversed(self.states)}  # the first state of each block
        return MooreMachine.explore(
            self.name,
            self.alphabet,
            block[self.start],
            step=lambda b, symbol: block[self.delta[representative[b]][symbol]],
            output=lambda b: self.output[representative[b]],
            state_name=lambda b: f"q{b}",
        )

    def to_json(self) -> dict[str, Any]:
        """The machine as a JSON object: a DFA file's keys with "output" (each state's label) in place of
        "accept"."""
        return {
            "name": self.name,
            "alphabet": self.alphabet,
            "states": list(self.states),
            "start": self.start,
            "output": {state: self.output[state] for state in self.states},
            "delta": {state: dict(self.delta[state]) for state in self.states},
        }

    @classmethod
    def from_json(cls, data_or_path: Any) -> MooreMachine:
        """Parse a machine written as :meth:`to_json` writes it (a DFA file with "output" in place of "accept")
        from a JSON file's path or its decoded content, refusing anything malformed as :meth:`DFA.from_json` does."""
        return _parse(data_or_path, _moore_from_object)

    def trace(self, string: str) -> list[str]:
        """The state reached after each non-empty prefix of ``string``; AutomatonError on a symbol outside the
        alphabet."""
        state, visited = self.start, []
        for position, symbol in enumerate(string):
            if symbol not in self.alphabet:
                raise AutomatonError(
                    f"{self.name}: symbol {symbol!r} at position {position} is not in the alphabet {self.alphabet!r}"
                )
            state = self.delta[state][symbol]
            visited.append(state)
        return visited

    def transduce(self, string: str) -> list[str]:
        """The label after each prefix of ``string``."""
        return [self.output[state] for state in self.trace(string)]

    def transition_matrices(self) -> np.ndarray:
        """(len(alphabet), n, n) float32 0/1 matrices: column i of ``M[k]`` is the one-hot image of ``states[i]``
        under symbol ``alphabet[k]``."""
        index = {state: i for i, state in enumerate(self.states)}
        matrices = np.zeros((len(self.alphabet), len(self.states), len(self.states)), dtype=np.float32)
        for source, row in self.delta.items():
            for k, symbol in enumerate(self.alphabet):
                matrices[k, index[row[symbol]], index[source]] = 1.0
        return matrices


@dataclass(frozen=True)
class DFA:
    """A deterministic finite automaton, as written in the JSON files of docs/api.md, Automaton files."""

    name: str
    alphabet: str
    states: tuple[str, ...]
    start: str
    accept: frozenset[str]
    delta: Transitions
    machine: MooreMachine = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        output = {state: "1" if state in self.accept else "0" for state in self.states}
        machine = MooreMachine(self.name, self.alphabet, self.states, self.start, self.delta, output)
        for state in sorted(self.accept):
            if state not in self.states:
                raise AutomatonError(f"accept state {state!r} is not one of the states")
        object.__setattr__(self, "states", machine.states)
        object.__setattr__(self, "accept", frozenset(self.accept))
        object.__setattr__(self, "delta", machine.delta)
        object.__setattr__(self, "machine", machine)

    @classmethod
    def from_moore(cls, machine: MooreMachine) -> DFA:
        """The DFA accepting where ``machine`` outputs "1"; its labels must be "0" and "1"."""
        unexpected = sorted(set(machine.output.values()) - {"0", "1"})
        if unexpected:
            raise AutomatonError(f"{machine.name}: a DFA outputs only '0' and '1', not {unexpected}")
        accept = frozenset(state for state, label in machine.output.items() if label == "1")
        return cls(machine.name, machine.alphabet, machine.states, machine.start, accept, machine.delta)

    @classmethod
    def from_json(cls, data_or_path: Any) -> DFA:
        """Parse a DFA from a JSON file's path (str or path-like) or its decoded content, refusing anything
        malformed; errors in a file start with its path."""
        return _parse(data_or_path, _dfa_from_object)

    def to_json(self) -> dict[str, Any]:
        """The DFA file's JSON object (``json.dumps`` writes it as is); accept states in state order."""
        return {
            "name": self.name,
            "alphabet": self.alphabet,
            "states": list(self.states),
            "start": self.start,
            "accept": [state for state in self.states if state in self.accept],
            "delta": {state: dict(self.delta[state]) for state in self.states},
        }

    def run(self, string: str) -> list[bool]:
        """Whether each prefix of ``string`` (the empty one excluded) is accepted."""
        return [state in self.accept for state in self.machine.trace(string)]

    def transition_matrices(self) -> np.ndarray:
        """See :meth:`MooreMachine.transition_matrices`."""
        return self.machine.transition_matrices()


def _check_alphabet(alphabet: str) -> None:
    if not alphabet:
        raise AutomatonError("the alphabet is empty")
    repeated = _first_repeated(alphabet)
    if repeated is not None:
        raise AutomatonError(f"symbol {repeated!r} appears more than once in the alphabet {alphabet!r}")


def _check_states(states: tuple[str, ...]) -> None:
    if not states:
        raise AutomatonError("there are no states")
    if len(states) > MAX_STATES:
        raise AutomatonTooLarge(f"{len(states)} states: more than MAX_STATES = {MAX_STATES}")
    repeated = _first_repeated(states)
    if repeated is not None:
        raise AutomatonError(f"state {repeated!r} is listed more than once")


def _check_delta(delta: Transitions, alphabet: str, states: tuple[str, ...]) -> None:
    for source in delta:
        if source not in states:
            raise AutomatonError(f"delta has transitions from unknown state {source!r}")
    for source in states:
        row = delta.get(source, {})
        for symbol, target in row.items():
            if len(symbol) != 1:
                raise AutomatonError(
                    f"transition from state {source!r} on {symbol!r}: a symbol must be one character, not {len(symbol)}"
                )
            if symbol not in alphabet:
                raise AutomatonError(
                    f"transition from state {source!r} on symbol {symbol!r}, which is not in the alphabet {alphabet!r}"
                )
            if target not in states:
                raise AutomatonError(
                    f"transition from state {source!r} on symbol {symbol!r} goes to unknown state {target!r}"
                )
        for symbol in alphabet:
            if symbol not in row:
                raise AutomatonError(f"missing transition from state {source!r} on symbol {symbol!r}")


def read_automaton(data_or_path: Any) -> DFA | MooreMachine:
    """An automaton file (docs/api.md, Automaton files): a Moore machine if its object has "output", else a DFA."""
    if isinstance(data_or_path, (str, os.PathLike)):
        return _parse(data_or_path, _automaton_from_object)
    return _automaton_from_object(data_or_path)


def _automaton_from_object(data: Any) -> DFA | MooreMachine:
    if isinstance(data, Mapping) and "output" in data:
        return _moore_from_object(data)
    return _dfa_from_object(data)


def _parse(data_or_path: Any, parse: Callable[[Any], Parsed]) -> Parsed:
    """``parse`` of a JSON file's content (errors start with its path), or of already decoded content."""
    if not isinstance(data_or_path, (str, os.PathLike)):
        return parse(data_or_path)
    path = Path(data_or_path)
    try:
        return parse(json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=_refuse_duplicate_keys))
    except OSError as error:
        raise AutomatonError(f"{path}: cannot read the file: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise AutomatonError(f"{path}: invalid JSON: {error}") from None
    except AutomatonError as error:
        raise AutomatonError(f"{path}: {error}") from None


def _check_object(data: Any, keys: tuple[str, ...], kind: str) -> None:
    """The checks a DFA file and a Moore machine file share: the keys, and the types of all but "accept" or "output"."""
    if not isinstance(data, Mapping):
        raise AutomatonError(f"a {kind} must be a JSON object, not {type(data).__name__}")
    missing = [key for key in keys if key not in data]
    if missing:
        raise AutomatonError(f"missing key(s) {', '.join(map(repr, missing))}")
    unknown = sorted(key for key in data if key not in keys)
    if unknown:
        raise AutomatonError(f"unknown key(s) {', '.join(map(repr, unknown))}; expected {', '.join(keys)}")
    for key in ("name", "alphabet", "start"):
        _require(isinstance(data[key], str), f"{key!r} must be a string")
    _require(_is_list_of_strings(data["states"]), "'states' must be a list of strings")
    _require(
        isinstance(data["delta"], Mapping)
        and all(
            isinstance(row, Mapping) and all(isinstance(t, str) for t in row.values()) for row in data["delta"].values()
        ),
        "'delta' must map each state to an object from symbols to states",
    )


def _dfa_from_object(data: Any) -> DFA:
    _check_object(data, JSON_KEYS, "DFA")
    _require(_is_list_of_strings(data["accept"]), "'accept' must be a list of strings")
    repeated = _first_repeated(data["accept"])
    _require(repeated is None, f"accept state {repeated!r} is listed more than once")
    return DFA(
        name=data["name"],
        alphabet=data["alphabet"],
        states=tuple(data["states"]),
        start=data["start"],
        accept=frozenset(data["accept"]),
        delta=data["delta"],
    )


def _moore_from_object(data: Any) -> MooreMachine:
    _check_object(data, MOORE_JSON_KEYS, "Moore machine")
    _require(
        isinstance(data["output"], Mapping) and all(isinstance(label, str) for label in data["output"].values()),
        "'output' must map each state to its label, a string",
    )
    return MooreMachine(
        name=data["name"],
        alphabet=data["alphabet"],
        states=tuple(data["states"]),
        start=data["start"],
        delta=data["delta"],
        output=data["output"],
    )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AutomatonError(message)


def _is_list_of_strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    repeated = _first_repeated([key for key, _ in pairs])
    if repeated is not None:
        raise AutomatonError(f"key {repeated!r} appears more than once in a JSON object")
    return dict(pairs)


def _first_repeated(items: Iterable[str]) -> str | None:
    seen: set[str] = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    return None
