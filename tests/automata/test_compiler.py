"""The automaton compiler: compiled LRNN and RegularGPT models compute their DFA's transduction exactly, on every
short string, on long ones and step by step; they name a task only when the DFA computes it. The command line and
the shipped compiled checkpoints: tests/training/cli/test_compile_cli.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from automata import compiler
from automata.automaton import DFA, MooreMachine
from automata.compiler import (
    COMPILERS,
    MAX_REGULARGPT_STATES,
    CompileError,
    CompileTooLarge,
    compile_lrnn,
    compile_regulargpt,
    task_of,
)
from automata.samples import counter, live_string, symmetric
from automata.task_automata import cycle_navigation, induction_heads, modular_arithmetic, sum_mod5
from model.ops.scan.constraints import column_norm_constraint
from tests.automata.helpers import (
    assert_exact_on_every_string,
    assert_labels,
    assert_machine_transduces,
    assert_transduces,
    encode,
    load_dfa,
)

SMALL_AUTOMATA = ["parity_check", "tomita3", "tomita4", "tomita5", "tomita6", "d2", "d3", "first", "one", "even_pairs"]
EXHAUSTIVE_LENGTH = 12
FIVE_SYMBOL_LENGTH = 5  # 5**5 strings; RegularGPT's d_ff for 11 states is 3146


@pytest.mark.parametrize("name", SMALL_AUTOMATA)
@pytest.mark.parametrize("arch", sorted(COMPILERS))
def test_exact_on_every_string_up_to_length_12(arch: str, name: str) -> None:
    dfa = load_dfa(name)
    assert_exact_on_every_string(COMPILERS[arch](dfa)[0], dfa, EXHAUSTIVE_LENGTH)


@pytest.mark.parametrize("arch", sorted(COMPILERS))
def test_exact_on_every_string_over_five_symbols(arch: str) -> None:
    """even_pair_mod5 (11 states, alphabet 01234): every string of length 1..FIVE_SYMBOL_LENGTH."""
    dfa = load_dfa("even_pair_mod5")
    assert len(dfa.alphabet) == 5
    assert_exact_on_every_string(COMPILERS[arch](dfa)[0], dfa, FIVE_SYMBOL_LENGTH)


@pytest.mark.parametrize("name", ["parity_check", "tomita4", "tomita6", "d3"])
@pytest.mark.parametrize("arch", sorted(COMPILERS))
def test_exact_on_long_strings(arch: str, name: str) -> None:
    dfa = load_dfa(name)
    model, _ = COMPILERS[arch](dfa)
    rng = np.random.default_rng(0)
    assert_transduces(model, dfa, [live_string(dfa, 2049, rng)])  # RegularGPT: 12 thick layers
    strings = [live_string(dfa, length, rng) for length in (2000, 3333, 5000)]
    tokens, lengths = encode(dfa, strings)
    with torch.no_grad():
        assert_labels(model.final_logits(tokens, lengths), torch.tensor([dfa.run(s)[-1] for s in strings]))


@pytest.mark.slow
def test_exact_at_a_hundred_thousand_symbols() -> None:
    """float32, 10**5 symbols: per position for both (RegularGPT at 17 thick layers), and final ones."""
    for name, arch in (("tomita6", "lrnn"), ("parity_check", "regulargpt")):
        dfa = load_dfa(name)
        model, _ = COMPILERS[arch](dfa)
        assert_transduces(model, dfa, [live_string(dfa, 100_000, np.random.default_rng(1))])
    dfa = load_dfa("d3")
    string = live_string(dfa, 100_000, np.random.default_rng(2))
    for compile_dfa in (compile_lrnn, compile_regulargpt):
        with torch.no_grad():
            final = compile_dfa(dfa)[0].final_logits(encode(dfa, [string])[0])
        assert_labels(final, torch.tensor([dfa.run(string)[-1]]))


def test_lrnn_state_is_the_one_hot_dfa_state_and_the_constraint_is_a_no_op() -> None:
    dfa = load_dfa("tomita3")
    model, _ = compile_lrnn(dfa)
    string = live_string(dfa, 3000, np.random.default_rng(3))
    tokens, _ = encode(dfa, [string])
    block = model.blocks[0]
    with torch.no_grad():
        u = block.ln_1(model.embedding(tokens))  # (1, T, d)
        raw = block.recurrence.transition(u).unflatten(-1, (1, len(dfa.states) + 1, len(dfa.states) + 1))
        torch.testing.assert_close(column_norm_constraint(raw, model.config.p_norm), raw, rtol=0, atol=0)
        cache = model.new_cache(batch_size=1)
        for position, state in enumerate(dfa.machine.trace(string)):
            model.step(tokens[:, position], cache)
            expected = torch.zeros(len(dfa.states) + 1)
            expected[[dfa.states.index(state), len(dfa.states)]] = 1.0  # [e_q; started]
            torch.testing.assert_close(cache.states[0][0, 0], expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", sorted(COMPILERS))
def test_step_by_step_decoding_gives_the_labels(arch: str) -> None:
    """Across RegularGPT's depth growths (at 2, 4, ..., 64), after a prefill and from an empty cache."""
    dfa = load_dfa("tomita5")
    model, _ = COMPILERS[arch](dfa)
    string = live_string(dfa, 70, np.random.default_rng(4))
    tokens, _ = encode(dfa, [string])
    accepted = torch.tensor(dfa.run(string))
    for prefill in (0, 5):
        with torch.no_grad():
            cache = model.new_cache(batch_size=1)
            logits = [model(tokens[:, :prefill], cache=cache)[0]] if prefill else []
            logits += [model.step(tokens[:, t], cache) for t in range(prefill, len(string))]
        assert_labels(torch.cat(logits), accepted)


