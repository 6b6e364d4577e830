"""How a block-diagonal LRNN transducer's state codes (``python -m training snap``; docs/models.md, "The LRNN's state
codes") hold past its training lengths, for each clustering radius and snap interval, without writing checkpoints.
For each ``--radius`` x ``--every`` the codes are made as ``snap`` makes them (training/state_codes.py); strings of
each ``--lengths`` are then labelled by the model as served and by the model with the codes. Printed: one row per
length and setting, the final label's accuracy of both, the codes per block and each setting's labelling time.

    python -m benchmarks.accuracy.lrnn_state_snap --checkpoint runs/X [--radius 0.05,0.2] [--every 1,8]
        [--lengths 499,1999,4999] [--strings 100] [--train-strings 512] [--seed 0] [--threads 1]

A length is drawn as the task draws it (modular_arithmetic: rounded down to an odd length).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from model.checkpoint import CheckpointError, load_checkpoint
from model.config import ConfigError
from training.data.batches import FinalLabelSet, count_correct_final
from training.data.tasks import get_task
from training.level_codes import SnapError
from training.state_codes import snap


def numbers(parser: argparse.ArgumentParser, flag: str, text: str, kind: type) -> list:
    """A comma-separated list of positive ``kind`` values, or exit 2 naming ``flag``."""
    try:
        values = [kind(item) for item in text.split(",")]
    except ValueError:
        parser.error(f"{flag} {text!r}: comma-separated positive numbers")
    if not values or min(values) <= 0:
        parser.error(f"{flag} {text!r}: comma-separated positive numbers")
    return values


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a block-diagonal LRNN transducer without codes")
    parser.add_argument("--radius", default="0.2", help="clustering radii, comma-separated")
    parser.add_argument("--every", default="8", help="snap intervals, comma-separated")
    parser.add_argument("--lengths", default="499,1999,4999")
    parser.add_argument("--strings", type=int, default=100, help="strings of each length")
    parser.add_argument("--train-strings", type=int, default=512, help="strings of the training lengths for the codes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    radii = numbers(parser, "--radius", args.radius, float)
    intervals = numbers(parser, "--every", args.every, int)
    lengths = numbers(parser, "--lengths", args.lengths, int)
    if min(args.strings, args.train_strings, args.threads) < 1:
        parser.error("--strings, --train-strings and --threads must be positive")
    try:
        loaded = load_checkpoint(args.checkpoint, device="cpu")
    except (CheckpointError, ConfigError, OSError) as error:
        parser.error(f"--checkpoint: {error}")
    config = loaded.config
    if config.architecture != "lrnn" or config.task is None or getattr(config.model, "state_codes", 0):
        parser.error(f"--checkpoint {args.checkpoint}: not a block-diagonal LRNN transducer of a task without codes")
    torch.set_num_threads(args.threads)
    task, rng = get_task(config.task), np.random.default_rng(args.seed)
    drawn = {length: FinalLabelSet.draw(task, rng, args.strings, (length, length)) for length in lengths}
    served = {
        length: count_correct_final(loaded.model, examples, task.alphabet, args.strings)
        for length, examples in drawn.items()
    }
    print(f"{args.checkpoint}: {task.name}, codes from {args.train_strings} strings of the training lengths")
    print("| radius | every | codes per block | length | strings | as served | with the codes | seconds |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for radius in radii:
        for every in intervals:
            try:
                snapped = snap(loaded, task, args.train_strings, radius, every, args.seed, "benchmark")
            except SnapError as error:
                print(f"| {radius} | {every} | refused: {error} | | | | | |", flush=True)
                continue
            counts = snapped.config.metadata["state_codes"]["codes"]
            codes = f"{min(map(min, counts))}-{max(map(max, counts))}"
            for length, examples in drawn.items():
                start = time.perf_counter()
                coded = count_correct_final(snapped.model, examples, task.alphabet, args.strings)
                seconds = time.perf_counter() - start
                print(
                    f"| {radius} | {every} | {codes} | {length} | {len(examples)} | "
                    f"{100 * served[length] / len(examples):.1f} | {100 * coded / len(examples):.1f} | {seconds:.1f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
