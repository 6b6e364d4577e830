"""benchmarks/accuracy/regulargpt_levels.py: window elements from the running products, and the level table."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.accuracy.regulargpt_levels import main, rows, window_elements
from training.data.labelers import a5_generators, s5_generators

COMPILED = "checkpoints/a5_generators-regulargpt-compiled"


@pytest.mark.parametrize("labeler, alphabet", [(a5_generators, "erc"), (s5_generators, "etc")])
def test_window_elements_are_the_labels_of_the_windows(labeler, alphabet) -> None:
    rng = np.random.default_rng(0)
    string = "".join(rng.choice(list(alphabet), 70))
    prefix = rows(labeler(string))
    for width in (1, 2, 5, 16, 64):
        got = window_elements(prefix, width)
        for end in range(len(string)):
            want = rows(labeler(string[max(0, end - width + 1) : end + 1]))[-1]
            assert np.array_equal(got[end], want), (width, end)


def test_the_compiled_model_composes_right_at_every_level(capsys) -> None:
    assert main(["--checkpoint", COMPILED, "--length", "70", "--strings", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    levels = [line.split("|") for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert len(levels) == 7  # depth of position 69 with C = 2
    whole = [cells for cells in levels if int(cells[3]) > 0]  # the top level's window (128) is no window's
    assert len(whole) == 6
    for cells in whole:
        assert float(cells[4]) == 100.0 and float(cells[6]) == 0.0  # right; composed wrong


def test_a_checkpoint_of_another_task_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--checkpoint", "checkpoints/parity_check-regulargpt"])
    assert stopped.value.code == 2
    assert "a RegularGPT of a5_generators, s5_generators is needed" in capsys.readouterr().err
