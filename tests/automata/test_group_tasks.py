"""The group word problems s5_generators and a5_generators (docs/api.md, Tasks): the generators generate S5 and A5,
the Cayley graph files are the task automata, the labeler agrees with jopetty/word-problem's own code on its rows
(tests/automata/fixtures/word_problem.json), and the compiled LRNN is exact at thousands of symbols while
RegularGPT's construction refuses the groups. Sampling and the task contract: tests/training/data/test_tasks.py; the
shipped checkpoint, the command line and the server: tests/training/cli/test_group_tasks.py."""

from __future__ import annotations

import itertools
import json
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch

from automata.automaton import AutomatonError, MooreMachine, read_automaton
from automata.compiler import compile_lrnn, compile_regulargpt
from automata.task_automata import (
    A5_GENERATORS,
    AUTOMATA_DIR,
    IDENTITY,
    S5_GENERATORS,
    arrangement,
    compose,
    group_task_machines,
)
from tests.automata.helpers import encode
from training.data.tasks import TASKS

FIXTURE = Path(__file__).parent / "fixtures" / "word_problem.json"
GROUPS = {"s5_generators": "S5", "a5_generators": "A5"}  # our task: their group


def is_even(permutation: tuple[int, ...]) -> bool:
    inversions = sum(a > b for a, b in itertools.combinations(permutation, 2))
    return inversions % 2 == 0


@pytest.mark.parametrize(
    ("generators", "order", "elements"),
    [
        (S5_GENERATORS, 120, set(itertools.permutations(range(5)))),
        (A5_GENERATORS, 60, {p for p in itertools.permutations(range(5)) if is_even(p)}),
    ],
)
def test_the_generators_generate_the_group(generators: dict, order: int, elements: set) -> None:
    """Breadth-first search over products with the generators reaches every element of S5 (every even one: A5)."""
    reached, frontier = {IDENTITY}, deque([IDENTITY])
    while frontier:
        product = frontier.popleft()
        for generator in generators.values():
            successor = compose(product, generator)
            if successor not in reached:
                reached.add(successor)
                frontier.append(successor)
    assert len(reached) == order and reached == elements
    assert all(is_even(generator) for generator in A5_GENERATORS.values())
    assert not is_even(S5_GENERATORS["t"])


def test_compose_is_right_multiplication_of_functions() -> None:
    """compose(p, g)(i) = p(g(i)): the word "tc" is the function (0 1) after (0 1 2 3 4) ... read left to right."""
    t, c = S5_GENERATORS["t"], S5_GENERATORS["c"]
    assert compose(t, c) == tuple(t[c[i]] for i in range(5)) == (0, 2, 3, 4, 1)
    assert TASKS["s5_generators"].label("tc") == ["10234", "02341"]
    assert TASKS["a5_generators"].label("rrr") == ["12034", "20134", "01234"]
    assert TASKS["s5_generators"].label("ccccc")[-1] == "01234" == TASKS["s5_generators"].label("e")[0]


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_the_task_labels_are_the_group_elements_in_lexicographic_order(name: str) -> None:
    task = TASKS[name]
    order = 120 if name == "s5_generators" else 60
    assert len(task.labels) == order == len(task.automaton.states)
    assert list(task.labels) == sorted(
        arrangement(p) for p in itertools.permutations(range(5)) if name == "s5_generators" or is_even(p)
    )
    assert task.automaton.start == "01234" and all(task.automaton.output[s] == s for s in task.automaton.states)


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_the_cayley_graph_file_is_the_task_automaton(name: str) -> None:
    path = AUTOMATA_DIR / f"{name}.json"
    machine = MooreMachine.from_json(path)
    assert machine == group_task_machines()[name] == TASKS[name].automaton
    assert read_automaton(path) == machine and read_automaton(json.loads(path.read_text())) == machine
    assert machine.to_json() == json.loads(path.read_text()), "regenerate it with: python -m automata.task_automata"


def test_a_moore_machine_file_is_validated_like_a_dfa_file(tmp_path: Path) -> None:
    data = json.loads((AUTOMATA_DIR / "a5_generators.json").read_text())
    del data["output"]["01234"]
    with pytest.raises(AutomatonError, match="state '01234' has no output label"):
        MooreMachine.from_json(data)
    data = json.loads((AUTOMATA_DIR / "a5_generators.json").read_text())
    data["delta"]["01234"]["x"] = "01234"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(AutomatonError, match=f"{path}: transition from state '01234' on symbol 'x'"):
        read_automaton(path)
    with pytest.raises(AutomatonError, match="unknown key\\(s\\) 'accept'"):
        MooreMachine.from_json({**data, "accept": []})


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_the_automaton_agrees_with_the_labeler_on_random_strings(name: str) -> None:
    task, rng = TASKS[name], np.random.default_rng(11)
    for length in (1, 2, 3, 40, 999, 5000):
        for p_one in (None, 0.1, 0.9):
            string = task.sample(rng, length, p_one=p_one)
            assert task.automaton.transduce(string) == task.label(string)


