"""``server.execution.sampling.sample`` alone, per row count and filter: what picking the next tokens costs a step.

    python -m benchmarks.ops.bench_sampling [--device cpu] [--rows 1,8,64] [--vocabulary 8192]

Logits are seeded normal scores times 3 (a spread like a small trained model's: top-p 0.9 keeps a few hundred of 8,192
tokens); each cell is the median of 200 calls after 10 warm-up calls, the device's queue drained after each
(``benchmarks.models.bench_decode_path.microseconds``). To compare code versions, run it at each commit
(``git worktree add``) on the same machine, alternating.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.isolated import banner
from benchmarks.models.bench_decode_path import microseconds
from model.device import resolve_device
from server.execution.sampling import SamplingParams, sample

FILTERS = {
    "greedy": {"temperature": 0.0},
    "T=1": {},
    "T=0.1": {"temperature": 0.1},
    "top_k=50": {"top_k": 50},
    "top_p=0.9": {"top_p": 0.9},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--vocabulary", type=int, default=8192)
    args = parser.parse_args()
    device = resolve_device(args.device)
    torch.set_num_threads(1)
    rows_list = [int(value) for value in args.rows.split(",")]
    print(f"{banner(device, 1)}; vocabulary {args.vocabulary}; us per call\n")
    print(f"| filter | {' | '.join(f'{rows} rows' for rows in rows_list)} |")
    print(f"|---|{'---:|' * len(rows_list)}")
    generator = torch.Generator().manual_seed(0)
    logits = {rows: 3 * torch.randn(rows, args.vocabulary, generator=generator).to(device) for rows in rows_list}
    for name, fields in FILTERS.items():
        cells = []
        for rows in rows_list:
            params = [SamplingParams(**fields, seed=row) for row in range(rows)]
            generators = [row_params.generator() for row_params in params]
            cells.append(microseconds(lambda p=params, g=generators, x=logits[rows]: sample(x, p, g), device))
        print(f"| {name} | {' | '.join(f'{value:,.0f}' for value in cells)} |", flush=True)


if __name__ == "__main__":
    main()
