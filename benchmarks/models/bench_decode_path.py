"""The pieces of one served decode step, timed apart: the model's step eagerly and through CUDA graphs
(``model/cuda_graphs.py``), and sampling its logits where the model runs and through the CPU, at temperature 1 and
greedy (``server/execution/sampling.py``), for a served checkpoint at a few batch sizes. What decided
``server.execution.generation.HOST_SAMPLING_ELEMENTS``.

    python -m benchmarks.models.bench_decode_path [--model checkpoints/text-lrnn] [--device cuda] [--rows 1,8,64]

Each figure is the median of 200 calls after 10 warm-up calls, the device's queue drained after each.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.isolated import banner
from model.checkpoint import load_checkpoint
from model.cuda_graphs import capture_sizes, decoder_for
from model.device import resolve_device
from server.execution.sampling import SamplingParams, sample

ROOT = Path(__file__).resolve().parents[2]


def microseconds(call: Callable[[], object], device: torch.device, calls: int = 200) -> float:
    def drained() -> None:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(10):
        drained()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        drained()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "text-lrnn")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--rows", default="1,8,64")
    args = parser.parse_args()
    device = resolve_device(args.device)
    torch.set_num_threads(1)
    model = load_checkpoint(args.model, device=str(device)).model.eval()
    model.for_serving()
    print(f"{banner(device, 1)}; {args.model.name}")
    with torch.inference_mode():
        decoder = decoder_for(model, capture_sizes(64))
        print(f"decode path: {decoder.path}\n")
        print(
            "| rows | step eager (us) | step as served (us) | sample T=1 on the model's device (us) | through the "
            "CPU (us) | greedy on the device (us) | through the CPU (us) |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for rows in [int(value) for value in args.rows.split(",")]:
            cache = model.new_cache(rows)
            tokens = torch.zeros(rows, dtype=torch.long, device=device)
            eager = microseconds(lambda t=tokens, c=cache: model.step(t, c), device)
            served = microseconds(lambda t=tokens, c=cache: decoder.step(t, c), device)
            logits = decoder.step(tokens, cache).float().clone()  # (rows, V)
            figures = []
            for temperature in (1.0, 0.0):
                params = [SamplingParams(temperature=temperature, seed=row) for row in range(rows)]
                generators = [row_params.generator() for row_params in params]
                figures.append(microseconds(lambda p=params, g=generators, x=logits: sample(x, p, g), device))
                figures.append(microseconds(lambda p=params, g=generators, x=logits: sample(x.cpu(), p, g), device))
            cells = " | ".join(f"{value:.0f}" for value in (eager, served, *figures))
            print(f"| {rows} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
