"""DFA files (docs/api.md, Automaton files): parsing, every refusal with its message, running and transition
matrices."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from automata.automaton import DFA, MAX_STATES, AutomatonError, MooreMachine
from automata.task_automata import AUTOMATA_DIR

TOMITA4_TEXT = """
{"name": "tomita4", "alphabet": "01", "states": ["q0", "q1", "q2", "dead"], "start": "q0",
 "accept": ["q0", "q1", "q2"],
 "delta": {"q0": {"0": "q1", "1": "q0"}, "q1": {"0": "q2", "1": "q0"},
           "q2": {"0": "dead", "1": "q0"}, "dead": {"0": "dead", "1": "dead"}}}
"""


def spec_tomita4() -> dict[str, Any]:
    return json.loads(TOMITA4_TEXT)


def edited(edit: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    data = copy.deepcopy(spec_tomita4())
    edit(data)
    return data


INVALID_OBJECTS = {
    "missing key": (edited(lambda d: d.pop("accept")), "missing key(s) 'accept'"),
    "unknown key": (edited(lambda d: d.update(comment="hi")), "unknown key(s) 'comment'"),
    "alphabet not a string": (edited(lambda d: d.update(alphabet=["0", "1"])), "'alphabet' must be a string"),
    "states not a list": (edited(lambda d: d.update(states="q0")), "'states' must be a list of strings"),
    "delta not nested": (edited(lambda d: d.update(delta={"q0": "q1"})), "'delta' must map each state"),
    "empty alphabet": (edited(lambda d: d.update(alphabet="")), "the alphabet is empty"),
    "duplicate symbol": (edited(lambda d: d.update(alphabet="010")), "symbol '0' appears more than once"),
    "multi-character symbol": (
        edited(lambda d: d["delta"]["q1"].update({"01": "q0"})),
        "transition from state 'q1' on '01': a symbol must be one character, not 2",
    ),
    "symbol outside the alphabet": (
        edited(lambda d: d["delta"]["q2"].update({"2": "q0"})),
        "transition from state 'q2' on symbol '2', which is not in the alphabet '01'",
    ),
    "duplicate state": (edited(lambda d: d["states"].append("q1")), "state 'q1' is listed more than once"),
    "no states": (edited(lambda d: d.update(states=[])), "there are no states"),
    "unknown start": (edited(lambda d: d.update(start="q9")), "start state 'q9' is not one of the states"),
    "unknown accept state": (edited(lambda d: d["accept"].append("q9")), "accept state 'q9' is not one of the states"),
    "duplicate accept state": (
        edited(lambda d: d["accept"].append("q0")),
        "accept state 'q0' is listed more than once",
    ),
    "unknown target": (
        edited(lambda d: d["delta"]["q0"].update({"1": "q9"})),
        "transition from state 'q0' on symbol '1' goes to unknown state 'q9'",
    ),
    "unknown source": (
        edited(lambda d: d["delta"].update(q9={"0": "q0", "1": "q0"})),
        "delta has transitions from unknown state 'q9'",
    ),
    "missing transition": (
        edited(lambda d: d["delta"]["q1"].pop("1")),
        "missing transition from state 'q1' on symbol '1'",
    ),
    "state without transitions": (
        edited(lambda d: d["delta"].pop("dead")),
        "missing transition from state 'dead' on symbol '0'",
    ),
    "too many states": (
        {
            "name": "big",
            "alphabet": "0",
            "states": [f"s{i}" for i in range(MAX_STATES + 1)],
            "start": "s0",
            "accept": [],
            "delta": {f"s{i}": {"0": "s0"} for i in range(MAX_STATES + 1)},
        },
        f"{MAX_STATES + 1} states: more than MAX_STATES = {MAX_STATES}",
    ),
    "not an object": ([1, 2], "a DFA must be a JSON object, not list"),
}


@pytest.mark.parametrize("case", INVALID_OBJECTS, ids=str)
def test_invalid_object_is_refused_by_name(case: str) -> None:
    data, message = INVALID_OBJECTS[case]
    with pytest.raises(AutomatonError) as error:
        DFA.from_json(data)
    assert message in str(error.value)


def test_automaton_error_is_a_value_error() -> None:
    assert issubclass(AutomatonError, ValueError)


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"name": ', "invalid JSON"),
        ('["q0"]', "a DFA must be a JSON object, not list"),
        (TOMITA4_TEXT.replace('"0": "q1", "1": "q0"', '"0": "q1", "0": "q0"'), "key '0' appears more than once"),
        (TOMITA4_TEXT.replace('"q0", "q1", "q2"]', '"q0", "q1", "q7"]'), "accept state 'q7'"),
    ],
)
def test_invalid_file_is_refused_with_its_path(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(AutomatonError) as error:
        DFA.from_json(path)
    assert str(error.value).startswith(f"{path}: ")
    assert message in str(error.value)


def test_missing_file_is_refused_with_its_path(tmp_path: Path) -> None:
    with pytest.raises(AutomatonError, match="nowhere.json: cannot read the file"):
        DFA.from_json(tmp_path / "nowhere.json")


def test_spec_example_file_parses_and_runs(tmp_path: Path) -> None:
    path = tmp_path / "tomita4.json"
    path.write_text(TOMITA4_TEXT)
    dfa = DFA.from_json(str(path))
    assert dfa.states == ("q0", "q1", "q2", "dead")
    assert dfa.accept == frozenset({"q0", "q1", "q2"})
    assert dfa.run("1001000") == [True, True, True, True, True, True, False]
    assert dfa.run("0010011") == [True] * 7
    assert dfa.machine.transduce("10001") == ["1", "1", "1", "0", "0"]
    assert dfa.run("") == []


def test_shipped_tomita4_file_is_the_spec_example() -> None:
    assert DFA.from_json(AUTOMATA_DIR / "tomita4.json").to_json() == spec_tomita4()


def test_json_round_trip(tmp_path: Path) -> None:
    dfa = DFA.from_json(spec_tomita4())
    assert dfa.to_json() == spec_tomita4()
    path = tmp_path / "again.json"
    path.write_text(json.dumps(dfa.to_json()))
    assert DFA.from_json(path) == dfa


def test_dfa_cannot_be_changed_through_the_mapping_it_was_built_from() -> None:
    data = spec_tomita4()
    dfa = DFA.from_json(data)
    data["delta"]["q0"]["0"] = "dead"
    assert dfa.delta["q0"]["0"] == "q1"
    with pytest.raises(TypeError):
        dfa.delta["q0"]["0"] = "dead"  # type: ignore[index]


def test_run_names_position_and_character_of_an_unknown_symbol() -> None:
    with pytest.raises(AutomatonError, match="symbol '2' at position 3 is not in the alphabet '01'"):
        DFA.from_json(spec_tomita4()).run("0102")


def test_transition_matrices_map_one_hot_states() -> None:
    dfa = DFA.from_json(spec_tomita4())
    matrices = dfa.transition_matrices()  # (symbols, n, n)
    assert matrices.shape == (2, 4, 4)
    identity = np.eye(len(dfa.states), dtype=np.float32)
    for k, symbol in enumerate(dfa.alphabet):
        for i, state in enumerate(dfa.states):
            target = dfa.states.index(dfa.delta[state][symbol])
            np.testing.assert_array_equal(matrices[k] @ identity[i], identity[target])


def test_transition_matrices_reproduce_run() -> None:
    dfa = DFA.from_json(spec_tomita4())
    matrices, string = dfa.transition_matrices(), "10001001000"
    accepting = np.array([state in dfa.accept for state in dfa.states])
    state = np.eye(len(dfa.states))[dfa.states.index(dfa.start)]
    accepted = []
    for symbol in string:
        state = matrices[dfa.alphabet.index(symbol)] @ state
        accepted.append(bool(state @ accepting))
    assert accepted == dfa.run(string)


def test_moore_machine_needs_a_label_on_every_state() -> None:
    with pytest.raises(AutomatonError, match="state 'b' has no output label"):
        MooreMachine("m", "0", ("a", "b"), "a", {"a": {"0": "b"}, "b": {"0": "a"}}, {"a": "x"})


def test_explore_numbers_reachable_states_breadth_first() -> None:
    counter = MooreMachine.explore("mod3", "01", start=0, step=lambda n, s: (n + int(s)) % 3, output=str)
    assert counter.states == ("0", "1", "2")
    assert counter.transduce("1101") == ["1", "2", "2", "0"]


def test_explore_refuses_an_unbounded_state_space() -> None:
    with pytest.raises(AutomatonError, match="more than MAX_STATES"):
        MooreMachine.explore("counter", "1", start=0, step=lambda n, s: n + 1, output=str)


def test_from_moore_refuses_labels_other_than_0_and_1() -> None:
    counter = MooreMachine.explore("mod3", "01", start=0, step=lambda n, s: (n + int(s)) % 3, output=str)
    with pytest.raises(AutomatonError, match=r"mod3: a DFA outputs only '0' and '1', not \['2'\]"):
        DFA.from_moore(counter)
