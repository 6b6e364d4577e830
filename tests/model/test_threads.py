"""model/threads.py: the one thread rule."""

from __future__ import annotations

import pytest
import torch

from model import threads


@pytest.mark.parametrize(
    ("cores", "processes", "expected"), [(1, 1, 1), (2, 1, 1), (2, 2, 1), (16, 1, 15), (16, 8, 1), (64, 4, 15)]
)
def test_the_rule_leaves_one_core_and_splits_the_rest(monkeypatch, cores: int, processes: int, expected: int) -> None:
    monkeypatch.setattr(threads, "usable_cores", lambda: cores)
    assert threads.default_threads(processes) == expected


def test_set_threads_applies_the_rule_or_the_override(monkeypatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "usable_cores", lambda: 3)
    try:
        assert threads.set_threads() == 2 and torch.get_num_threads() == 2
        assert threads.set_threads(1) == 1 and torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="at least 1"):
            threads.set_threads(0)
    finally:
        torch.set_num_threads(before)


def test_a_container_cpu_limit_caps_the_cores(monkeypatch) -> None:
    monkeypatch.setattr(threads, "_cgroup_cpu_quota", lambda: 1.5)
    assert threads.usable_cores() <= 2
