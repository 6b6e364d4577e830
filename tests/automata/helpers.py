"""Helpers shared by the tests of compiled automata (tests/automata, tests/training/cli/test_compile_cli.py) and of
regular expressions (tests/server/structured/test_structured_regex.py)."""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import torch

from automata.automaton import DFA, MooreMachine
from automata.compiler import LABEL_MARGIN, labels_of
from automata.task_automata import AUTOMATA_DIR

MARGIN_TOLERANCE = 1e-4  # every logit difference is LABEL_MARGIN to within this, at every length checked


def load_dfa(name: str) -> DFA:
    """A task's DFA file under automata/tasks."""
    return DFA.from_json(AUTOMATA_DIR / f"{name}.json")


def tomita4_with(**changes) -> dict:
    """The JSON of the shipped tomita4 DFA with some keys replaced."""
    data = json.loads((AUTOMATA_DIR / "tomita4.json").read_text())
    return {**data, **changes}


def encode(dfa: DFA | MooreMachine, strings: list[str], length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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


def assert_machine_labels(logits: torch.Tensor, label_ids: torch.Tensor) -> None:
    """logits (..., K) must rank label ``label_ids`` (...) first, LABEL_MARGIN above the next."""
    right = logits.gather(-1, label_ids[..., None])[..., 0]  # (...)
    others = logits.scatter(-1, label_ids[..., None], float("-inf")).amax(-1)  # (...)
    wrong = int((right <= others).sum())
    assert wrong == 0, f"{wrong} wrong labels of {label_ids.numel()}"
    torch.testing.assert_close(right - others, torch.full_like(right, LABEL_MARGIN), rtol=0, atol=MARGIN_TOLERANCE)


def assert_machine_transduces(model, machine: MooreMachine, strings: list[str]) -> None:
    """A compiled Moore machine: its label ids (``labels_of``) per position of equal-length strings (forward) and at
    the end of mixed-length prefixes (final_logits)."""
    ids = {label: k for k, label in enumerate(labels_of(machine))}
    tokens, _ = encode(machine, strings)
    with torch.no_grad():
        expected = torch.tensor([[ids[label] for label in machine.transduce(string)] for string in strings])
        assert_machine_labels(model(tokens), expected)
        prefixes = sorted({string[:end] for string in strings for end in (1, len(string) // 2, len(string))})
        tokens, lengths = encode(machine, prefixes)
        expected = torch.tensor([ids[machine.transduce(prefix)[-1]] for prefix in prefixes])
        assert_machine_labels(model.final_logits(tokens, lengths), expected)


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


def random_pattern(rng: np.random.Generator, alphabet: str, depth: int = 0) -> str:
    """A random regular expression over ``alphabet``: symbols, classes, '.', concatenation, alternation,
    optional, star, plus and bounded repetition, nested three deep; counted repetition only in the innermost
    groups, which keeps the automata small."""
    if depth >= 3 or rng.random() < 0.3:
        kind = rng.integers(4)
        if kind == 0:
            return "."
        if kind == 1:
            members = "".join(sorted(set(rng.choice(list(alphabet), size=2))))
            return f"[{'^' if rng.random() < 0.3 else ''}{members}]"
        return re.escape(str(rng.choice(list(alphabet))))
    kind = rng.integers(6)
    parts = [random_pattern(rng, alphabet, depth + 1) for _ in range(int(rng.integers(1, 4)))]
    if kind == 0:
        return "".join(parts)
    if kind == 1:
        return "(" + "|".join(parts) + ")"
    counted = f"{{{rng.integers(0, 3)},{rng.integers(3, 5)}}}" if depth == 2 else "?"
    suffix = ["*", "+", "?", counted][kind - 2]
    return "(" + "".join(parts) + ")" + suffix
