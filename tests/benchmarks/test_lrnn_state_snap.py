"""benchmarks/accuracy/lrnn_state_snap.py: one row per radius, interval and length; what it cannot read exits 2."""

from __future__ import annotations

import pytest

from benchmarks.accuracy.lrnn_state_snap import main

CHECKPOINT = "checkpoints/even_pairs-lrnn"  # a shipped LRNN without codes


def test_a_row_per_setting_and_length(capsys) -> None:
    argv = ["--checkpoint", CHECKPOINT, "--radius", "0.2,100", "--every", "1,4", "--lengths", "41,60", "--strings", "4"]
    assert main([*argv, "--train-strings", "8"]) == 0
    out = capsys.readouterr().out
    for every in (1, 4):
        for length in (41, 60):
            assert f"| 0.2 | {every} |" in out and f"| {length} | 4 | 100.0 | 100.0 |" in out
    assert "| 100.0 | 1 | refused: " in out and "give a smaller --radius" in out  # one code a block misreads


@pytest.mark.parametrize(
    "wrong",
    [
        ["--checkpoint", "checkpoints/parity_check-regulargpt"],
        ["--checkpoint", CHECKPOINT, "--every", "0"],
        ["--checkpoint", CHECKPOINT, "--radius", "a"],
        ["--checkpoint", "missing-folder"],
        ["--checkpoint", "checkpoints/modular_arithmetic-lrnn"],  # has codes already
    ],
)
def test_what_it_cannot_run_exits_2(wrong: list[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(wrong)
    assert stopped.value.code == 2
