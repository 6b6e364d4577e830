"""The LRNN decode step at size L against its bandwidth and FLOP floors, full against low-rank generator.

Size L: d_model 512, 8 layers of 64 blocks of 8 (state 512), d_ff 2048, vocabulary 8192 (a language model, its
head tied to the embedding). For the full transition generator and each ``--ranks`` r, one decode step of the
whole model (``model.step``, no grad, fp32, random weights) is timed at each batch size, as built and after
``model.for_serving()``, and for the full generator also served under batch invariance (built and run under
``cpu_decode.set_row_invariant(True)``, as the server's engine thread runs it: every product on panels) and served
with MKL's products instead of the streaming kernel (model/ops/cpu/cpu_decode.py; built and run inside
``torch_products()``: what the server ran before the kernel), and set against two floors measured in the same run:

- bandwidth floor (batch 1): the weight bytes (every parameter once, fp32) / the copy bandwidth, the bytes per second
  that ``copy_`` of a 256 MiB tensor moves, read and write (as STREAM and benchmarks/comparisons/peers.py count;
  counted as bytes read, the floor doubles); at batch 1 also the read floor, the weight bytes at the rate ``sum``
  reads a 256 MiB tensor (a decode step only reads its weights; on some hosts a read stream is slower than the copy's
  rate counted both ways);
- FLOP floor (batch 32): 2 x parameters x batch FLOPs / the rate of one 2048 x 2048 x 2048 fp32 matmul.

Times are the CPU time of the calling thread (``time.thread_time``; torch runs on that one thread), not wall time:
on a 2-core machine that other jobs share, a process waits for a core for a large and varying part of the wall
time, which CPU time leaves out (what other jobs do to the memory bandwidth stays in). Efficiency = floor / step
time (100% = at the floor). In each of ``--repeats`` rounds the floors and every model are measured back to back
(``--steps`` steps each, their mean), and the efficiency is taken within the round; the tables show medians over
rounds and the spread. A model's prefill of 256 tokens (one parallel pass) is timed too, to show what
``for_serving``'s weight layout does to the parallel pass.

``--stochastic`` adds the full generator with stochastic transitions (``transition_norm`` "stochastic": column
sparsemax, no B u), served (its layer step compiled: ``lrnn_layer_step``) and with MKL's products (the torch step).

``--layouts`` measures instead how fast a one-token product (a (1, in) row) reads each weight shape of the size-L
step: MKL's (``F.linear``) with the weight stored (out, in), as ``nn.Linear`` stores it, and (in, out), as
``for_serving`` stores the wide ones for MKL, and the streaming kernel's (``model.ops.cpu.cpu_decode.linear``, (out,
in)), beside a copy and a sum of 256 MiB (GB/s read; 64 MiB of copies of each weight cycled, so none is in a cache;
thread CPU time, median of the rounds).

``--packing`` times the products of the step's large weights (and the size-s head) at 1-2,048 rows: ``F.linear``
against the weight's oneDNN pack (model/ops/prepacked.py, what served models use beyond the kernel's 4 rows) and,
at 1-4 rows, the streaming kernel.

    python -m benchmarks.models.bench_lrnn_step [--ranks 32,64,128] [--batches 1,32] [--threads 1] [--repeats 5]
        [--steps 10] [--stochastic] [--layouts | --packing]

On a CPU that other processes share, use --threads 1 (benchmarks/models/bench_decode.py says why).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.isolated import banner
from model.base import parameter_count
from model.config import LRNNConfig
from model.lrnn.model import BlockDiagonalLRNN
from model.ops import prepacked
from model.ops.cpu import cpu_decode

SIZE_L = {"vocab_size": 8192, "d_model": 512, "n_layers": 8, "num_blocks": 64, "block_size": 8, "d_ff": 2048}
COPY_ELEMENTS, MATMUL_SIZE, PREFILL = 64 * 2**20, 2048, 256
WEIGHT_SHAPES = {  # (out, in) of the size-L step's matrices
    "g (full generator)": (4096, 512),
    "g and B side by side": (4608, 512),
    "B, readout (square)": (512, 512),
    "MLP first layer": (2048, 512),
    "MLP second layer": (512, 2048),
    "tied head": (8192, 512),
    "rank-64 V": (4096, 64),
    "rank-64 [U; B]": (576, 512),
}
CYCLED_BYTES = 64 * 2**20
PACKED_SHAPES = ("g and B side by side", "B, readout (square)", "MLP first layer", "MLP second layer", "tied head")
PACKED_ROWS = (1, 4, 8, 32, 256, 2048)


def seconds(call: Callable[[], object], runs: int) -> float:
    """Mean CPU seconds of this thread over ``runs`` calls, after one untimed call."""
    call()
    start = time.thread_time()
    for _ in range(runs):
        call()
    return (time.thread_time() - start) / runs


def floors_once() -> dict[str, float]:
    """The copy bandwidth (bytes moved per second, read and write), the read rate (a sum's bytes per second) and the
    matmul rate (FLOP/s), one each."""
    source = torch.randn(COPY_ELEMENTS)
    target = torch.empty_like(source)
    a, b = torch.randn(MATMUL_SIZE, MATMUL_SIZE), torch.randn(MATMUL_SIZE, MATMUL_SIZE)
    return {
        "copy_bytes_per_s": 2 * source.numel() * source.element_size() / seconds(lambda: target.copy_(source), 5),
        "read_bytes_per_s": source.numel() * source.element_size() / seconds(source.sum, 5),
        "matmul_flops_per_s": 2 * MATMUL_SIZE**3 / seconds(lambda: a @ b, 3),
    }


MKL = "served, MKL products"  # the suffix of the variant built and run inside cpu_decode.torch_products()
INVARIANT = "served, batch-invariant"  # built and run under cpu_decode.set_row_invariant(True): the server's path


def models(ranks: list[int], stochastic: bool) -> dict[str, BlockDiagonalLRNN]:
    """Size L with each generator, as built ("name") and after ``for_serving`` ("name, served"); the full one also
    served under batch invariance ("full, served, batch-invariant") and with MKL's products ("full, served, MKL
    products"). With ``stochastic``, the full generator with stochastic transitions too ("stochastic", served,
    batch-invariant and with MKL's products: the torch step)."""
    built = {}
    for rank in [None, *ranks, *(["stochastic"] if stochastic else [])]:
        torch.manual_seed(0)
        name = "full" if rank is None else rank if rank == "stochastic" else f"rank {rank}"
        # the full generator without naming the field, so that --ranks "" also runs on a checkout from before it
        if rank is None:
            config = LRNNConfig(**SIZE_L)
        elif rank == "stochastic":
            config = LRNNConfig(**SIZE_L, transition_norm="stochastic")
        else:
            config = LRNNConfig(**SIZE_L, transition_rank=rank)
        built[name] = BlockDiagonalLRNN(config).eval()
        for variant in ("served", INVARIANT, MKL) if rank in (None, "stochastic") else ("served",):
            served = copy.deepcopy(built[name])
            with products(variant):
                served.for_serving()
            built[f"{name}, {variant}"] = served
    return built


def products(name: str) -> contextlib.AbstractContextManager:
    """Where ``name``'s model runs: inside ``torch_products()`` for the MKL variant, under batch invariance (panels
    at every row count, as the server's engine thread sets it) for the invariant one, else the default policy."""
    if name.endswith(MKL):
        return cpu_decode.torch_products()
    return cpu_decode.row_invariance() if name.endswith(INVARIANT) else contextlib.nullcontext()


def step_seconds(model: BlockDiagonalLRNN, batch: int, steps: int) -> float:
    cache = model.new_cache(batch)
    tokens = torch.randint(0, model.config.vocab_size, (batch,))
    return seconds(lambda: model.step(tokens, cache), steps)


def prefill_seconds(model: BlockDiagonalLRNN) -> float:
    tokens = torch.randint(0, model.config.vocab_size, (1, PREFILL))
    return seconds(lambda: model(tokens, cache=model.new_cache(1)), 1)


def read_rate(weights: list[torch.Tensor], product: Callable[..., torch.Tensor]) -> float:
    """Bytes per second that one-token products read, one weight after the other, each three times round."""
    row = torch.randn(1, weights[0].shape[1])  # (1, in)
    order = iter(weights * 4)
    return weights[0].numel() * 4 / seconds(lambda: product(row, next(order)), 3 * len(weights))


def layouts(repeats: int) -> str:
    """The ``--layouts`` table: GB/s read by a one-token product per weight shape and layout."""
    rates: dict[tuple[str, str], list[float]] = {}
    source = torch.randn(COPY_ELEMENTS)
    target = torch.empty_like(source)
    for _ in range(repeats):
        rates.setdefault(("copy of 256 MiB", "read"), []).append(
            source.numel() * 4 / seconds(lambda: target.copy_(source), 3)
        )
        rates.setdefault(("sum of 256 MiB", "read"), []).append(source.numel() * 4 / seconds(source.sum, 3))
        for name, (rows, columns) in WEIGHT_SHAPES.items():
            count = max(4, CYCLED_BYTES // (rows * columns * 4))
            stored = [torch.randn(rows, columns) for _ in range(count)]  # (out, in), as nn.Linear holds them
            transposed = [weight.t().contiguous().t() for weight in stored]  # (in, out) in memory
            for layout, weights, product in (
                ("MKL, (out, in)", stored, torch.nn.functional.linear),
                ("MKL, (in, out)", transposed, torch.nn.functional.linear),
                ("streaming kernel, (out, in)", stored, cpu_decode.linear),
            ):
                rates.setdefault((name, layout), []).append(read_rate(weights, product))
    lines = ["| weight | (out, in) | product, layout | GB/s read |", "|---|---|---|---:|"]
    for (name, layout), values in rates.items():
        shape = WEIGHT_SHAPES.get(name, "")
        lines.append(f"| {name} | {shape} | {layout} | {statistics.median(values) / 1e9:.1f} |")
    return "\n".join(lines)


def packing(repeats: int) -> str:
    """The ``--packing`` table: ms per product of each weight shape (plus the size-s head) at each row count, by
    ``F.linear`` (MKL), by the weight's oneDNN pack (model/ops/prepacked.py) and, at 1-4 rows, by the streaming
    kernel (copies of each weight cycled, as in ``--layouts``; thread CPU time, median of the rounds)."""
    shapes = {**{name: WEIGHT_SHAPES[name] for name in PACKED_SHAPES}, "size-s head": (8192, 128)}
    times: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(repeats):
        for name, (out, width) in shapes.items():
            weights = [torch.randn(out, width) for _ in range(max(4, CYCLED_BYTES // (out * width * 4)))]
            for weight in weights:
                prepacked.prepack(weight)
            for rows in PACKED_ROWS:
                x, order = torch.randn(rows, width), itertools.cycle(weights)
                runs = max(1, min(3 * len(weights), 2**14 // rows))
                products = {"F.linear": F.linear, "oneDNN pack": lambda x, w: prepacked.product(x, w, None)}
                if rows <= cpu_decode.MAX_ROWS:
                    products["streaming kernel"] = cpu_decode.linear
                for product_name, product in products.items():
                    elapsed = seconds(lambda product=product, x=x, order=order: product(x, next(order)), runs)
                    times.setdefault((name, rows, product_name), []).append(elapsed)
    lines = ["| weight | (out, in) | rows | product | ms | vs F.linear |", "|---|---|---:|---|---:|---:|"]
    for (name, rows, product_name), values in times.items():
        baseline = statistics.median(times[name, rows, "F.linear"])
        median = statistics.median(values)
        lines.append(
            f"| {name} | {shapes[name]} | {rows} | {product_name} | {median * 1e3:.3f} | {baseline / median:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="32,64,128", help="low ranks to compare with the full generator")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layouts", action="store_true", help="one-token product read rates by weight layout")
    parser.add_argument("--packing", action="store_true", help="products by rows: F.linear, oneDNN pack, kernel")
    parser.add_argument("--stochastic", action="store_true", help="also the full generator, stochastic transitions")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.layouts or args.packing:
        print(banner(torch.device("cpu"), args.threads))
        with torch.no_grad():
            print(layouts(args.repeats) if args.layouts else packing(args.repeats))
        return
    ranks = [int(rank) for rank in args.ranks.split(",") if rank]
    batches = [int(batch) for batch in args.batches.split(",")]
    built = models(ranks, args.stochastic)
    rounds: list[dict] = []
    with torch.no_grad():
        for _ in range(args.repeats):
            cells = floors_once()
            for name, model in built.items():
                with products(name):
                    for batch in batches:
                        cells[name, batch] = step_seconds(model, batch, args.steps)
                    cells[name, "prefill"] = prefill_seconds(model)
            rounds.append(cells)

    print(banner(torch.device("cpu"), args.threads))
    print(report(built, batches, rounds, args.steps))


def floor_seconds(parameters: int, batch: int, cells: dict) -> float:
    """The floor of one step in one round: weight bytes / copy bandwidth at batch 1, else 2 P B / matmul rate."""
    if batch == 1:
        return parameters * 4 / cells["copy_bytes_per_s"]
    return 2 * parameters * batch / cells["matmul_flops_per_s"]


def report(built: dict[str, BlockDiagonalLRNN], batches: list[int], rounds: list[dict], steps: int) -> str:
    """The Markdown tables: medians over rounds, spreads as min-max."""

    def summary(values: list[float], scale: float, digits: int) -> tuple[str, str]:
        scaled = [value * scale for value in values]
        return f"{statistics.median(scaled):.{digits}f}", f"{min(scaled):.{digits}f}-{max(scaled):.{digits}f}"

    bandwidth = summary([cells["copy_bytes_per_s"] for cells in rounds], 1e-9, 1)
    read = summary([cells["read_bytes_per_s"] for cells in rounds], 1e-9, 1)
    rate = summary([cells["matmul_flops_per_s"] for cells in rounds], 1e-9, 1)
    heading = (
        f"size L {SIZE_L}; {len(rounds)} rounds of {steps} steps; thread CPU time; copy bandwidth {bandwidth[0]} GB/s "
        f"read + write ({bandwidth[1]}), read (a sum) {read[0]} GB/s ({read[1]}), matmul {rate[0]} GFLOP/s ({rate[1]})"
    )
    lines = [
        heading,
        "",
        (
            "| generator | parameters | batch | step (ms) | spread (ms) | floor (ms) | of the floor (spread) "
            "| of the read floor (spread) |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, model in built.items():
        parameters = parameter_count(model)
        for batch in batches:
            step = summary([cells[name, batch] for cells in rounds], 1e3, 2)
            floors = [floor_seconds(parameters, batch, cells) for cells in rounds]
            share = summary([floor / cells[name, batch] for floor, cells in zip(floors, rounds, strict=True)], 100, 0)
            kind = "bandwidth" if batch == 1 else "FLOP"
            read_share = "-"
            if batch == 1:  # the weights' bytes at the rate a sum reads them
                shares = summary(
                    [parameters * 4 / cells["read_bytes_per_s"] / cells[name, 1] for cells in rounds], 100, 0
                )
                read_share = f"{shares[0]}% ({shares[1]})"
            lines.append(
                f"| {name} | {parameters / 1e6:.1f} M | {batch} | {step[0]} | {step[1]} "
                f"| {statistics.median(floors) * 1e3:.2f} ({kind}) | {share[0]}% ({share[1]}) | {read_share} |"
            )
    lines += ["", f"| generator | prefill of {PREFILL} tokens (ms) | spread (ms) |", "|---|---:|---:|"]
    for name in built:
        prefill = summary([cells[name, "prefill"] for cells in rounds], 1e3, 1)
        lines.append(f"| {name} | {prefill[0]} | {prefill[1]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
