"""Figure (b): the linear scan's implementations against length and batch.

parallel, chunked and sequential everywhere; on the CPU also "compiled" (the loop compiled by numba, where numba is
installed); on CUDA also "triton" (model/ops/scan/triton.py, where Triton is installed) and, with --compile,
"compiled-parallel" and "compiled-chunked": the torch scans under ``torch.compile`` (compiled in the warm-up run,
which is not timed), what the Triton kernels must beat.

The op alone (model/ops/scan/), forward with no grad, H = 8 blocks of b = 8 as in Fan et al. 2024, fp32, at
each length T and batch B. Transitions are random blocks inside the p = 1.2 norm constraint (a 1024-step
random block tiled over T, so that building 8.6 GB of them takes seconds); subnormal floats are flushed to
zero, as long products of contracting matrices otherwise spend most of the time in subnormal arithmetic.

Every measurement runs in a fresh subprocess (benchmarks/isolated.py: per-child peak memory, a 12 GiB
address-space limit on the CPU so a case that does not fit reads "OOM").

Time is the median of up to REPEATS timed runs after one warm-up run; a case stops repeating once it has
spent TIME_BUDGET_S (the slowest cases get a single timed run, or none: then the warm-up run itself is
reported, marked "*"). The last column is what ``linear_scan(impl="auto")`` picks for that size.

    python -m benchmarks.ops.bench_linear_scan [--lengths 500,8192,65536] [--batches 1,64] [--device cpu]
        [--threads N] [--compile] [--quick] [--impls parallel,triton,...]

On a CPU that other processes share, use --threads 1: a multi-threaded op whose second thread waits for a busy
core stalls for a scheduler time slice (~8 ms), which swamps the small per-step ops of the scans.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.isolated import MEMORY_LIMIT_BYTES, banner, child_main, run_isolated, time_calls
from model.device import resolve_device
from model.ops.cpu import cpu_decode
from model.ops.scan.constraints import column_norm_constraint
from model.ops.scan.dispatch import choose_scan_impl, linear_scan
from model.ops.scan.triton import available

HEADS, BLOCK, P_NORM, TILE = 8, 8, 1.2, 1024
IMPLS = ("parallel", "chunked", "sequential")
COMPILED = ("compiled-parallel", "compiled-chunked")
REPEATS, TIME_BUDGET_S = 5, 30.0


def make_problem(batch: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Transitions (B, T, H, b, b) inside the norm constraint and inputs (B, T, H, b), fp32 on ``device``."""
    tile = min(length, TILE)
    blocks = column_norm_constraint(torch.randn(batch, tile, HEADS, BLOCK, BLOCK, device=device), P_NORM)
    transitions = blocks.repeat(1, -(-length // tile), 1, 1, 1)[:, :length]  # (B, T, H, b, b)
    return transitions, torch.randn(batch, length, HEADS, BLOCK, device=device)  # (B, T, H, b)


def measure(case: dict) -> dict:
    """In the child: time ``linear_scan`` for one case."""
    device = resolve_device(case["device"])
    torch.set_flush_denormal(True)
    transitions, inputs = make_problem(case["batch"], case["length"], device)
    impl = case["impl"].removeprefix("compiled-")
    scan = torch.compile(linear_scan) if case["impl"] in COMPILED else linear_scan
    times, warmup_only = time_calls(
        lambda: scan(transitions, inputs, impl=impl, chunk_size=case["chunk_size"]),
        device,
        REPEATS,
        TIME_BUDGET_S,
    )
    return {"seconds": statistics.median(times), "runs": 0 if warmup_only else len(times)}


def row(case: dict, result: dict) -> str:
    auto = choose_scan_impl(case["batch"], case["length"], HEADS, BLOCK, torch.device(case["device"]))
    head = f"| {case['length']} | {case['batch']} | {case['impl']} |"
    if result["oom"]:
        return f"{head} OOM | - | OOM | {auto} |"
    runs = result["runs"] or "1*"
    return f"{head} {result['seconds'] * 1000:.1f} | {runs} | {result['peak_bytes'] / 2**20:.0f} | {auto} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="500,8192,65536")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="CPU threads (1 on a machine others share)"
    )
    parser.add_argument("--compile", action="store_true", help="also time the torch scans under torch.compile")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--impls", help="comma-separated: time only these (default: every one the device has)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(measure, args.child)
        return
    lengths = [100, 300] if args.quick else [int(n) for n in args.lengths.split(",")]
    batches = [1, 4] if args.quick else [int(n) for n in args.batches.split(",")]
    device = resolve_device(args.device)
    memory = "peak RSS (MiB)" if device.type == "cpu" else "peak CUDA (MiB)"
    impls = IMPLS + (COMPILED if args.compile else ()) + (("triton",) if device.type == "cuda" and available() else ())
    impls += ("compiled",) if device.type == "cpu" and cpu_decode.kernel_available() else ()
    if args.impls:
        chosen = args.impls.split(",")
        unknown = sorted(set(chosen) - set(impls))
        if unknown:
            parser.error(f"--impls: {', '.join(unknown)} not among {', '.join(impls)} on {device} with these flags")
        impls = tuple(chosen)
    print(banner(device, args.threads))
    print(
        f"linear scan forward, no grad, fp32, H={HEADS}, b={BLOCK}, chunk_size {args.chunk_size}; median of up to "
        f"{REPEATS} runs after a warm-up, fewer past {TIME_BUDGET_S:.0f} s (* = the warm-up run alone); "
        f"memory limit {MEMORY_LIMIT_BYTES / 2**30:.0f} GiB (CPU)\n"
    )
    print(f"| T | B | impl | median (ms) | timed runs | {memory} | auto picks |")
    print("|---:|---:|---|---:|---:|---:|---|")
    for length in lengths:
        for batch in batches:
            for impl in impls:
                case = {
                    "impl": impl,
                    "batch": batch,
                    "length": length,
                    "device": str(device),
                    "chunk_size": args.chunk_size,
                    "threads": args.threads,
                }
                print(row(case, run_isolated("benchmarks.ops.bench_linear_scan", case)), flush=True)


if __name__ == "__main__":
    main()
