"""``python -m training compile`` (training/cli/compile.py): it writes checkpoints that load and compute their DFA's
transduction, it refuses bad DFA files and bad regular expressions with exit code 2 and one line on stderr, and
the compiled checkpoints it ships under checkpoints/ equal fresh compilations and agree with the task labelers."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from automata.automaton import DFA, MAX_STATES
from automata.compiler import COMPILERS, MAX_REGULARGPT_STATES
from automata.regex import regex_dfa
from automata.samples import counter, live_string, symmetric
from automata.task_automata import AUTOMATA_DIR
from model.checkpoint import load_checkpoint, read_config, read_weights
from tests.automata.helpers import assert_exact_on_every_string, assert_transduces, encode, load_dfa, tomita4_with
from training.cli.main import main
from training.data.batches import FinalLabelSet, count_correct_final
from training.data.tasks import get_task

REPOSITORY = Path(__file__).resolve().parents[3]
SHIPPED_TASKS = ("tomita3", "tomita4", "tomita5", "tomita6", "d2", "d3", "d4")
SHIPPED = [(task, arch) for task in SHIPPED_TASKS for arch in COMPILERS]


def compile_(*argv: str) -> int:
    return main(["compile", *argv])


@pytest.mark.parametrize("arch", sorted(COMPILERS))
def test_checkpoint_round_trip(arch: str, tmp_path: Path) -> None:
    dfa = load_dfa("d3")
    assert compile_(str(AUTOMATA_DIR / "d3.json"), "--arch", arch, "--out", str(tmp_path / "ckpt")) == 0
    loaded = load_checkpoint(tmp_path / "ckpt", device="cpu")
    assert loaded.config.task == "d3" and loaded.config.alphabet == "ab" and loaded.config.labels == ("0", "1")
    assert loaded.config.metadata["compiled"] is True and DFA.from_json(loaded.config.metadata["dfa"]) == dfa
    assert next(loaded.model.parameters()).dtype == torch.float32
    strings = ["".join(symbols) for symbols in itertools.product(dfa.alphabet, repeat=9)]
    assert_transduces(loaded.model, dfa, strings + [live_string(dfa, 9, np.random.default_rng(5))])
    assert_transduces(loaded.model, dfa, [live_string(dfa, 1500, np.random.default_rng(6))])


@pytest.mark.parametrize(("task", "arch"), SHIPPED)
def test_shipped_checkpoint_equals_a_fresh_compilation(task: str, arch: str) -> None:
    """The folders under checkpoints/ are this command's output (regenerate them as training/cli/compile.py says)."""
    folder = REPOSITORY / "checkpoints" / f"{task}-{arch}-compiled"
    model, config = COMPILERS[arch](load_dfa(task))
    assert read_config(folder).to_dict() == config.to_dict()
    shipped = read_weights(folder / "model.safetensors")
    fresh = model.state_dict()
    assert sorted(shipped) == sorted(fresh)
    for name, tensor in fresh.items():
        assert torch.equal(shipped[name], tensor), name


def test_shipped_induction_heads_checkpoint_equals_a_fresh_task_compilation(tmp_path: Path, capsys) -> None:
    """checkpoints/induction_heads-lrnn-compiled is ``compile --task induction_heads --arch lrnn``'s output; the
    RegularGPT construction refuses the task's 19 states."""
    folder = REPOSITORY / "checkpoints" / "induction_heads-lrnn-compiled"
    assert compile_("--task", "induction_heads", "--arch", "lrnn", "--out", str(tmp_path / "fresh")) == 0
    assert read_config(folder).to_dict() == read_config(tmp_path / "fresh").to_dict()
    shipped, fresh = read_weights(folder / "model.safetensors"), read_weights(tmp_path / "fresh" / "model.safetensors")
    assert sorted(shipped) == sorted(fresh) and all(torch.equal(shipped[name], fresh[name]) for name in fresh)
    config = read_config(folder)
    assert config.task == "induction_heads" and config.labels == get_task("induction_heads").labels
    assert compile_("--task", "induction_heads", "--arch", "regulargpt", "--out", str(tmp_path / "rg")) == 2
    assert "19 states" in capsys.readouterr().err


@pytest.mark.slow
def test_shipped_induction_heads_checkpoint_is_right_at_2_to_the_20() -> None:
    """The final label of two 2^20-symbol strings of the task's generator, through the cache in bounded chunks (the
    path of ``eval --chunk-symbols``), and of short ones through final_logits."""
    loaded = load_checkpoint(REPOSITORY / "checkpoints" / "induction_heads-lrnn-compiled", device="cpu")
    task = get_task("induction_heads")
    long = FinalLabelSet.draw(task, np.random.default_rng(9), 2, (2**20, 2**20))
    assert count_correct_final(loaded.model, long, task.alphabet, batch_size=2, chunk_symbols=2**17) == 2
    short = FinalLabelSet.draw(task, np.random.default_rng(10), 200, (3, 300))
    assert count_correct_final(loaded.model, short, task.alphabet, batch_size=50) == 200


