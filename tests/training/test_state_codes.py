"""training/state_codes.py: clustering keeps every state within the radius of a code, and codes that hold every
state the model visits change none of its outputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from model.checkpoint import load_checkpoint
from model.lrnn.model import BlockDiagonalLRNN
from training.data.batches import encode_strings
from training.data.tasks import get_task
from training.state_codes import cluster, visited_states


def test_codes_lie_within_the_radius_of_every_point() -> None:
    generator = torch.Generator().manual_seed(0)
    points = torch.cat([torch.randn(50, 2) * 0.01 + centre for centre in torch.tensor([[0.0, 0.0], [1.0, 1.0]])])
    codes = cluster(points, 0.2, generator)
    assert len(codes) == 2
    assert float(torch.cdist(points, codes).min(dim=1).values.max()) < 0.2


def test_every_visited_state_as_a_code_changes_nothing() -> None:
    loaded = load_checkpoint("checkpoints/even_pairs-lrnn", device="cpu")  # a shipped LRNN without codes
    model, task = loaded.model, get_task("even_pairs")
    strings = [task.sample(np.random.default_rng(seed), 12) for seed in range(3)]
    visited = visited_states(model, task.alphabet, strings)  # per layer (N, H, b)
    config = dataclasses.replace(model.config, state_codes=visited[0].shape[0], snap_every=1)
    snapped, zeros = BlockDiagonalLRNN(config).eval(), BlockDiagonalLRNN(config).eval()
    codes = {f"blocks.{i}.recurrence.state_codes": states.transpose(0, 1) for i, states in enumerate(visited)}
    snapped.load_state_dict({**model.state_dict(), **codes})
    zeros.load_state_dict({**model.state_dict(), **{name: torch.zeros_like(value) for name, value in codes.items()}})
    ids, _ = encode_strings(strings, task.alphabet)
    with torch.no_grad():
        plain, with_codes = model(ids), snapped(ids)
        assert not torch.allclose(zeros(ids), plain, atol=1e-3)  # codes that are not the visited states change it
    torch.testing.assert_close(with_codes, plain, rtol=1e-5, atol=1e-5)
