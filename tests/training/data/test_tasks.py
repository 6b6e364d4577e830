"""Tasks (docs/api.md, Tasks): labelers against brute force, automata against labelers, sampling, registry."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch

from automata.automaton import DFA, read_automaton
from automata.task_automata import A5_GENERATORS, AUTOMATA_DIR, S5_GENERATORS, binary_task_dfas, group_task_machines
from training.data.batches import LengthCurriculum, TrainingData
from training.data.tasks import TASKS, Task, get_task, sample_batch

CONTRACT_TASKS = [
    "parity_check",
    "even_pairs",
    "cycle_navigation",
    "modular_arithmetic",
    "sum_mod5",
    "even_pair_mod5",
    "d2",
    "d3",
    "d4",
    "d12",
    "tomita3",
    "tomita4",
    "tomita5",
    "tomita6",
    "first",
    "one",
    "palindrome",
    "induction_heads",
    "s5_generators",
    "a5_generators",
]
SPARSE_TASKS = ["d2", "d3", "d4", "d12", "tomita3", "tomita4", "tomita6", "first", "one", "palindrome"]
REGULAR_TASKS = [name for name in CONTRACT_TASKS if name != "palindrome"]
EXHAUSTIVE_STRINGS = 10_000  # per task: all strings of each length while there are at most this many
LONGEST_EXHAUSTIVE = 8


def dyck_regex(depth: int) -> str:
    """D_0 = {empty}, D_n = (a D_{n-1} b)*, literally."""
    return "" if depth == 0 else f"(?:a{dyck_regex(depth - 1)}b)*"


def flag(condition: object) -> str:
    return "1" if condition else "0"


# The label of a whole prefix, from a formulation independent of training.data.labelers.
BRUTE_FORCE: dict[str, Callable[[str], str]] = {
    "parity_check": lambda prefix: str(prefix.count("1") % 2),
    "even_pairs": lambda prefix: flag(prefix[0] == prefix[-1]),
    "cycle_navigation": lambda prefix: str((prefix.count("2") - prefix.count("0")) % 5),
    "modular_arithmetic": lambda prefix: str(eval(prefix.rstrip("+-*"), {"__builtins__": {}}) % 5),
    "sum_mod5": lambda prefix: str(sum(map(int, prefix)) % 5),
    "even_pair_mod5": lambda prefix: flag(prefix[-1] == prefix[0]),
    **{f"d{n}": (lambda prefix, n=n: flag(re.fullmatch(dyck_regex(n), prefix))) for n in (2, 3, 4, 12)},
    "tomita3": lambda prefix: flag(not re.search(r"(?<!1)1(?:11)*0(?:00)*(?!0)", prefix)),
    "tomita4": lambda prefix: flag("000" not in prefix),
    "tomita5": lambda prefix: flag(prefix.count("0") % 2 == 0 and prefix.count("1") % 2 == 0),
    "tomita6": lambda prefix: flag((prefix.count("0") - prefix.count("1")) % 3 == 0),
    "first": lambda prefix: flag(prefix[0] == "1"),
    "one": lambda prefix: flag(prefix.count("1") == 1),
    "palindrome": lambda prefix: flag(all(prefix[i] == prefix[-1 - i] for i in range(len(prefix)))),
    "induction_heads": lambda prefix: (re.search("#(.)", prefix) or [None, "-"])[1],
}


def group_product(generators: dict[str, tuple[int, ...]], prefix: str) -> str:
    """The product g_1 g_2 ... g_k of the prefix's generators as a function (g_k applied first), in one-line
    notation: each point's image, pushed through the generators from the last to the first."""
    images = []
    for point in range(5):
        for symbol in reversed(prefix):
            point = generators[symbol][point]
        images.append(str(point))
    return "".join(images)


BRUTE_FORCE["s5_generators"] = lambda prefix: group_product(S5_GENERATORS, prefix)
BRUTE_FORCE["a5_generators"] = lambda prefix: group_product(A5_GENERATORS, prefix)


def brute_force_labels(name: str, string: str) -> list[str]:
    return [BRUTE_FORCE[name](string[: end + 1]) for end in range(len(string))]


