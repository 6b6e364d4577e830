"""One product of a decode step, as the server runs it with ``batch_invariant`` on, against MKL's: milliseconds per
call of x (R, in) times a weight (out, in), one thread, no gradients.

Three ways, alternating within each round, each cell the best of its rounds:

- ``panels``: :func:`model.ops.cpu.cpu_decode.linear` under ``set_row_invariant(True)``, the row-invariant product
  across outputs (model/ops/cpu/kernels/panels.py; the panels are made before timing);
- ``dots``: the dot-product kernel the invariant path ran before (``cpu_decode._kernels.ops.dots``: one dot product
  per row and output, reduced horizontally), also row-invariant;
- ``mkl``: ``F.linear``, what a decode step runs without invariance past 4 rows (its bits depend on the rows).

    python -m benchmarks.ops.bench_head_product [--shapes 8192x16,8192x128,2048x512] [--rows 1,4,16,64] [--rounds 5]
        [--calls 30]

8,192 x 16 is the head of the tiny LRNN of benchmarks/serve/engine/bench_engine_process.py, 8,192 x 128 text-lrnn's.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.isolated import banner
from model.ops.cpu import cpu_decode


def per_call_ms(call, calls: int) -> float:
    call()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls * 1e3


def best_times(x: torch.Tensor, weight: torch.Tensor, rounds: int, calls: int) -> dict[str, float]:
    """The best ms per call of each way over ``rounds`` rounds of ``calls`` calls, the ways alternating."""
    out = np.empty((x.shape[0], weight.shape[0]), dtype=np.float32)

    def panels() -> None:
        with cpu_decode.row_invariance():
            cpu_decode.linear(x, weight)

    def dots() -> None:
        cpu_decode._kernels.ops.dots(x.numpy(), weight.numpy(), np.zeros(0, dtype=np.float32), False, out)

    ways = {"panels": panels, "dots": dots, "mkl": lambda: F.linear(x, weight)}
    best = dict.fromkeys(ways, float("inf"))
    with torch.no_grad():
        for _ in range(rounds):
            for name, call in ways.items():
                best[name] = min(best[name], per_call_ms(call, calls))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x16,8192x128,2048x512", help="out x in of each weight")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not cpu_decode.kernel_available():
        raise SystemExit("the kernels need numba")
    print(f"{banner(torch.device('cpu'), 1)}, {time.strftime('%Y-%m-%d %H:%M')}")
    generator = torch.Generator().manual_seed(0)
    print("| weight (out x in) | rows | panels (ms) | dots (ms) | mkl (ms) | panels / mkl | dots / mkl |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for shape in args.shapes.split(","):
        outputs, width = (int(value) for value in shape.split("x"))
        weight = torch.randn(outputs, width, generator=generator)
        for rows in (int(value) for value in args.rows.split(",")):
            x = torch.randn(rows, width, generator=generator)
            best = best_times(x, weight, args.rounds, args.calls)
            print(
                f"| {outputs} x {width} | {rows} | {best['panels']:.3f} | {best['dots']:.3f} | {best['mkl']:.3f} | "
                f"{best['panels'] / best['mkl']:.2f} | {best['dots'] / best['mkl']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
