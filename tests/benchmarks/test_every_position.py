"""benchmarks/accuracy/every_position.py: a row per string, wrong positions counted against the labeler; what it
cannot read exits 2."""

from __future__ import annotations

import pytest

from benchmarks.accuracy import every_position
from benchmarks.accuracy.every_position import main


def test_a_row_per_string_and_the_wrong_positions(capsys, monkeypatch) -> None:
    argv = ["--checkpoint", "checkpoints/modular_arithmetic-lrnn", "--length", "301", "--strings", "2"]
    assert main([*argv, "--p-times", "0.9", "--chunk-symbols", "64"]) == 0
    out = capsys.readouterr().out
    assert "| 0 | 301 | 0 | - |" in out and "| 1 | 301 | 0 | - |" in out and "right at every position: 2 of 2" in out
    labelled = every_position.labelled

    def misread_from_100(*args):  # a model that misreads from position 100 on is caught there
        predicted = labelled(*args)
        predicted[100:] = (predicted[100:] + 1) % 5
        return predicted

    monkeypatch.setattr(every_position, "labelled", misread_from_100)
    assert main(argv) == 0
    assert "| 0 | 301 | 201 | 100 |" in capsys.readouterr().out


@pytest.mark.parametrize(
    "wrong",
    [
        ["--checkpoint", "missing-folder"],
        ["--checkpoint", "checkpoints/text-lrnn"],
        ["--checkpoint", "checkpoints/parity_check-lrnn", "--p-times", "0.5"],
        ["--checkpoint", "checkpoints/parity_check-lrnn", "--length", "0"],
    ],
)
def test_what_it_cannot_run_exits_2(wrong: list[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(wrong)
    assert stopped.value.code == 2
