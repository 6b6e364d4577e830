"""An LRNN checkpoint's whole forward (a prefill with logits at every position) with its scans by "auto" against
each scan named, on the same model and tokens: time and the largest logit difference from auto.

    python -m benchmarks.models.bench_prefill_scan --model checkpoints/text-lrnn --device cuda
        [--impls parallel,chunked] [--shapes 1x4096,1x65536,8x4096,64x512]

On CUDA "auto" is the Triton scan where it runs (model/ops/scan/dispatch.py). Median of 5 runs after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.isolated import banner, time_calls
from model.checkpoint import load_checkpoint
from model.device import resolve_device
from model.lrnn.model import LinearRNN

RUNS = 5


def timed_forward(model: LinearRNN, impl: str, tokens: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Seconds (median of RUNS after a warm-up) of ``model(tokens)`` with every layer's scan set to ``impl``, and its
    logits."""
    for block in model.blocks:
        block.scan_impl = impl
    logits = []
    with torch.inference_mode():
        times, _ = time_calls(lambda: logits.append(model(tokens)), tokens.device, RUNS, float("inf"))
    return statistics.median(times), logits[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/text-lrnn", help="an LRNN checkpoint folder")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--impls", default="parallel,chunked", help="the named scans to time beside auto")
    parser.add_argument("--shapes", default="1x4096,1x65536,8x4096,64x512", help="rows x tokens, comma-separated")
    args = parser.parse_args()
    device = resolve_device(args.device)
    model = load_checkpoint(args.model, device=str(device)).model
    if not isinstance(model, LinearRNN):
        parser.error(f"--model: {args.model} is a {type(model).__name__}, not an LRNN")
    try:
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes.split(",")]
    except ValueError:
        parser.error(f"--shapes: expected ROWSxTOKENS,..., got {args.shapes!r}")
    impls = args.impls.split(",")
    print(banner(device, torch.get_num_threads()))
    print(f"| rows x tokens | auto (ms) | {' | '.join(f'{impl} (ms)' for impl in impls)} | largest logit difference |")
    print("|---|---:|" + "---:|" * len(impls) + "---|")
    for rows, length in shapes:
        tokens = torch.randint(0, model.config.vocab_size, (rows, length), device=device)
        auto, reference = timed_forward(model, "auto", tokens)
        cells, differences = [], []
        for impl in impls:
            seconds, logits = timed_forward(model, impl, tokens)
            cells.append(f"{seconds * 1e3:.2f}")
            differences.append(f"{impl} {(logits.float() - reference.float()).abs().max().item():.1e}")
        print(f"| {rows} x {length} | {auto * 1e3:.2f} | {' | '.join(cells)} | {', '.join(differences)} |", flush=True)


if __name__ == "__main__":
    main()
