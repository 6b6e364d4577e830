"""A transducer's label at every position of long strings, against the task's labeler: the served answer is a label
per position, while ``python -m training eval`` scores the last. Strings are drawn as the task draws them (with
``--p-one`` / ``--p-times`` as ``eval`` takes them) and run through the model's cache in chunks of
``--chunk-symbols``, so memory stays bounded at a million symbols. Printed: one row per string, its positions
labelled wrong, the first of them and the time the model took.

    python -m benchmarks.accuracy.every_position --checkpoint checkpoints/modular_arithmetic-lrnn \
        [--length 1000000] [--strings 3] [--seed 0] [--p-one P] [--p-times P] [--chunk-symbols 65536] [--threads 1]

String i is drawn from the random stream (seed, i). Exit 2 on a checkpoint it cannot read or a text model.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from model.base import SequenceModel
from model.checkpoint import CheckpointError, load_checkpoint
from model.config import ConfigError
from training.cli.arguments import positive_int, probability
from training.data.batches import encode_strings, logits_in_chunks
from training.data.tasks import get_task


def labelled(model: SequenceModel, ids: torch.Tensor, chunk: int) -> np.ndarray:
    """ids (1, T) -> the model's label id at every position (T,), chunk by chunk through its cache."""
    with torch.no_grad():
        return torch.cat([logits[0].argmax(-1) for logits in logits_in_chunks(model, ids, chunk)]).numpy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.accuracy.every_position", description=__doc__)
    parser.add_argument("--checkpoint", required=True, help="a transducer's checkpoint folder")
    parser.add_argument("--length", type=positive_int, default=1_000_000)
    parser.add_argument("--strings", type=positive_int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--p-one", type=probability, help="P(the alphabet's second symbol), as eval's --p-one")
    parser.add_argument("--p-times", type=probability, help="modular_arithmetic: P('*' among the operators)")
    parser.add_argument("--chunk-symbols", type=positive_int, default=65_536)
    parser.add_argument("--threads", type=positive_int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    try:
        loaded = load_checkpoint(args.checkpoint, device="cpu")
    except (CheckpointError, ConfigError, OSError) as error:
        parser.error(f"--checkpoint {args.checkpoint}: {error}")
    if not loaded.config.task:
        parser.error(f"--checkpoint {args.checkpoint}: not a task transducer (no task in its config.json)")
    task = get_task(loaded.config.task)
    label_ids = {label: i for i, label in enumerate(task.labels)}
    model = loaded.model.eval()
    print(f"{args.checkpoint} ({task.name}), {args.strings} strings of {args.length:,} symbols, seed {args.seed}")
    print("| string | symbols | wrong positions | first wrong | model s |")
    print("|---:|---:|---:|---:|---:|")
    right = 0
    for index in range(args.strings):
        rng = np.random.default_rng([args.seed, index])
        try:
            string = task.sample(rng, args.length, args.p_one, p_times=args.p_times)
        except ValueError as error:
            parser.error(str(error))
        ids = encode_strings([string], task.alphabet)[0]  # (1, T)
        started = time.perf_counter()
        predicted = labelled(model, ids, args.chunk_symbols)
        seconds = time.perf_counter() - started
        wrong = np.nonzero(predicted != np.array([label_ids[label] for label in task.label(string)]))[0]
        first = f"{int(wrong[0]):,}" if len(wrong) else "-"
        print(f"| {index} | {len(string):,} | {len(wrong):,} | {first} | {seconds:.1f} |")
        right += not len(wrong)
    print(f"right at every position: {right} of {args.strings}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