def their_element(name: str) -> str:
    """word-problem's element name, 1-based one-line notation "(2, 1, 3, 4, 5)", as our label "10234"."""
    return "".join(str(int(image) - 1) for image in name.strip("()").split(", "))


def shortest_words(task_name: str) -> dict[str, str]:
    """A shortest string of the task for each element: the label after it is that element."""
    machine = TASKS[task_name].automaton
    words, frontier = {machine.start: ""}, deque([machine.start])
    while frontier:
        state = frontier.popleft()
        for symbol in machine.alphabet:
            successor = machine.delta[state][symbol]
            if successor not in words:
                words[successor] = words[state] + symbol
                frontier.append(successor)
    return {machine.output[state]: word or "e" for state, word in words.items()}


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_the_labeler_agrees_with_word_problem_s_code_on_its_rows(name: str) -> None:
    """Their element index k is our label id k (both orders are lexicographic); a row drawn from our generators
    is one of our strings symbol for symbol; a row over the whole group becomes ours by writing each element as a
    word of our generators, and their target at each element is our label at the end of its word."""
    task, data = TASKS[name], json.loads(FIXTURE.read_text())["groups"][GROUPS[name]]
    elements = [their_element(element) for element in data["elements"]]
    assert elements == list(task.labels)
    symbol_of = {elements.index(arrangement(permutation)): symbol for symbol, permutation in _generators(name).items()}
    for row in data["generators_rows"]:
        string = "".join(symbol_of[int(token)] for token in row["input"].split())
        assert len(string) >= 20 and [task.labels.index(label) for label in task.label(string)] == [
            int(target) for target in row["target"].split()
        ]
    words = shortest_words(name)
    for row in data["elements_rows"]:
        pieces = [words[elements[int(token)]] for token in row["input"].split()]
        labels = task.label("".join(pieces))
        ends = list(itertools.accumulate(map(len, pieces)))
        assert [task.labels.index(labels[end - 1]) for end in ends] == [int(target) for target in row["target"].split()]


def _generators(name: str) -> dict[str, tuple[int, ...]]:
    return S5_GENERATORS if name == "s5_generators" else A5_GENERATORS


def compiled_labels(model, task, strings: list[str]) -> tuple[list[list[str]], list[str]]:
    """The compiled model's label at every position of each string (forward) and at its end (final_logits)."""
    tokens, lengths = encode(task.automaton, strings)
    with torch.no_grad():
        per_position = model(tokens).argmax(-1)  # (B, T)
        final = model.final_logits(tokens, lengths).argmax(-1)  # (B,)
    every = [[task.labels[i] for i in row[: len(string)].tolist()] for row, string in zip(per_position, strings)]
    return every, [task.labels[i] for i in final.tolist()]


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_the_compiled_lrnn_agrees_with_the_labeler_at_thousands_of_symbols(name: str) -> None:
    """Every position of 40 strings of 1..64 symbols and of two long ones (one at a time: the parallel scan holds
    a 121 x 121 matrix per position), against the labeler, not the automaton; RegularGPT's construction refuses the
    group's states."""
    task, rng = TASKS[name], np.random.default_rng(12)
    model, config = compile_lrnn(task.automaton)
    assert config.task == name and config.labels == task.labels
    short = [task.sample(rng, int(length)) for length in rng.integers(1, 65, size=40)]
    batches = [short, [task.sample(rng, 2500)], [task.sample(rng, 4000, p_one=0.9)]]
    for strings in batches:
        every, final = compiled_labels(model, task, strings)
        assert every == [task.label(string) for string in strings]
        assert final == [task.label(string)[-1] for string in strings]


@pytest.mark.parametrize("name", sorted(GROUPS))
def test_the_compiled_regulargpt_holds_the_group_in_its_elements_and_agrees_with_the_labeler(name: str) -> None:
    """Past MAX_REGULARGPT_STATES, RegularGPT's construction runs over the transition monoid, here the group: a
    one-hot of |G| channels per segment, d_model 2 |G|; right at every position of short strings and of 2,100
    symbols (12 levels)."""
    task, rng = TASKS[name], np.random.default_rng(13)
    model, config = compile_regulargpt(task.automaton)
    assert config.task == name and config.model.d_model == 2 * len(task.labels)
    strings = [task.sample(rng, int(length)) for length in rng.integers(1, 65, size=20)]
    for batch in (strings, [task.sample(rng, 2100)]):
        every, final = compiled_labels(model, task, batch)
        assert every == [task.label(string) for string in batch]
        assert final == [task.label(string)[-1] for string in batch]
