"""Figure (a): RegularGPT forward time and peak memory, fast against reference Sliding-Dilated-Attention.

Whole-model forward passes (no grad, fp32, batch 1) of one realistic small RegularGPT with
``attention_impl="reference"`` (the T x T mask) and ``"fast"`` (the C gathered keys per position), plus the
shrinking ``final_logits`` path (fast), at each length. Every measurement runs in a fresh subprocess
(benchmarks/isolated.py: per-child peak memory, a 12 GiB address-space limit on the CPU so a reference pass
that does not fit reads "OOM"). Times are
the best of up to five timed runs (fewer once they pass 15 s) after one warm-up run: the best, because on a
shared machine the others measure the neighbours.

    python -m benchmarks.ops.bench_dilated_attention [--lengths 512,4096,32768] [--device cpu] [--quick]

``--crossover`` times instead the op alone, each implementation at each length T and reach J (chunk_size = J,
dilation 1: every query but the first J - 1 has J keys; H = 4, hd = 32, the text model's heads), forward only
(inference) and forward + backward (training, B = max(1, 4096 // T)), and the cached path's two ways for a chunk of
n new positions after a long context (``attend_gathered`` on the gathered keys against ``attend_banded`` on the
ring's last (J - 1) * dilation keys and the chunk, at dilation 1 and 64): the figures behind ``resolve_impl``'s
and ``cached_attention_impl``'s thresholds (model/ops/attention/dispatch.py). Times are CPU seconds of this
thread (time.thread_time), best of five, so that a busy machine disturbs them less.

    python -m benchmarks.ops.bench_dilated_attention --crossover [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict

import torch

from benchmarks.isolated import MEMORY_LIMIT_BYTES, banner, child_main, run_isolated, time_calls
from model.config import RegularGPTConfig
from model.device import resolve_device
from model.ops.attention.banded import attend_banded
from model.ops.attention.dispatch import IMPLEMENTATIONS
from model.ops.attention.gathered import attend_gathered
from model.regulargpt.cache import adaptive_depth
from model.regulargpt.model import RegularGPT

CONFIG = RegularGPTConfig(vocab_size=256, d_model=128, n_heads=4, d_ff=512, chunk_size=2, thickness=1)
QUICK_CONFIG = RegularGPTConfig(vocab_size=16, d_model=16, n_heads=2, d_ff=32, chunk_size=2, thickness=1)
TIMED_RUNS, TIME_BUDGET_S = 5, 15.0
MODULE = "benchmarks.ops.bench_dilated_attention"


def measure(spec: dict) -> dict:
    """In the child: time one path of one implementation at one length (best of the timed runs)."""
    device = resolve_device(spec["device"])
    config = RegularGPTConfig(**{**spec["config"], "attention_impl": spec["impl"]})
    model = RegularGPT(config).to(device).eval()
    tokens = torch.randint(0, config.vocab_size, (1, spec["length"]), device=device)
    run = model.final_logits if spec["path"] == "final_logits" else model
    times, _ = time_calls(lambda: run(tokens), device, TIMED_RUNS, TIME_BUDGET_S)
    return {"seconds": min(times)}


def cell(result: dict, key: str) -> str:
    if result["oom"]:
        return "OOM"
    if key == "seconds":
        return f"{result['seconds']:.3f}"
    return f"{result['peak_bytes'] / 2**20:.0f}"


CROSSOVER_LENGTHS = (16, 32, 64, 128, 256, 1024, 4096)
CROSSOVER_SLOTS = (2, 4, 8, 16, 64)
CROSSOVER_CHUNKS = (2, 8, 16, 32, 64, 128, 512, 2048)
HEADS, HEAD_DIM = 4, 32


def cpu_ms(call, repeats: int = 5) -> float:
    """Best CPU milliseconds of this thread over ``repeats`` calls, after one warm-up call."""
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        call()
        best = min(best, time.thread_time() - start)
    return 1e3 * best


def op_ms(impl: str, length: int, slots: int, train: bool) -> float:
    """One implementation of the op at T = length, C = J = slots, dilation 1."""
    batch = max(1, 4096 // length) if train else 1
    q, k, v = (torch.randn(batch, HEADS, length, HEAD_DIM, requires_grad=train) for _ in range(3))
    relative_bias = torch.randn(HEADS, slots, requires_grad=train)

    def call() -> None:
        out = IMPLEMENTATIONS[impl](q, k, v, relative_bias, slots, 1)
        if train:
            out.sum().backward()

    with torch.set_grad_enabled(train):
        return cpu_ms(call)


def cached_ms(way: str, length: int, slots: int, dilation: int = 1) -> float:
    """A cached chunk of ``length`` new positions reaching J = C = ``slots`` keys at ``dilation``, batch 1, after a
    long context: gathered (J keys per query copied, then attend_gathered) or banded (the (J - 1) * dilation keys
    before the chunk and the chunk, attend_banded)."""
    before = (slots - 1) * dilation
    q = torch.randn(1, HEADS, length, HEAD_DIM)
    k, v = (torch.randn(1, HEADS, before + length, HEAD_DIM) for _ in range(2))
    relative_bias = torch.randn(HEADS, slots)
    if way == "banded":
        return cpu_ms(lambda: attend_banded(q, k, v, relative_bias, slots, dilation))
    index = (before + torch.arange(length)[:, None] - dilation * torch.arange(slots)).flatten()  # (n * J,)

    def gathered() -> None:
        keys = k.index_select(2, index).view(1, HEADS, length, slots, HEAD_DIM)
        values = v.index_select(2, index).view(1, HEADS, length, slots, HEAD_DIM)
        attend_gathered(q, keys, values, relative_bias, None)

    return cpu_ms(gathered)


def print_table(title: str, row_name: str, rows: tuple[int, ...], cell) -> None:
    """A markdown table: one row per value of ``rows``, one column per reach J, ``cell(row, J)`` in each."""
    print(f"\n{title}\n")
    print(f"| {row_name} | " + " | ".join(f"J={slots}" for slots in CROSSOVER_SLOTS) + " |")
    print("|---:|" + "---|" * len(CROSSOVER_SLOTS))
    for row in rows:
        print(f"| {row} | " + " | ".join(cell(row, slots) for slots in CROSSOVER_SLOTS) + " |", flush=True)


def crossover() -> None:
    """The tables behind the ``auto`` and cached-chunk policies (module docstring)."""
    impls = ("reference", "fast", "banded")

    def inference(length: int, slots: int) -> str:
        return " / ".join(
            "-" if impl == "reference" and length > 1024 else f"{op_ms(impl, length, slots, False):.2f}"
            for impl in impls
        )

    with torch.no_grad():
        title = "op, forward (inference), batch 1, ms: reference / fast / banded"
        print_table(title, "T", CROSSOVER_LENGTHS, inference)
    print_table(
        "op, forward + backward (training), batch max(1, 4096 // T), ms: reference / fast / banded",
        "T",
        CROSSOVER_LENGTHS[:-1],
        lambda length, slots: " / ".join(f"{op_ms(impl, length, slots, True):.2f}" for impl in impls),
    )
    with torch.no_grad():
        print_table(
            "cached chunk of n after a long context, batch 1, ms: gathered / banded",
            "n",
            CROSSOVER_CHUNKS,
            lambda length, slots: " / ".join(f"{cached_ms(way, length, slots):.2f}" for way in ("gathered", "banded")),
        )
        print_table(
            "the same at dilation 64 (the text model's second layer), (J - 1) * 64 ring keys before the chunk",
            "n",
            CROSSOVER_CHUNKS[2:],
            lambda length, slots: " / ".join(
                f"{cached_ms(way, length, slots, 64):.2f}" for way in ("gathered", "banded")
            ),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,4096,32768")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="CPU threads (1 on a machine others share)"
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model at short lengths: a smoke run")
    parser.add_argument("--crossover", action="store_true", help="the op's implementations against each other")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(measure, args.child)
        return
    if args.crossover:
        torch.set_num_threads(args.threads)
        torch.manual_seed(0)
        print(banner(torch.device("cpu"), args.threads))
        crossover()
        return
    config = QUICK_CONFIG if args.quick else CONFIG
    lengths = [64, 256] if args.quick else [int(n) for n in args.lengths.split(",")]
    device = resolve_device(args.device)
    print(banner(device, args.threads))
    print(
        f"model: RegularGPT d_model {config.d_model}, {config.n_heads} heads, d_ff {config.d_ff}, "
        f"chunk_size {config.chunk_size}, thickness {config.thickness}, vocab {config.vocab_size}; "
        f"batch 1, fp32, no grad; memory limit {MEMORY_LIMIT_BYTES / 2**30:.0f} GiB (CPU)\n"
    )
    memory = "peak RSS" if device.type == "cpu" else "peak CUDA"
    print(
        f"| T | depth | reference forward (s) | fast forward (s) | speedup | fast final_logits (s) "
        f"| reference {memory} (MiB) | fast {memory} (MiB) | final_logits {memory} (MiB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length in lengths:
        spec = {"config": asdict(config), "length": length, "device": args.device, "threads": args.threads}
        reference = run_isolated(MODULE, {**spec, "impl": "reference", "path": "forward"})
        fast = run_isolated(MODULE, {**spec, "impl": "fast", "path": "forward"})
        final = run_isolated(MODULE, {**spec, "impl": "fast", "path": "final_logits"})
        both = not (reference["oom"] or fast["oom"])
        speedup = f"{reference['seconds'] / fast['seconds']:.1f}x" if both else "-"
        print(
            f"| {length} | {adaptive_depth(length - 1, config.chunk_size)} | {cell(reference, 'seconds')} "
            f"| {cell(fast, 'seconds')} | {speedup} | {cell(final, 'seconds')} | {cell(reference, 'peak')} "
            f"| {cell(fast, 'peak')} | {cell(final, 'peak')} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