def short_strings(task: Task) -> Iterator[str]:
    """Every string (every well-formed expression for modular_arithmetic) of each length up to
    LONGEST_EXHAUSTIVE while there are at most EXHAUSTIVE_STRINGS of them, then random ones up to that length."""
    for length in range(1, LONGEST_EXHAUSTIVE + 1):
        slots = [task.alphabet] * length
        if task.name == "modular_arithmetic":
            if length % 2 == 0:
                continue
            slots = ["01234", "+-*"] * (length // 2) + ["01234"]
        if np.prod([len(slot) for slot in slots]) > EXHAUSTIVE_STRINGS:
            break
        yield from map("".join, itertools.product(*slots))
    rng = np.random.default_rng(0)
    for _ in range(500):
        yield task.sample(rng, int(rng.integers(task.shortest_length, LONGEST_EXHAUSTIVE + 1)))
    if task.name == "induction_heads":  # strings its generator never draws: several "#"s, "##", none
        for _ in range(500):
            yield "".join(rng.choice(list(task.alphabet), size=int(rng.integers(1, 3 * LONGEST_EXHAUSTIVE))))


def test_registry_has_every_spec_task_in_order() -> None:
    assert list(TASKS) == CONTRACT_TASKS
    assert all(TASKS[name].name == name for name in TASKS)


def test_unknown_task_is_refused_with_the_known_names() -> None:
    with pytest.raises(ValueError, match="unknown task 'tomita7'; known tasks: parity_check, even_pairs, .*palindrome"):
        get_task("tomita7")
    assert get_task("d12") is TASKS["d12"]


@pytest.mark.parametrize("name", CONTRACT_TASKS)
def test_train_lengths(name: str) -> None:
    bhattamishra = name.startswith(("d", "tomita"))
    expected = (3, 256) if name == "induction_heads" else (1, 50) if bhattamishra else (1, 40)
    assert TASKS[name].train_lengths == expected


@pytest.mark.parametrize("name", CONTRACT_TASKS)
def test_labeler_agrees_with_brute_force_on_short_strings(name: str) -> None:
    task = TASKS[name]
    for string in short_strings(task):
        labels = task.label(string)
        assert labels == brute_force_labels(name, string), string
        assert set(labels) <= set(task.labels)


@pytest.mark.parametrize("name", REGULAR_TASKS)
def test_automaton_agrees_with_labeler_on_short_strings(name: str) -> None:
    task = TASKS[name]
    for string in short_strings(task):
        assert task.automaton.transduce(string) == task.label(string), string


@pytest.mark.parametrize("name", REGULAR_TASKS)
def test_automaton_agrees_with_labeler_on_long_strings(name: str) -> None:
    task, rng = TASKS[name], np.random.default_rng(1)
    balanced = TASKS[name].draw_with_final_label is not None
    for length in [2000, 1999, *rng.integers(41, 2000, size=2)]:
        for string in [task.sample(rng, int(length)), task.sample(rng, int(length), balanced=balanced)]:
            assert task.automaton.transduce(string) == task.label(string)


@pytest.mark.parametrize("name", REGULAR_TASKS)
def test_labels_are_the_automaton_s_in_sorted_order(name: str) -> None:
    """The compiler orders a Moore machine's labels so (automata/compiler.py): a compiled task checkpoint's label
    ids are the task's."""
    task = TASKS[name]
    assert task.labels == tuple(sorted(set(task.automaton.output.values())))


def test_palindrome_has_no_automaton() -> None:
    assert TASKS["palindrome"].automaton is None


def test_shipped_dfa_files_are_the_task_automata() -> None:
    """A DFA file per binary task and a Moore machine file per group word problem."""
    files = {path.stem: read_automaton(path) for path in AUTOMATA_DIR.glob("*.json")}
    dfas = {name: automaton for name, automaton in files.items() if isinstance(automaton, DFA)}
    assert dfas == binary_task_dfas(), "regenerate them with: python -m automata.task_automata"
    assert set(dfas) == {name for name in REGULAR_TASKS if TASKS[name].labels == ("0", "1")}
    for name, dfa in dfas.items():
        assert dfa.machine == TASKS[name].automaton
    machines = {name: automaton for name, automaton in files.items() if name not in dfas}
    assert machines == group_task_machines() == {name: TASKS[name].automaton for name in machines}


def test_label_names_position_and_character_of_a_foreign_symbol() -> None:
    with pytest.raises(ValueError, match="parity_check: symbol 'a' at position 2 is not in the alphabet '01'"):
        TASKS["parity_check"].label("01a")


def test_modular_arithmetic_labeler_refuses_a_malformed_expression() -> None:
    with pytest.raises(ValueError, match=r"expected one of '\+-\*' at position 1, got '3'"):
        TASKS["modular_arithmetic"].label("23")


@pytest.mark.parametrize("name", CONTRACT_TASKS)
def test_samples_have_the_requested_length_and_alphabet(name: str) -> None:
    task, rng = TASKS[name], np.random.default_rng(2)
    options: list[dict] = [{}]
    options += [{"balanced": True}] if task.draw_with_final_label is not None else []
    options += [{"p_one": 0.3}]
    for length in (1, 2, 7, 40, 101):
        if length < task.shortest_length:
            with pytest.raises(ValueError, match=f"length must be at least {task.shortest_length} for {name}"):
                task.sample(rng, length)
            continue
        for option in options:
            string = task.sample(rng, length, **option)
            expected_length = length - 1 + length % 2 if name == "modular_arithmetic" else length
            assert len(string) == expected_length
            assert set(string) <= set(task.alphabet)


def test_sampling_is_reproducible() -> None:
    task = TASKS["d4"]
    first = sample_batch(task, np.random.default_rng(7), 20, (1, 50), balanced=True)
    again = sample_batch(task, np.random.default_rng(7), 20, (1, 50), balanced=True)
    assert first == again


def test_sample_batch_draws_lengths_from_the_range() -> None:
    strings = sample_batch(TASKS["parity_check"], np.random.default_rng(3), 300, (41, 45))
    assert {len(string) for string in strings} == {41, 42, 43, 44, 45}
    with pytest.raises(ValueError, match="length_range"):
        sample_batch(TASKS["parity_check"], np.random.default_rng(3), 1, (5, 4))


@pytest.mark.parametrize("name", ["parity_check", "even_pairs", "d2"])
@pytest.mark.parametrize("p_one", [0.1, 0.9])
def test_p_one_sets_the_frequency_of_the_second_symbol(name: str, p_one: float) -> None:
    task = TASKS[name]
    text = "".join(sample_batch(task, np.random.default_rng(4), 200, (100, 100), p_one=p_one))
    assert text.count(task.alphabet[1]) / len(text) == pytest.approx(p_one, abs=0.01)


def test_a_p_one_range_gives_each_string_its_own_frequency() -> None:
    strings = sample_batch(TASKS["parity_check"], np.random.default_rng(6), 400, (200, 200), p_one=(0.0, 1.0))
    frequencies = sorted(string.count("1") / len(string) for string in strings)
    assert frequencies[0] < 0.05 and frequencies[-1] > 0.95  # dense and sparse strings in one batch
    assert np.mean(frequencies) == pytest.approx(0.5, abs=0.05)
    narrow = sample_batch(TASKS["parity_check"], np.random.default_rng(6), 50, (200, 200), p_one=(0.2, 0.3))
    assert all(0.1 < string.count("1") / 200 < 0.4 for string in narrow)
    with pytest.raises(ValueError, match="p_one range must satisfy 0 <= lo <= hi <= 1"):
        sample_batch(TASKS["parity_check"], np.random.default_rng(6), 1, (5, 5), p_one=(0.6, 0.4))


@pytest.mark.parametrize("name", ["sum_mod5", "cycle_navigation"])
@pytest.mark.parametrize("p_one", [0.1, 0.9])
def test_p_one_on_a_larger_alphabet_shares_the_rest_equally(name: str, p_one: float) -> None:
    task = TASKS[name]
    text = "".join(sample_batch(task, np.random.default_rng(5), 200, (100, 100), p_one=p_one))
    for symbol in task.alphabet:
        expected = p_one if symbol == "1" else (1 - p_one) / (len(task.alphabet) - 1)
        assert text.count(symbol) / len(text) == pytest.approx(expected, abs=0.01), symbol


def test_p_one_skews_the_digits_of_modular_arithmetic_only() -> None:
    task = TASKS["modular_arithmetic"]
    strings = sample_batch(task, np.random.default_rng(9), 200, (101, 101), p_one=0.9)
    digits, operators = "".join(s[0::2] for s in strings), "".join(s[1::2] for s in strings)
    assert set(digits) <= set("01234") and set(operators) <= set("+-*")
    assert digits.count("1") / len(digits) == pytest.approx(0.9, abs=0.01)
    for operator in "+-*":
        assert operators.count(operator) / len(operators) == pytest.approx(1 / 3, abs=0.02)
    task.label(strings[0])  # well formed


@pytest.mark.parametrize("p_times", [0.0, 0.9, 1.0])
def test_p_times_skews_the_operators_of_modular_arithmetic(p_times: float) -> None:
    task = TASKS["modular_arithmetic"]
    strings = sample_batch(task, np.random.default_rng(9), 200, (101, 101), p_times=p_times)
    digits, operators = "".join(s[0::2] for s in strings), "".join(s[1::2] for s in strings)
    assert set(digits) <= set("01234") and set(operators) <= set("+-*")
    assert operators.count("*") / len(operators) == pytest.approx(p_times, abs=0.01)
    for operator in "+-":
        assert operators.count(operator) / len(operators) == pytest.approx((1 - p_times) / 2, abs=0.01)
    for digit in "01234":
        assert digits.count(digit) / len(digits) == pytest.approx(0.2, abs=0.02)
    task.label(strings[0])  # well formed


def test_p_times_ranges_and_p_one_together() -> None:
    task, rng = TASKS["modular_arithmetic"], np.random.default_rng(3)
    strings = sample_batch(task, rng, 400, (201, 201), p_one=0.9, p_times=(0.0, 1.0))
    times = sorted(string[1::2].count("*") / 100 for string in strings)
    assert times[0] < 0.05 and times[-1] > 0.95 and np.mean(times) == pytest.approx(0.5, abs=0.05)
    digits = "".join(string[0::2] for string in strings)
    assert digits.count("1") / len(digits) == pytest.approx(0.9, abs=0.01)
    with pytest.raises(ValueError, match="p_times range must satisfy"):
        sample_batch(task, rng, 1, (5, 5), p_times=(0.6, 0.4))


def test_p_times_is_modular_arithmetic_s_only() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="parity_check has no operators"):
        TASKS["parity_check"].sample(rng, 5, p_times=0.5)
    with pytest.raises(ValueError, match="cannot be combined"):
        TASKS["modular_arithmetic"].sample(rng, 5, p_times=0.5, balanced=True)
    with pytest.raises(ValueError, match="p_times must be a probability"):
        TASKS["modular_arithmetic"].sample(rng, 5, p_times=1.5)
    with pytest.raises(ValueError, match="p_one must be a probability"):
        TASKS["modular_arithmetic"].sample(rng, 5, p_one=-0.1, p_times=0.5)