@pytest.mark.parametrize("arch", sorted(COMPILERS))
def test_shipped_d4_checkpoint_agrees_with_the_reference_labeler(arch: str) -> None:
    """checkpoints/d4-<arch>-compiled against training.data.labelers' D_4 (not the DFA it was compiled from), at every
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


def test_regulargpt_refuses_a_large_monoid_naming_its_caps_and_lrnn_takes_it(tmp_path: Path, capsys) -> None:
    path = tmp_path / "big.json"
    path.write_text(json.dumps(symmetric(MAX_REGULARGPT_STATES + 1)))
    assert compile_(str(path), "--arch", "regulargpt", "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "MAX_REGULARGPT_STATES = 16" in err and "MAX_REGULARGPT_MONOID = 128" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
    assert compile_(str(path), "--arch", "lrnn", "--out", str(tmp_path / "out")) == 0


BAD_DFAS = {
    "unknown state": (
        tomita4_with(delta={**tomita4_with()["delta"], "q0": {"0": "nowhere", "1": "q0"}}),
        "unknown state 'nowhere'",
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
    "too many states": ({**counter(MAX_STATES + 1), "name": "huge"}, f"more than MAX_STATES = {MAX_STATES}"),
    "unknown start state": (tomita4_with(start="q9"), "start state 'q9' is not one of the states"),
}


@pytest.mark.parametrize("problem", sorted(BAD_DFAS))
def test_a_bad_dfa_is_refused_with_exit_code_2(problem: str, tmp_path: Path, capsys) -> None:
    data, message = BAD_DFAS[problem]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    assert compile_(str(path), "--arch", "lrnn", "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_unreadable_files_and_an_existing_checkpoint_are_refused(tmp_path: Path, capsys) -> None:
    (tmp_path / "broken.json").write_text("{not json")
    assert compile_(str(tmp_path / "broken.json"), "--arch", "lrnn", "--out", str(tmp_path / "a")) == 2
    assert "invalid JSON" in capsys.readouterr().err
    assert compile_(str(tmp_path / "absent.json"), "--arch", "lrnn", "--out", str(tmp_path / "a")) == 2
    assert "cannot read the file" in capsys.readouterr().err
    source = str(AUTOMATA_DIR / "parity_check.json")
    assert compile_(source, "--arch", "lrnn", "--out", str(tmp_path / "a")) == 0
    assert compile_(source, "--arch", "regulargpt", "--out", str(tmp_path / "a")) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert compile_(source, "--arch", "regulargpt", "--out", str(tmp_path / "a"), "--overwrite") == 0
    assert read_config(tmp_path / "a").architecture == "regulargpt"
    capsys.readouterr()
    assert compile_(source, "--arch", "lstm", "--out", str(tmp_path / "b")) == 2  # an unknown architecture
    assert "invalid choice: 'lstm'" in capsys.readouterr().err


@pytest.mark.parametrize("arch", sorted(COMPILERS))
def test_compile_regex_writes_an_exact_model(arch: str, tmp_path: Path) -> None:
    out = tmp_path / arch
    assert compile_("--regex", "(ab|b)*a?", "--alphabet", "ab", "--arch", arch, "--out", str(out)) == 0
    loaded = load_checkpoint(out, device="cpu")
    assert loaded.config.alphabet == "ab" and loaded.config.labels == ("0", "1")
    dfa = regex_dfa("(ab|b)*a?", "ab")
    assert_exact_on_every_string(loaded.model, dfa, 8)
    rng = np.random.default_rng(0)
    assert_transduces(loaded.model, dfa, [live_string(dfa, 3000, rng)])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--regex", "a"], "--regex needs --alphabet"),
        (["--alphabet", "ab"], "give a DFA JSON file, --regex PATTERN or --task NAME, one of the three"),
        (["--regex", "(a", "--alphabet", "ab"], "invalid regular expression '(a'"),
        (["--task", "palindrome"], "no regular task 'palindrome'; the regular tasks: parity_check, "),
        (["--task", "d2", "--alphabet", "ab"], "--alphabet goes with --regex"),
        (["--task", "d2", str(AUTOMATA_DIR / "d2.json")], "one of the three"),
    ],
)
def test_compile_regex_refuses_bad_input_with_exit_2(argv: list[str], message: str, tmp_path: Path, capsys) -> None:
    assert compile_(*argv, "--arch", "lrnn", "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_python_dash_m_training_compile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(tomita4_with(alphabet="")))
    out = str(tmp_path / "o")
    command = [sys.executable, "-m", "training", "compile", str(bad), "--arch", "regulargpt", "--out", out]
    result = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "the alphabet is empty" in result.stderr
    command[4] = str(AUTOMATA_DIR / "tomita4.json")
    result = subprocess.run(command, cwd=REPOSITORY, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert read_config(tmp_path / "o").task == "tomita4"
