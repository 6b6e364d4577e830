"""State codes for a block-diagonal LRNN transducer (``python -m training snap`` on an LRNN; ``LRNNConfig.state_codes``
in docs/models.md). Past its training lengths such a model's states can drift off the ones it visits there, and its
labels with them, while its automaton is right. Each block's states over strings of the training lengths are clustered
(a state joins the first centre within ``radius``, else starts one; each centre then becomes the mean of the states
nearest it): those are its codes. The snapped model replaces each block's state by its nearest code after every
``every``-th symbol. Like level codes, the model is checked at every position of fresh strings of the training
lengths, without codes and with them, and refused where it misreads one.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from model.checkpoint import LoadedCheckpoint
from model.config import LRNNConfig
from model.lrnn.model import BlockDiagonalLRNN, RecurrentBlock
from model.registry import build_model
from training.data.batches import encode_strings
from training.data.tasks import Task
from training.level_codes import SnapError, Snapped, fitted_checks, misreading

RADIUS = 0.2  # the default clustering radius
EVERY = 8  # the default: snap after every 8th symbol

# Most codes a block may have: a nearest-code search costs this many distances per block and snap.
MAX_CODES = 65_536


def by_length(strings: list[str]) -> list[list[str]]:
    """``strings`` grouped by length, so that each group runs as one unpadded batch."""
    groups: dict[int, list[str]] = {}
    for string in strings:
        groups.setdefault(len(string), []).append(string)
    return list(groups.values())


def visited_states(model: BlockDiagonalLRNN, alphabet: str, strings: list[str]) -> list[torch.Tensor]:
    """Every state each layer visits on ``strings``: per layer (N, H, b), N the symbols of all strings."""
    visited: list[list[torch.Tensor]] = [[] for _ in model.blocks]
    with torch.no_grad():
        for group in by_length(strings):
            x = model.embedding(encode_strings(group, alphabet)[0])  # (B, T, d_model): one length, no padding
            for layer, block in enumerate(model.blocks):
                assert isinstance(block, RecurrentBlock)
                x, states, _ = block.forward_states(x, None)  # (B, T, d_model), (B, T, H, b)
                visited[layer].append(states.flatten(0, 1))
    return [torch.cat(states) for states in visited]


def cluster(points: torch.Tensor, radius: float, generator: torch.Generator) -> torch.Tensor:
    """points (N, b) -> codes (K, b): leader clustering in a random order at ``radius``, then each code the mean of
    the points nearest it. SnapError past :data:`MAX_CODES`."""
    leaders = torch.empty_like(points)  # the first K rows are the leaders so far
    count = 0
    for point in points[torch.randperm(len(points), generator=generator)]:
        if count and float((leaders[:count] - point).norm(dim=1).min()) < radius:
            continue
        if count == MAX_CODES:
            raise SnapError(f"more than {MAX_CODES:,} codes in a block at radius {radius}: give a larger --radius")
        leaders[count] = point
        count += 1
    codes = leaders[:count]
    nearest = torch.cdist(points, codes, compute_mode="donot_use_mm_for_euclid_dist").argmin(dim=1)  # (N,)
    sums = torch.zeros_like(codes).index_add_(0, nearest, points)
    members = torch.bincount(nearest, minlength=count).unsqueeze(1)  # (K, 1), each >= 1: a leader is its own nearest
    return sums / members.clamp(min=1)


def snap(
    loaded: LoadedCheckpoint, task: Task, strings: int, radius: float, every: int, seed: int, command: str
) -> Snapped:
    """State codes for ``loaded`` (a block-diagonal LRNN transducer of ``task`` without them) from the states of
    ``strings`` strings of the task's training lengths, snapped after every ``every``-th symbol, checked on
    ``level_codes.CHECK_STRINGS`` more; SnapError where it cannot have them. ``command``: the command line, kept in the
    metadata."""
    model, config = loaded.model, loaded.config
    if not isinstance(model, BlockDiagonalLRNN) or config.kind != "transduce":
        raise SnapError(
            f"{loaded.path}: state codes are for block-diagonal LRNN transducers, not a {config.architecture} "
            f"{config.kind} model"
        )
    assert isinstance(config.model, LRNNConfig) and config.alphabet is not None  # an LRNN transducer's
    if config.model.state_codes:
        raise SnapError(f"{loaded.path} has state codes already")
    rng, generator = np.random.default_rng(seed), torch.Generator().manual_seed(seed)
    checks = fitted_checks(loaded, task, rng)
    low, high = max(task.train_lengths[0], task.shortest_length), task.train_lengths[1]
    drawn = [task.sample(rng, int(rng.integers(low, high + 1))) for _ in range(strings)]
    visited = visited_states(model, config.alphabet, drawn)  # per layer (N, H, b)
    blocks = [[cluster(layer[:, h], radius, generator) for h in range(layer.shape[1])] for layer in visited]
    size = max(len(codes) for layer in blocks for codes in layer)
    model_config = dataclasses.replace(config.model, state_codes=size, snap_every=every)
    snapped = build_model("lrnn", model_config).to(model.dtype)  # stored as the model was
    assert isinstance(snapped, BlockDiagonalLRNN)
    weights = model.state_dict()
    for i, layer in enumerate(blocks):  # each block's codes padded with copies of its first: the same nearest
        padded = [torch.cat([codes, codes[:1].expand(size - len(codes), -1)]) for codes in layer]
        weights[f"blocks.{i}.recurrence.state_codes"] = torch.stack(padded).to(model.dtype)  # (H, K, b)
    snapped.load_state_dict(weights)
    snapped.eval()
    misread = misreading(snapped, task, checks)
    if misread:
        raise SnapError(
            f"with state codes at radius {radius} the model misreads {misread} of the training lengths (it reads "
            "them right without): give a smaller --radius"
        )
    counts = [[len(codes) for codes in layer] for layer in blocks]
    positions = sum(map(len, checks))
    metadata = {
        **config.metadata,
        "state_codes": {
            "command": command,
            "from": str(loaded.path),
            "codes": counts,
            "checked": positions,
        },
    }
    summary = f"{min(map(min, counts)):,}-{size:,} codes per block from the states of {strings} strings"
    return Snapped(snapped, dataclasses.replace(config, model=model_config, metadata=metadata), summary)
