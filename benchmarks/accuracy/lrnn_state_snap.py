"""Whether a trained LRNN transducer fails past its training lengths because its states drift off the ones it visits
there (docs/results.md, "modular_arithmetic: not shipped"). Each block's states over strings of the training lengths
are clustered (a point joins the first centre within ``--radius``, else starts one; each centre then becomes the mean
of the points nearest it): the block's codes. Strings of each ``--lengths`` are then labelled twice: by the model's
forward pass, and step by step with each block's state replaced, after every step, by its nearest code. Printed per
length: the final label's accuracy of both; per layer: the codes of each block and the range of its state norms at
the training lengths against the longest length.

    python -m benchmarks.accuracy.lrnn_state_snap --checkpoint runs/X [--radius 0.05] [--lengths 41,499,1999,4999]
        [--strings 100] [--train-strings 512] [--every 1] [--seed 0] [--threads 1]

Block-diagonal LRNN transducers only (architecture ``lrnn``). A length is drawn as the task draws it
(modular_arithmetic: rounded down to an odd length).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from model.checkpoint import CheckpointError, load_checkpoint
from model.config import ConfigError
from model.lrnn.model import LinearRNN
from training.data.tasks import Task, get_task

Codes = list[list[torch.Tensor]]  # per layer, per block: (K, b) codes


def token_ids(alphabet: str, strings: list[str]) -> torch.Tensor:
    """Strings of one length -> (B, T) int64 ids (a symbol's id is its place in the alphabet)."""
    return torch.tensor([[alphabet.index(symbol) for symbol in string] for string in strings], dtype=torch.long)


def stepped(
    model: LinearRNN, ids: torch.Tensor, codes: Codes | None = None, every: int = 1
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """ids (B, T) -> each position's label (B, T) and each layer's states (B, T, H, b), run one step at a time; with
    ``codes``, each block's state replaced by its nearest code after every ``every``-th step."""
    rows, length = ids.shape
    states = [block.recurrence.initial_state(rows).clone() for block in model.blocks]  # each (B, H, b)
    seen: list[list[torch.Tensor]] = [[] for _ in model.blocks]
    labels = []
    with torch.no_grad():
        for position in range(length):
            x = model.embedding(ids[:, position])  # (B, d_model)
            for layer, block in enumerate(model.blocks):
                u = block.ln_1(x)
                state = block.recurrence.step(u, states[layer])  # (B, H, b)
                if codes is not None and (position + 1) % every == 0:
                    state = torch.stack(
                        [near[torch.cdist(state[:, h], near).argmin(dim=1)] for h, near in enumerate(codes[layer])],
                        dim=1,
                    )
                states[layer] = state
                seen[layer].append(state)
                x = x + block.recurrence.readout(state, u)
                x = x + block.mlp(block.ln_2(x))
            labels.append(model.embedding.logits(model.ln_f(x)).argmax(dim=-1))
    return torch.stack(labels, dim=1), [torch.stack(each, dim=1) for each in seen]


def cluster(points: torch.Tensor, radius: float, generator: torch.Generator) -> torch.Tensor:
    """points (N, b) -> (K, b) codes: leader clustering in a random order at ``radius``, then each code the mean of
    the points nearest it."""
    leaders: list[torch.Tensor] = []
    for point in points[torch.randperm(len(points), generator=generator)]:
        if leaders and float(torch.cdist(point[None], torch.stack(leaders)).min()) < radius:
            continue
        leaders.append(point)
    codes = torch.stack(leaders)
    nearest = torch.cdist(points, codes).argmin(dim=1)
    return torch.stack(
        [points[nearest == k].mean(dim=0) if bool((nearest == k).any()) else codes[k] for k in range(len(codes))]
    )


def by_length(task: Task, rng: np.random.Generator, lengths: list[int]) -> dict[int, list[str]]:
    """One string per entry of ``lengths``, drawn by the task, grouped by their (drawn) lengths."""
    groups: dict[int, list[str]] = {}
    for length in lengths:
        string = task.sample(rng, length)
        groups.setdefault(len(string), []).append(string)
    return groups


def final_right(task: Task, labels: tuple[str, ...], strings: list[str], predicted: torch.Tensor) -> int:
    """How many of ``strings`` have their last label predicted right (predicted (B, T) label indexes)."""
    wanted = torch.tensor([labels.index(task.label(string)[-1]) for string in strings])
    return int((predicted[:, -1] == wanted).sum())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--radius", type=float, default=0.05)
    parser.add_argument("--lengths", default="41,499,1999,4999")
    parser.add_argument("--strings", type=int, default=100, help="strings of each length")
    parser.add_argument("--train-strings", type=int, default=512, help="strings of the training lengths for the codes")
    parser.add_argument("--every", type=int, default=1, help="snap after every this many steps (1: each)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        lengths = [int(length) for length in args.lengths.split(",")]
    except ValueError:
        parser.error(f"--lengths {args.lengths!r}: comma-separated whole numbers")
    if args.radius <= 0 or min(args.strings, args.train_strings, args.every, *lengths) < 1:
        parser.error("--radius, --strings, --train-strings, --every and every length must be positive")
    try:
        loaded = load_checkpoint(args.checkpoint, device="cpu")
    except (CheckpointError, ConfigError, OSError) as error:
        parser.error(f"--checkpoint: {error}")
    config = loaded.config
    if config.architecture != "lrnn" or config.task is None or config.alphabet is None or not config.labels:
        parser.error(f"--checkpoint {args.checkpoint}: not a block-diagonal LRNN transducer of a task")
    model = loaded.model
    assert isinstance(model, LinearRNN)  # architecture "lrnn"
    torch.set_num_threads(args.threads)
    task, rng, generator = (
        get_task(config.task),
        np.random.default_rng(args.seed),
        torch.Generator().manual_seed(args.seed),
    )
    shortest, longest = task.train_lengths
    trained = by_length(task, rng, [int(n) for n in rng.integers(shortest, longest + 1, size=args.train_strings)])
    runs = [stepped(model, token_ids(config.alphabet, group))[1] for group in trained.values()]
    visited = [torch.cat([states.flatten(0, 1) for states in layer]) for layer in zip(*runs)]  # each (N, H, b)
    blocks = visited[0].shape[1]
    codes = [[cluster(layer[:, h], args.radius, generator) for h in range(blocks)] for layer in visited]
    print(
        f"{args.checkpoint}: {config.task}, codes at radius {args.radius} from {args.train_strings} strings of "
        f"lengths {shortest}-{longest}, snapped after every {args.every} step(s)"
    )
    print("| length | strings | final label right: as served | snapped to the codes |")
    print("|---:|---:|---:|---:|")
    for length in lengths:
        groups = by_length(task, rng, [length] * args.strings)
        plain = snapped = 0
        for strings in groups.values():
            ids = token_ids(config.alphabet, strings)
            with torch.no_grad():
                plain += final_right(task, config.labels, strings, model(ids).argmax(dim=-1))
            predicted, _ = stepped(model, ids, codes, args.every)
            snapped += final_right(task, config.labels, strings, predicted)
        print(
            f"| {length} | {args.strings} | {100 * plain / args.strings:.1f} | {100 * snapped / args.strings:.1f} |",
            flush=True,
        )
    longest_strings = next(iter(by_length(task, rng, [max(lengths)] * 8).values()))
    last_states = [states.flatten(0, 1) for states in stepped(model, token_ids(config.alphabet, longest_strings))[1]]
    print(f"\n| layer | codes per block | state norm 1st-99th percentile: training lengths / length {max(lengths)} |")
    print("|---:|---|---|")
    for layer, (near, train_states, long_states) in enumerate(zip(codes, visited, last_states)):
        ranges = []
        for h in range(blocks):
            inside, outside = train_states[:, h].norm(dim=-1), long_states[:, h].norm(dim=-1)
            ranges.append(
                f"{inside.quantile(0.01):.2f}-{inside.quantile(0.99):.2f} / "
                f"{outside.quantile(0.01):.2f}-{outside.quantile(0.99):.2f}"
            )
        print(f"| {layer} | {', '.join(str(len(each)) for each in near)} | {'; '.join(ranges)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
