"""The automaton compiler: compiled LRNN and RegularGPT checkpoints compute their DFA's transduction exactly, on
every short string, on long ones, step by step and after a save/load round trip; the command line refuses bad
DFA files with exit code 2; the shipped compiled checkpoints equal fresh compilations."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.compiler_sweep import counter, live_string
from model.checkpoint import load_checkpoint, read_config, read_weights
from model.ops.linear_scan import column_norm_constraint
from training.automaton import DFA, MAX_STATES
from training.compile_cli import main
from training.compiler import (
    COMPILERS,
    LABEL_MARGIN,
    MAX_REGULARGPT_STATES,
    CompileError,
    compile_lrnn,
    compile_regulargpt,
    task_of,
)
from training.task_automata import AUTOMATA_DIR
from training.tasks import get_task

REPOSITORY = Path(__file__).resolve().parents[2]
SMALL_AUTOMATA = ["parity_check", "tomita3", "tomita4", "tomita5", "tomita6", "d2", "d3", "first", "one", "even_pairs"]
SHIPPED_TASKS = ("tomita3", "tomita4", "tomita5", "tomita6", "d2", "d3", "d4")
SHIPPED = [(task, arch) for task in SHIPPED_TASKS for arch in COMPILERS]
EXHAUSTIVE_LENGTH = 12
FIVE_SYMBOL_LENGTH = 5  # 5**5 strings; RegularGPT's d_ff for 11 states is 3146
MARGIN_TOLERANCE = 1e-4  # every logit difference is LABEL_MARGIN to within this, at every length checked


def load_dfa(name: str) -> DFA:
    return DFA.from_json(AUTOMATA_DIR / f"{name}.json")


def encode(dfa: DFA, strings: list[str], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids (B, length or the longest) and lengths (B,)."""
    length = length or max(map(len, strings))
    tokens = torch.zeros(len(strings), length, dtype=torch.long)
    for row, string in enumerate(strings):
        tokens[row, : len(string)] = torch.tensor([dfa.alphabet.index(symbol) for symbol in string])
    return tokens, torch.tensor([len(string) for string in strings])


def assert_labels(logits: torch.Tensor, accepted: torch.Tensor) -> None:
    """logits (..., 2) must give label "1" exactly where ``accepted`` (...) holds, by LABEL_MARGIN."""
    signed = (logits[..., 1] - logits[..., 0]) * torch.where(accepted, 1.0, -1.0)  # (...)
    wrong = int((signed <= 0).sum())
    assert wrong == 0, f"{wrong} wrong labels of {accepted.numel()}"
    torch.testing.assert_close(signed, torch.full_like(signed, LABEL_MARGIN), rtol=0, atol=MARGIN_TOLERANCE)


