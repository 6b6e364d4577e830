"""Short prompts under batch invariance: a prompt's pass of its own (``model.forward``, the head on the last position
where the model can) against the same tokens as decode steps (``model.step`` per token), alone and with many rows
together, per row; what ``server/execution/generation.py``'s ``STEPPED_PREFILL_TOKENS`` is chosen from.

    python -m benchmarks.models.bench_short_prefill [--models checkpoints/text-lrnn,checkpoints/text-regulargpt]
        [--lengths 2,6,16,40] [--rows 64]

CPU, one torch thread, row invariance on (``cpu_decode.set_row_invariant``); best of 5 passes / 3 stepped runs after
a warm-up.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import torch

from benchmarks.isolated import time_calls
from model.checkpoint import load_checkpoint
from model.ops.cpu import cpu_decode


def best_seconds(run: Callable[[], None], repeats: int) -> float:
    """The fastest of ``repeats`` calls after a warm-up."""
    return min(time_calls(run, torch.device("cpu"), repeats, float("inf"))[0])


def pass_of_its_own(model, length: int) -> None:
    """One prompt of ``length`` random tokens through ``model.forward``, as the server runs a chunk alone."""
    tokens, cache = torch.randint(0, model.config.vocab_size, (1, length)), model.new_cache(1)
    if model.selects_positions:
        positions = torch.zeros(1, length, dtype=torch.bool)
        positions[:, -1] = True
        model.forward(tokens, cache=cache, positions=positions)
    else:
        model.forward(tokens, cache=cache)


def stepped(model, rows: int, length: int) -> None:
    """``rows`` prompts of ``length`` random tokens as ``length`` decode steps over their stacked caches."""
    caches = [model.new_cache(1) for _ in range(rows)]
    cache = caches[0] if rows == 1 else type(caches[0]).stack(caches)
    tokens = torch.randint(0, model.config.vocab_size, (rows, length))
    for position in range(length):
        model.step(tokens[:, position], cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="checkpoints/text-lrnn,checkpoints/text-regulargpt")
    parser.add_argument("--lengths", default="2,6,16,40")
    parser.add_argument("--rows", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu_decode.set_row_invariant(True)
    print(
        "| model | prompt tokens | a pass of its own (ms) | stepped alone (ms) | "
        f"stepped, {args.rows} rows together (ms per row) |"
    )
    print("|---|---:|---:|---:|---:|")
    for folder in args.models.split(","):
        model = load_checkpoint(folder, device="cpu").model
        with torch.inference_mode():
            for length in (int(n) for n in args.lengths.split(",")):
                own = best_seconds(functools.partial(pass_of_its_own, model, length), 5)
                alone = best_seconds(functools.partial(stepped, model, 1, length), 3)
                together = best_seconds(functools.partial(stepped, model, args.rows, length), 3) / args.rows
                print(
                    f"| {folder.rstrip('/').split('/')[-1]} | {length} | {own * 1e3:.2f} | {alone * 1e3:.2f} | "
                    f"{together * 1e3:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