def test_task_is_named_only_when_the_dfa_computes_it() -> None:
    dfa = load_dfa("tomita4").to_json()
    assert task_of(DFA.from_json(dfa)) == "tomita4"
    assert task_of(DFA.from_json({**dfa, "name": "my_language"})) is None
    assert task_of(DFA.from_json({**dfa, "accept": dfa["accept"][:-1]})) is None  # another language
    assert task_of(DFA.from_json({**dfa, "alphabet": "10"})) is None  # other token ids
    renamed = {
        **dfa,
        "states": [f"s{i}" for i in range(4)],
        "start": "s0",
        "accept": ["s0", "s1", "s2"],
        "delta": {
            f"s{i}": {s: f"s{dfa['states'].index(t)}" for s, t in row.items()}
            for i, row in enumerate(dfa["delta"].values())
        },
    }
    assert task_of(DFA.from_json(renamed)) == "tomita4"  # the same transduction under other state names


def test_compilation_does_not_depend_on_the_random_seed() -> None:
    dfa = load_dfa("one")
    for compile_dfa in (compile_lrnn, compile_regulargpt):
        torch.manual_seed(0)
        first = compile_dfa(dfa)[0].state_dict()
        torch.manual_seed(1)
        second = compile_dfa(dfa)[0].state_dict()
        assert all(torch.equal(first[name], second[name]) for name in first)


def test_an_arbitrary_dfa_compiles_without_a_task() -> None:
    dfa = DFA.from_json(counter(7))
    strings = ["".join(symbols) for symbols in itertools.product(dfa.alphabet, repeat=8)]
    for compile_dfa in (compile_lrnn, compile_regulargpt):
        model, config = compile_dfa(dfa)
        assert config.task is None and config.metadata["dfa"]["name"] == "counter7"
        assert_transduces(model, dfa, strings)


