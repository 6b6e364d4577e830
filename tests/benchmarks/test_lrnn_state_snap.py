"""benchmarks/accuracy/lrnn_state_snap.py: codes from the visited states, and labels with the states snapped."""

from __future__ import annotations

import pytest
import torch

from benchmarks.accuracy.lrnn_state_snap import cluster, main, stepped, token_ids
from model.checkpoint import load_checkpoint

CHECKPOINT = "checkpoints/sum_mod5-lrnn"


def test_codes_lie_within_the_radius_of_every_point() -> None:
    generator = torch.Generator().manual_seed(0)
    points = torch.cat([torch.randn(50, 2) * 0.01 + centre for centre in torch.tensor([[0.0, 0.0], [1.0, 1.0]])])
    codes = cluster(points, 0.2, generator)
    assert len(codes) == 2
    assert float(torch.cdist(points, codes).min(dim=1).values.max()) < 0.2


def test_stepping_with_every_visited_state_as_a_code_changes_nothing() -> None:
    model = load_checkpoint(CHECKPOINT, device="cpu").model
    ids = token_ids("01234", ["0123401234", "4444433333"])
    labels, states = stepped(model, ids)
    with torch.no_grad():
        assert torch.equal(labels, model(ids).argmax(dim=-1))  # the steps are the forward pass
    codes = [[layer[:, :, h].reshape(-1, layer.shape[-1]) for h in range(layer.shape[2])] for layer in states]
    snapped, again = stepped(model, ids, codes)
    assert torch.equal(snapped, labels) and all(torch.equal(a, b) for a, b in zip(again, states))


def test_the_table_and_a_checkpoint_it_cannot_read(capsys) -> None:
    assert main(["--checkpoint", CHECKPOINT, "--lengths", "41", "--strings", "4", "--train-strings", "8"]) == 0
    assert "| 41 | 4 | 100.0 | 100.0 |" in capsys.readouterr().out
    for wrong in (
        ["--checkpoint", "checkpoints/parity_check-regulargpt"],
        ["--checkpoint", CHECKPOINT, "--every", "0"],
    ):
        with pytest.raises(SystemExit) as stopped:
            main(wrong)
        assert stopped.value.code == 2
