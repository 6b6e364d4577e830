"""Our labelers agree with SLiCE's own generators (Benjamin-Walker/structured-linear-cdes, data_dir/fl_tasks) on
rows those generators drew (fixtures/slice_tasks.json, written by fixtures/make_slice_fixture.py), lengths 3-256.
The mapping, token for token (docs/results.md, the literature's protocol):

- parity: a (1) -> "0", b (2) -> "1"; their target a (an even number of b) is our final label "0", b is "1".
- even_pairs: a (1) and b (2) as they are; their target a (first symbol = last) is our final label "1" (an even
  number of changes), b is "0".
- cycle_nav: STAY (1) -> "1", +1 (2) -> "2", -1 (3) -> "0"; their target 4 + k is our final position "k".
- mod_arith_no_brack -> modular_arithmetic: numbers 5..9 -> "0".."4", + (1), - (2), * (3) as they are, their
  closing = (4) dropped; their target 5 + k is our final label "k" ("*" before "+" and "-" in both).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.data.tasks import TASKS

FIXTURE = Path(__file__).parent / "fixtures" / "slice_tasks.json"
SYMBOLS = {
    "parity_check": ("parity", {1: "0", 2: "1"}),
    "even_pairs": ("even_pairs", {1: "a", 2: "b"}),
    "cycle_navigation": ("cycle_nav", {1: "1", 2: "2", 3: "0"}),
    "modular_arithmetic": ("mod_arith_no_brack", {1: "+", 2: "-", 3: "*", **{5 + k: str(k) for k in range(5)}}),
}
CLOSING = 4  # mod_arith_no_brack's "=", the last token of each of its rows


def our_row(name: str, row: dict) -> tuple[str, str]:
    """Their row as our string and the final label their target stands for."""
    symbols = SYMBOLS[name][1]
    tokens, target = row["input"], row["target"]
    if name == "modular_arithmetic":
        assert tokens[-1] == CLOSING and CLOSING not in tokens[:-1]
        tokens = tokens[:-1]
    string = "".join(symbols[token] for token in tokens)
    label = {
        "parity_check": {1: "0", 2: "1"},
        "even_pairs": {1: "1", 2: "0"},
        "cycle_navigation": {4 + k: str(k) for k in range(5)},
        "modular_arithmetic": {5 + k: str(k) for k in range(5)},
    }[name][target]
    return string, label


@pytest.mark.parametrize("name", sorted(SYMBOLS))
def test_the_labeler_agrees_with_slice_s_generator_on_its_rows(name: str) -> None:
    rows = json.loads(FIXTURE.read_text())["tasks"][SYMBOLS[name][0]]
    assert len(rows) == 80 and max(len(row["input"]) for row in rows) > 200
    labels = {label for _, label in (our_row(name, row) for row in rows)}
    assert len(labels) == len(TASKS[name].labels)  # every answer occurs: a constant labeler would fail
    for row in rows:
        string, label = our_row(name, row)
        assert TASKS[name].label(string)[-1] == label, (string, row["target"])