def test_p_one_needs_a_probability() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="must be a probability"):
        TASKS["parity_check"].sample(rng, 5, p_one=1.5)
    with pytest.raises(ValueError, match="cannot be combined"):
        TASKS["parity_check"].sample(rng, 5, p_one=0.5, balanced=True)


@pytest.mark.parametrize("name", SPARSE_TASKS)
@pytest.mark.parametrize("length", [100, 500])
def test_balanced_sampling_gives_about_half_positives(name: str, length: int) -> None:
    task, rng = TASKS[name], np.random.default_rng(5)
    finals = [task.label(task.sample(rng, length, balanced=True))[-1] for _ in range(200)]
    assert 0.4 <= finals.count("1") / len(finals) <= 0.6


def test_balanced_sampling_spreads_final_labels_of_multi_label_tasks() -> None:
    task, rng = TASKS["cycle_navigation"], np.random.default_rng(6)
    finals = [task.label(task.sample(rng, 60, balanced=True))[-1] for _ in range(500)]
    assert all(finals.count(label) >= 60 for label in task.labels)


def test_balanced_sampling_falls_back_where_a_label_is_impossible() -> None:
    rng = np.random.default_rng(8)
    odd_dyck = [TASKS["d2"].sample(rng, 7, balanced=True) for _ in range(20)]  # no string of D_2 has odd length
    assert all(len(string) == 7 for string in odd_dyck)
    assert {TASKS["palindrome"].sample(rng, 1, balanced=True) for _ in range(20)} <= {"0", "1"}


