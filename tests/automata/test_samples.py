"""Sample automata and strings (automata/samples.py): the counter has every state reachable, live strings never
enter a state from which nothing is accepted, and are reproducible from the generator."""

from __future__ import annotations

import numpy as np

from automata.automaton import DFA
from automata.samples import counter, live_string
from tests.automata.helpers import load_dfa


def test_counter_counts_ones_modulo_n_and_reaches_every_state() -> None:
    dfa = DFA.from_json(counter(5))
    assert len(dfa.states) == 5
    assert dfa.run("0111101") == [True, False, False, False, False, False, True]
    assert set(dfa.machine.trace("1" * 5)) == set(dfa.states)


def test_live_strings_never_enter_a_dead_state() -> None:
    dfa = load_dfa("tomita4")  # "dead" after 000, which a uniform string of 500 symbols all but surely holds
    string = live_string(dfa, 500, np.random.default_rng(0))
    assert len(string) == 500 and "dead" not in dfa.machine.trace(string) and "0" in string and "1" in string
    assert live_string(dfa, 500, np.random.default_rng(0)) == string
