"""A stochastic LRNN checkpoint's CPU prefill with its compiled parts switched off one by one: ``model.forward`` on
one row of ``--tokens`` random tokens, served layout (``for_serving``), the head on the last position (as the server
prefills a prompt nobody scores), one torch thread, best of 5 after a warm-up, in rounds.

    python -m benchmarks.bench_cpu_prefill [--model checkpoints/text-lrnn] [--tokens 4096] [--rounds 2]

Rows: torch's column sparsemax and chunked scan (before 2026-11-26 20:00); the compiled sparsemax
(``cpu_decode.column_sparsemax``); both it and the compiled scan (``cpu_decode.linear_scan``: what runs now), with the
largest logit difference from the first.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from model.checkpoint import load_checkpoint
from model.ops import cpu_decode

RUNS = 5


def timed(model, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Best seconds of RUNS forwards after a warm-up, and the logits."""
    with torch.inference_mode():
        logits = model.forward(tokens, cache=model.new_cache(1), positions=positions)
        best = float("inf")
        for _ in range(RUNS):
            start = time.perf_counter()
            model.forward(tokens, cache=model.new_cache(1), positions=positions)
            best = min(best, time.perf_counter() - start)
    return best, logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/text-lrnn")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_checkpoint(args.model, device="cpu").model
    model.for_serving()
    if not model.selects_positions:
        parser.error(f"--model: {args.model} does not run its head on chosen positions (not an LRNN)")
    tokens = torch.randint(0, model.config.vocab_size, (1, args.tokens))
    positions = torch.zeros(1, args.tokens, dtype=torch.bool)
    positions[:, -1] = True
    sparsemax, compiles_scan = cpu_decode.column_sparsemax, cpu_decode.compiles_scan
    settings: dict[str, tuple[Callable, Callable]] = {
        "torch sparsemax, torch scan": (lambda matrices: None, lambda *tensors: False),
        "compiled sparsemax, torch scan": (sparsemax, lambda *tensors: False),
        "compiled sparsemax, compiled scan": (sparsemax, compiles_scan),
    }
    print(f"{args.model}, {args.tokens} tokens, torch {torch.__version__}, one thread\n")
    print("| round | parts | forward (ms) | tokens/s | largest logit difference from torch's |")
    print("|---:|---|---:|---:|---:|")
    try:
        for round_ in range(1, args.rounds + 1):
            reference = None
            for label, (cpu_decode.column_sparsemax, cpu_decode.compiles_scan) in settings.items():
                seconds, logits = timed(model, tokens, positions)
                reference = logits if reference is None else reference
                difference = (logits - reference).abs().max().item()
                print(f"| {round_} | {label} | {seconds * 1e3:.0f} | {args.tokens / seconds:,.0f} | {difference:.1e} |",
                      flush=True)  # fmt: skip
    finally:
        cpu_decode.column_sparsemax, cpu_decode.compiles_scan = sparsemax, compiles_scan


if __name__ == "__main__":
    main()