def test_regulargpt_takes_more_states_through_a_small_monoid_and_refuses_a_large_one() -> None:
    """counter17 (17 states, the cyclic group of 17 elements) compiles over its monoid, d_model 2 * 17, exactly;
    symmetric17 (a monoid of 17! elements) is refused naming both caps; the LRNN takes both."""
    small = DFA.from_json(counter(MAX_REGULARGPT_STATES + 1))
    model, config = compile_regulargpt(small)
    assert config.model.d_model == 2 * (MAX_REGULARGPT_STATES + 1)
    assert_exact_on_every_string(model, small, 8)
    large = DFA.from_json(symmetric(MAX_REGULARGPT_STATES + 1))
    with pytest.raises(CompileTooLarge, match="symmetric17: 17 states and a transition monoid of more than 128"):
        compile_regulargpt(large)
    for dfa in (small, large):
        assert_exact_on_every_string(compile_lrnn(dfa)[0], dfa, 8)


@pytest.mark.parametrize("name", SMALL_AUTOMATA)
def test_the_monoid_construction_is_exact_where_the_matrix_one_is_used(name: str, monkeypatch) -> None:
    """With the matrix construction's cap at 0, every automaton goes through its monoid: exact as the other."""
    monkeypatch.setattr(compiler, "MAX_REGULARGPT_STATES", 0)
    dfa = load_dfa(name)
    model, config = compile_regulargpt(dfa)
    assert config.model.d_model != 2 * len(dfa.states) ** 2 or len(dfa.states) == 2
    assert_exact_on_every_string(model, dfa, 10)


@pytest.mark.parametrize("machine", [cycle_navigation(), sum_mod5()], ids=lambda machine: machine.name)
@pytest.mark.parametrize("arch", sorted(COMPILERS))
def test_a_moore_machine_with_five_labels_compiles_exactly(arch: str, machine) -> None:
    """Every string up to length 6, a long one; its labels are its outputs sorted, and it names its task."""
    model, config = COMPILERS[arch](machine)
    assert config.labels == ("0", "1", "2", "3", "4") and config.task == machine.name
    assert config.metadata["moore_machine"] == machine.to_json() and "dfa" not in config.metadata
    strings = ["".join(symbols) for symbols in itertools.product(machine.alphabet, repeat=6)]
    assert_machine_transduces(model, machine, strings)
    rng = np.random.default_rng(7)
    assert_machine_transduces(model, machine, ["".join(rng.choice(list(machine.alphabet), 3000))])


def test_induction_heads_compiles_into_an_lrnn_and_is_too_large_for_regulargpt() -> None:
    """19 states, 18 labels: every string of 4 symbols ("##", several marks, none), long strings of the task's
    generator and uniform ones; RegularGPT's construction refuses it (more than MAX_REGULARGPT_STATES)."""
    machine = induction_heads()
    model, config = compile_lrnn(machine)
    assert config.task == "induction_heads" and config.labels[:3] == ("#", "-", "a") and len(config.labels) == 18
    assert model.config.d_model == 64 and model.config.block_size == 20
    strings = ["".join(symbols) for symbols in itertools.product(machine.alphabet, repeat=4)]
    assert_machine_transduces(model, machine, strings)
    rng = np.random.default_rng(8)
    letters = "abcdefghijklmnop"
    keyed = ["".join(rng.choice(list(letters), 2999)) + "#" for _ in range(3)]
    keyed = [string[:mark] + "#" + string[mark + 1 :] for string, mark in zip(keyed, (0, 1500, 2997))]
    assert_machine_transduces(model, machine, [*keyed, "".join(rng.choice(list(machine.alphabet), 3000))])
    with pytest.raises(CompileError, match="induction_heads: 19 states.*MAX_REGULARGPT_STATES = 16"):
        compile_regulargpt(machine)


def test_a_moore_machine_names_its_task_only_when_it_computes_it() -> None:
    machine = cycle_navigation()
    assert task_of(machine) == "cycle_navigation" and task_of(induction_heads()) == "induction_heads"
    assert task_of(modular_arithmetic()) == "modular_arithmetic"
    other_labels = {state: str(i % 2) for i, state in enumerate(machine.states)}
    assert (
        task_of(
            MooreMachine(machine.name, machine.alphabet, machine.states, machine.start, machine.delta, other_labels)
        )
        is None
    )