def test_modular_arithmetic_has_no_balanced_sampling() -> None:
    with pytest.raises(ValueError, match="modular_arithmetic offers no balanced sampling"):
        TASKS["modular_arithmetic"].sample(np.random.default_rng(0), 5, balanced=True)


def test_modular_arithmetic_samples_are_well_formed() -> None:
    task, rng = TASKS["modular_arithmetic"], np.random.default_rng(9)
    for string in sample_batch(task, rng, 200, (1, 60)):
        assert len(string) % 2 == 1
        assert all(symbol in "01234" for symbol in string[::2])
        assert all(symbol in "+-*" for symbol in string[1::2])
        task.label(string)  # refuses malformed expressions
    assert len(task.sample(rng, 40)) == 39


@pytest.mark.parametrize("depth", [2, 3, 4, 12])
def test_dyck_depth_limit_is_exact(depth: int) -> None:
    task = TASKS[f"d{depth}"]
    deepest, too_deep = "a" * depth + "b" * depth, "a" * (depth + 1) + "b" * (depth + 1)
    for string, final in [(deepest, "1"), (too_deep, "0"), (deepest * 3, "1"), (deepest + too_deep, "0")]:
        assert task.label(string)[-1] == final == brute_force_labels(task.name, string)[-1]
        assert task.automaton.transduce(string) == task.label(string)


