"""A stochastic LRNN checkpoint's CPU prefill with its compiled parts switched off one by one: ``model.forward`` on
one row of ``--tokens`` random tokens, served layout (``for_serving``), the head on the last position (as the server
prefills a prompt nobody scores), one torch thread, best of 5 after a warm-up, in rounds.

    python -m benchmarks.models.bench_cpu_prefill [--model checkpoints/text-lrnn] [--tokens 4096] [--rounds 2]
    python -m benchmarks.models.bench_cpu_prefill --train [--block-size 8] [--rounds 2]

``--train``: instead, one AdamW step of a fresh model of the text-lrnn recipe's shape (stochastic, 2 layers, d 128,
16 blocks of ``--block-size``, vocabulary 8,192) on 16 rows of 128 tokens scored on their last 10 (a pass-key
step's shape), mean of 5 after a warm-up.

Rows: torch's column sparsemax and chunked scan (what ran before the compiled parts); the compiled sparsemax
(``cpu_decode.column_sparsemax``); both it and the compiled scan (``cpu_decode.linear_scan``: what runs now), with the
largest logit difference from the first.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.isolated import time_calls
from model.checkpoint import load_checkpoint
from model.config import LRNNConfig
from model.ops.cpu import cpu_decode
from model.registry import build_model

RUNS = 5


def timed(model, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Best seconds of RUNS forwards after a warm-up, and the logits."""
    logits = []

    def forward() -> None:
        logits.append(model.forward(tokens, cache=model.new_cache(1), positions=positions))

    with torch.inference_mode():
        times, _ = time_calls(forward, tokens.device, RUNS, float("inf"))
    return min(times), logits[-1]


def train_step_seconds(block_size: int) -> float:
    """Mean seconds of RUNS optimizer steps after one, on the model and batch of ``--train``."""
    config = LRNNConfig(
        vocab_size=8192,
        d_model=128,
        n_layers=2,
        block_size=block_size,
        num_blocks=16,
        d_ff=512,
        transition_norm="stochastic",
    )
    torch.manual_seed(0)
    model = build_model("lrnn", config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, config.vocab_size, (16, 128))
    scored = torch.zeros(16, 128, dtype=torch.bool)
    scored[:, -10:] = True

    def step() -> None:
        loss = F.cross_entropy(model(tokens, positions=scored), tokens[scored])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    times, _ = time_calls(step, torch.device("cpu"), RUNS, float("inf"))
    return statistics.mean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/text-lrnn")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--train", action="store_true", help="time a training step instead of a prefill")
    parser.add_argument("--block-size", type=int, default=8, help="with --train")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sparsemax, compiles_scan = cpu_decode.column_sparsemax, cpu_decode.compiles_scan
    settings: dict[str, tuple[Callable, Callable]] = {  # what cpu_decode's two switches are set to, by row
        "torch sparsemax, torch scan": (lambda matrices: None, lambda *tensors: False),
        "compiled sparsemax, torch scan": (sparsemax, lambda *tensors: False),
        "compiled sparsemax, compiled scan": (sparsemax, compiles_scan),
    }
    try:
        if args.train:
            del settings["compiled sparsemax, torch scan"]
            train_table(settings, args.block_size, args.rounds)
        else:
            prefill_table(parser, settings, args.model, args.tokens, args.rounds)
    finally:
        cpu_decode.column_sparsemax, cpu_decode.compiles_scan = sparsemax, compiles_scan


def train_table(settings: dict[str, tuple[Callable, Callable]], block_size: int, rounds: int) -> None:
    print(f"one training step, blocks of {block_size}, torch {torch.__version__}, one thread\n")
    print("| round | parts | step (ms) |\n|---:|---|---:|")
    for round_ in range(1, rounds + 1):
        for label, (cpu_decode.column_sparsemax, cpu_decode.compiles_scan) in settings.items():
            print(f"| {round_} | {label} | {train_step_seconds(block_size) * 1e3:.0f} |", flush=True)


def prefill_table(parser, settings: dict[str, tuple[Callable, Callable]], path: str, length: int, rounds: int) -> None:
    model = load_checkpoint(path, device="cpu").model
    model.for_serving()
    if not model.selects_positions:
        parser.error(f"--model: {path} does not run its head on chosen positions (not an LRNN)")
    tokens = torch.randint(0, model.config.vocab_size, (1, length))
    positions = torch.zeros(1, length, dtype=torch.bool)
    positions[:, -1] = True
    print(f"{path}, {length} tokens, torch {torch.__version__}, one thread\n")
    print("| round | parts | forward (ms) | tokens/s | largest logit difference from torch's |")
    print("|---:|---|---:|---:|---:|")
    for round_ in range(1, rounds + 1):
        reference = None
        for label, (cpu_decode.column_sparsemax, cpu_decode.compiles_scan) in settings.items():
            seconds, logits = timed(model, tokens, positions)
            reference = logits if reference is None else reference
            difference = (logits - reference).abs().max().item()
            print(
                f"| {round_} | {label} | {seconds * 1e3:.0f} | {length / seconds:,.0f} | {difference:.1e} |", flush=True
            )


if __name__ == "__main__":
    main()
