"""Automata and strings that exercise compiled models: the counter DFA modulo n (every state reachable) and random
walks that never enter a rejecting sink. Used by the tests and benchmarks/accuracy/compiler_sweep.py.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from automata.automaton import DFA


def counter(states: int) -> dict[str, Any]:
    """The DFA JSON of counting 1s modulo ``states`` over "01" (every state reachable), accepting at 0."""
    delta = {f"q{i}": {"0": f"q{i}", "1": f"q{(i + 1) % states}"} for i in range(states)}
    return _ring(f"counter{states}", "01", delta)


def symmetric(states: int) -> dict[str, Any]:
    """The DFA JSON over "ct" whose "c" moves every state one on (q_{n-1} to q0) and whose "t" swaps q0 and q1,
    accepting at q0: its transition monoid is the whole symmetric group, states! elements."""
    delta = {f"q{i}": {"c": f"q{(i + 1) % states}", "t": f"q{i}"} for i in range(states)}
    delta["q0"]["t"], delta["q1"]["t"] = "q1", "q0"
    return _ring(f"symmetric{states}", "ct", delta)


def _ring(name: str, alphabet: str, delta: dict[str, dict[str, str]]) -> dict[str, Any]:
    """The DFA JSON of states q0 .. q_{n-1} (``delta``'s keys, in order), starting and accepting at q0."""
    return {"name": name, "alphabet": alphabet, "states": list(delta), "start": "q0", "accept": ["q0"], "delta": delta}


def live_string(dfa: DFA, length: int, rng: np.random.Generator) -> str:
    """A random walk on the DFA that never enters a state from which no accepting state can be reached, so long
    strings keep exercising the automaton."""
    live = set(dfa.accept)
    while True:
        grown = live | {q for q in dfa.states if any(dfa.delta[q][s] in live for s in dfa.alphabet)}
        if grown == live:
            break
        live = grown
    state, symbols = dfa.start, []
    for _ in range(length):
        choices = [s for s in dfa.alphabet if dfa.delta[state][s] in live] or list(dfa.alphabet)
        symbol = choices[rng.integers(len(choices))]
        state = dfa.delta[state][symbol]
        symbols.append(symbol)
    return "".join(symbols)