def test_induction_heads_automaton_states() -> None:
    """Before the first "#", just after it, and one state per key (any symbol, "#" after "##" included)."""
    machine = TASKS["induction_heads"].automaton
    assert len(machine.states) == 19
    assert machine.transduce("ab#cd#") == ["-", "-", "-", "c", "c", "c"]
    assert machine.transduce("##a#") == ["-", "#", "#", "#"]
    assert machine.transduce("abc#") == ["-"] * 4


@pytest.mark.parametrize("p_one", [None, 0.5])
def test_induction_heads_strings_are_mamba_s(p_one: float | None) -> None:
    """Letters, exactly one "#" before the last two symbols followed by the key letter, "#" last: the final label
    is the key, drawn uniformly, and the mark's position is uniform over the first length - 2."""
    task, rng = TASKS["induction_heads"], np.random.default_rng(11)
    keys, marks = [], []
    for _ in range(2000):
        string = task.sample(rng, 12, p_one=p_one)
        assert len(string) == 12 and string[-1] == "#" and string[:-1].count("#") == 1
        mark = string.index("#")
        assert mark <= 9 and string[mark + 1] in "abcdefghijklmnop"
        assert task.label(string)[-1] == string[mark + 1] == task.automaton.transduce(string)[-1]
        keys.append(string[mark + 1])
        marks.append(mark)
    assert np.bincount(marks).tolist() == pytest.approx([200] * 10, abs=60)
    if p_one is None:
        assert sorted(set(keys)) == list("abcdefghijklmnop")
        assert max(keys.count(key) for key in set(keys)) < 2000 / 16 * 1.4
    else:
        assert keys.count("b") / len(keys) == pytest.approx(0.5, abs=0.05)
    assert task.sample(rng, 3) in {f"#{letter}#" for letter in "abcdefghijklmnop"}


def test_induction_heads_power_offset_strings_put_the_mark_a_power_of_two_before_the_end() -> None:
    """Mamba's strings but for the mark: 2**k positions before the final "#", k uniform over 1 .. log2(length - 1)."""
    task, rng = TASKS["induction_heads"], np.random.default_rng(13)
    offsets = []
    for _ in range(3000):
        string = task.draw_power_offset(rng, 40)
        assert len(string) == 40 and string[-1] == "#" and string[:-1].count("#") == 1
        mark = string.index("#")
        offsets.append(39 - mark)
        assert task.label(string)[-1] == string[mark + 1] == task.automaton.transduce(string)[-1]
    assert sorted(set(offsets)) == [2, 4, 8, 16, 32]
    assert [offsets.count(offset) for offset in (2, 4, 8, 16, 32)] == pytest.approx([600] * 5, abs=100)
    assert {task.draw_power_offset(rng, 3) for _ in range(50)} <= {f"#{letter}#" for letter in "abcdefghijklmnop"}
    assert all(task.draw_power_offset is None for name, task in TASKS.items() if name != "induction_heads")