def assert_transduces(model, dfa: DFA, strings: list[str]) -> None:
    """Per position (forward, one batch of equal-length strings) and final (final_logits of prefixes)."""
    tokens, _ = encode(dfa, strings)
    with torch.no_grad():
        assert_labels(model(tokens), torch.tensor([dfa.run(string) for string in strings]))
        prefixes = sorted({string[:end] for string in strings for end in (1, len(string) // 2, len(string))})
        tokens, lengths = encode(dfa, prefixes)
        assert_labels(model.final_logits(tokens, lengths), torch.tensor([dfa.run(p)[-1] for p in prefixes]))


def assert_exact_on_every_string(model, dfa: DFA, length: int) -> None:
    """forward on every string of ``length`` gives every string of length 1..length as a prefix; final_logits on
    all of them right-padded in one batch of mixed lengths."""
    strings = ["".join(symbols) for symbols in itertools.product(dfa.alphabet, repeat=length)]
    tokens, _ = encode(dfa, strings)
    stride = {end: len(dfa.alphabet) ** (length - end) for end in range(1, length + 1)}
    every = [s[:end] for end, step in stride.items() for s in strings[::step]]  # each string of length `end` once
    assert len(set(every)) == sum(len(dfa.alphabet) ** end for end in range(1, length + 1))
    final_tokens, lengths = encode(dfa, every, length)
    with torch.no_grad():
        assert_labels(model(tokens), torch.tensor([dfa.run(string) for string in strings]))
        assert_labels(model.final_logits(final_tokens, lengths), torch.tensor([dfa.run(s)[-1] for s in every]))


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


@pytest.mark.parametrize("arch", sorted(COMPILERS))
def test_shipped_d4_checkpoint_agrees_with_the_reference_labeler(arch: str) -> None:
    """checkpoints/d4-<arch>-compiled against training.labelers' D_4 (not the DFA it was compiled from), at every
    position of 300 label-balanced strings of lengths 1..128, and on their final labels."""
    loaded = load_checkpoint(REPOSITORY / "checkpoints" / f"d4-{arch}-compiled", device="cpu")
    task, rng = get_task(loaded.config.task), np.random.default_rng(8)
    strings = [task.sample(rng, int(rng.integers(1, 129)), balanced=True) for _ in range(300)]
    assert {task.label(string)[-1] for string in strings} == {"0", "1"}
    tokens, lengths = encode(DFA.from_json(loaded.config.metadata["dfa"]), strings)
    labels = loaded.config.labels
    with torch.no_grad():
        per_position = loaded.model(tokens).argmax(-1)  # (B, T)
        final = loaded.model.final_logits(tokens, lengths).argmax(-1)  # (B,)
    for row, string in enumerate(strings):
        assert [labels[i] for i in per_position[row, : len(string)].tolist()] == task.label(string), string
    assert [labels[i] for i in final.tolist()] == [task.label(string)[-1] for string in strings]


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


@pytest.mark.parametrize("arch", sorted(COMPILERS))
def test_checkpoint_round_trip(arch: str, tmp_path: Path) -> None:
    dfa = load_dfa("d3")
    assert main([str(AUTOMATA_DIR / "d3.json"), "--arch", arch, "--out", str(tmp_path / "ckpt")]) == 0
    loaded = load_checkpoint(tmp_path / "ckpt", device="cpu")
    assert loaded.config.task == "d3" and loaded.config.alphabet == "ab" and loaded.config.labels == ("0", "1")
    assert loaded.config.metadata["compiled"] is True and DFA.from_json(loaded.config.metadata["dfa"]) == dfa
    assert next(loaded.model.parameters()).dtype == torch.float32
    strings = ["".join(symbols) for symbols in itertools.product(dfa.alphabet, repeat=9)]
    assert_transduces(loaded.model, dfa, strings + [live_string(dfa, 9, np.random.default_rng(5))])
    assert_transduces(loaded.model, dfa, [live_string(dfa, 1500, np.random.default_rng(6))])


@pytest.mark.parametrize(("task", "arch"), SHIPPED)
def test_shipped_checkpoint_equals_a_fresh_compilation(task: str, arch: str) -> None:
    """The folders under checkpoints/ are this compiler's output (regenerate them as training/compile_cli.py says)."""
    folder = REPOSITORY / "checkpoints" / f"{task}-{arch}-compiled"
    model, config = COMPILERS[arch](load_dfa(task))
    assert read_config(folder).to_dict() == config.to_dict()
    shipped = read_weights(folder / "model.safetensors")
    fresh = model.state_dict()
    assert sorted(shipped) == sorted(fresh)
    for name, tensor in fresh.items():
        assert torch.equal(shipped[name], tensor), name


def test_task_is_named_only_when_the_dfa_computes_it() -> None:
    dfa = load_dfa("tomita4").to_json()
    assert task_of(DFA.from_json(dfa)) == "tomita4"
    assert task_of(DFA.from_json({**dfa, "name": "my_language"})) is None
    assert task_of(DFA.from_json({**dfa, "accept": dfa["accept"][:-1]})) is None  # another language
    assert task_of(DFA.from_json({**dfa, "alphabet": "10"})) is None  # other token ids
    renamed = {**dfa, "states": [f"s{i}" for i in range(4)], "start": "s0", "accept": ["s0", "s1", "s2"],
               "delta": {f"s{i}": {s: f"s{dfa['states'].index(t)}" for s, t in row.items()}
                         for i, row in enumerate(dfa["delta"].values())}}
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


def test_regulargpt_refuses_too_many_states_and_lrnn_takes_them(tmp_path: Path, capsys) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps(counter(MAX_REGULARGPT_STATES + 1)))
    with pytest.raises(CompileError, match="MAX_REGULARGPT_STATES"):
        compile_regulargpt(DFA.from_json(path))
    assert main([str(path), "--arch", "regulargpt", "--out", str(tmp_path / "out")]) == 2
    assert "MAX_REGULARGPT_STATES" in capsys.readouterr().err
    assert main([str(path), "--arch", "lrnn", "--out", str(tmp_path / "out")]) == 0


def tomita4_with(**changes) -> dict:
    data = json.loads((AUTOMATA_DIR / "tomita4.json").read_text())
    return {**data, **changes}


BAD_DFAS = {
    "unknown state": (
        tomita4_with(delta={**tomita4_with()["delta"], "q0": {"0": "nowhere", "1": "q0"}}), "unknown state 'nowhere'"
    ),
    "missing transition": (
        tomita4_with(delta={**tomita4_with()["delta"], "q1": {"0": "q2"}}),
        "missing transition from state 'q1' on symbol '1'",
    ),
    "duplicate symbol": (tomita4_with(alphabet="010"), "symbol '0' appears more than once"),
    "multi-character symbol": (
        tomita4_with(delta={**tomita4_with()["delta"], "q0": {"0": "q1", "1": "q0", "01": "q0"}}),
        "a symbol must be one character",
    ),
    "empty alphabet": (tomita4_with(alphabet=""), "the alphabet is empty"),
    "too many states": (
        {**counter(MAX_STATES + 1), "name": "huge"}, f"more than MAX_STATES = {MAX_STATES}"
    ),
    "unknown start state": (tomita4_with(start="q9"), "start state 'q9' is not one of the states"),
}


@pytest.mark.parametrize("problem", sorted(BAD_DFAS))
def test_cli_refuses_a_bad_dfa_with_exit_code_2(problem: str, tmp_path: Path, capsys) -> None:
    data, message = BAD_DFAS[problem]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert main([str(path), "--arch", "lrnn", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_cli_refuses_unreadable_files_and_an_existing_checkpoint(tmp_path: Path, capsys) -> None:
    (tmp_path / "broken.json").write_text("{not json")
    assert main([str(tmp_path / "broken.json"), "--arch", "lrnn", "--out", str(tmp_path / "a")]) == 2
    assert "invalid JSON" in capsys.readouterr().err
    assert main([str(tmp_path / "absent.json"), "--arch", "lrnn", "--out", str(tmp_path / "a")]) == 2
    assert "cannot read the file" in capsys.readouterr().err
    source = str(AUTOMATA_DIR / "parity_check.json")
    assert main([source, "--arch", "lrnn", "--out", str(tmp_path / "a")]) == 0
    assert main([source, "--arch", "regulargpt", "--out", str(tmp_path / "a")]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main([source, "--arch", "regulargpt", "--out", str(tmp_path / "a"), "--overwrite"]) == 0
    assert read_config(tmp_path / "a").architecture == "regulargpt"
    with pytest.raises(SystemExit) as exit_info:  # argparse: an unknown architecture
        main([source, "--arch", "lstm", "--out", str(tmp_path / "b")])
    assert exit_info.value.code == 2


def test_python_dash_m_training_compiler(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(tomita4_with(alphabet="")))
    out = str(tmp_path / "o")
    command = [sys.executable, "-m", "training.compiler", str(bad), "--arch", "regulargpt", "--out", out]
    result = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "the alphabet is empty" in result.stderr
    command[3] = str(AUTOMATA_DIR / "tomita4.json")
    result = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert read_config(tmp_path / "o").task == "tomita4"