def test_training_batches_mix_in_power_offset_strings_and_keep_the_stream_without() -> None:
    """--power-offset-fraction: that fraction of a batch's strings (in expectation) comes from draw_power_offset;
    at 0 the batches are those drawn before the option."""
    task = TASKS["induction_heads"]
    curriculum = LengthCurriculum(64, 64)
    plain = TrainingData(task, 200, curriculum).batch(np.random.default_rng(5), 1)
    assert torch.equal(
        TrainingData(task, 200, curriculum, power_offset_fraction=0.0).batch(np.random.default_rng(5), 1).tokens,
        plain.tokens,
    )
    mixed = TrainingData(task, 200, curriculum, power_offset_fraction=0.5).batch(np.random.default_rng(5), 1)
    mark = task.alphabet.index("#")
    offsets = [63 - row.tolist().index(mark) for row in mixed.tokens]
    at_powers = sum(offset in (2, 4, 8, 16, 32) for offset in offsets)
    assert 100 - 25 < at_powers < 100 + 25 + 200 * 5 / 62  # half the batch, plus uniform ones that land there


def test_final_only_batches_score_each_string_s_last_position_alone() -> None:
    task = TASKS["parity_check"]
    curriculum = LengthCurriculum(3, 30)
    every = TrainingData(task, 50, curriculum).batch(np.random.default_rng(6), 1)
    final = TrainingData(task, 50, curriculum, final_only=True).batch(np.random.default_rng(6), 1)
    assert torch.equal(final.tokens, every.tokens) and torch.equal(final.lengths, every.lengths)
    last = every.lengths - 1
    scored = final.targets != -100
    assert scored.sum(1).tolist() == [1] * 50 and scored[torch.arange(50), last].all()
    assert torch.equal(final.targets[torch.arange(50), last], every.targets[torch.arange(50), last])


def test_induction_heads_labeler_and_automaton_agree_on_long_strings() -> None:
    task, rng = TASKS["induction_heads"], np.random.default_rng(12)
    for string in [task.sample(rng, 5000), "".join(rng.choice(list(task.alphabet), size=5000))]:
        assert task.automaton.transduce(string) == task.label(string)


def test_induction_heads_has_no_balanced_sampling_and_refuses_short_ranges() -> None:
    task = TASKS["induction_heads"]
    with pytest.raises(ValueError, match="no balanced sampling"):
        task.sample(np.random.default_rng(0), 10, balanced=True)
    with pytest.raises(ValueError, match="3 <= shortest <= longest for induction_heads"):
        sample_batch(task, np.random.default_rng(0), 4, (1, 10))


@pytest.mark.parametrize("name", ["s5_generators", "a5_generators"])
def test_group_tasks_balance_over_the_group_and_skew_the_second_generator(name: str) -> None:
    """Balanced draws reach (nearly) every element as the final label; at length 1 only the three generators are
    possible, so a draw for another label falls back to the uniform generator. P(1) skews "t" or "r"."""
    task, rng = TASKS[name], np.random.default_rng(14)
    finals = {task.label(task.sample(rng, 12, balanced=True))[-1] for _ in range(6 * len(task.labels))}
    assert len(finals) >= 0.9 * len(task.labels)
    assert {task.label(task.sample(rng, 1, balanced=True))[0] for _ in range(30)} <= {
        task.label(symbol)[0] for symbol in task.alphabet
    }
    text = "".join(sample_batch(task, np.random.default_rng(15), 100, (100, 100), p_one=0.8))
    assert text.count(task.alphabet[1]) / len(text) == pytest.approx(0.8, abs=0.01)
    assert task.alphabet[1] in "tr" and task.train_lengths == (1, 40)
