"""Figure (a): RegularGPT forward time and peak memory, fast against reference Sliding-Dilated-Attention.

Whole-model forward passes (no grad, fp32, batch 1) of one realistic small RegularGPT with
``attention_impl="reference"`` (the T x T mask) and ``"fast"`` (the C gathered keys per position), plus the
shrinking ``final_logits`` path (fast), at each length. Every measurement runs in a fresh subprocess
(benchmarks/isolated.py: per-child peak memory, a 12 GiB address-space limit on the CPU so a reference pass
that does not fit reads "OOM"). Times are
the best of up to five timed runs (fewer once they pass 15 s) after one warm-up run: the best, because on a
shared machine the others measure the neighbours.

    python -m benchmarks.bench_dilated_attention [--lengths 512,4096,32768] [--device cpu] [--quick]
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

import torch

from benchmarks.isolated import MEMORY_LIMIT_BYTES, banner, child_main, run_isolated, time_calls
from model.config import RegularGPTConfig
from model.device import resolve_device
from model.regulargpt import RegularGPT, adaptive_depth

CONFIG = RegularGPTConfig(vocab_size=256, d_model=128, n_heads=4, d_ff=512, chunk_size=2, thickness=1)
QUICK_CONFIG = RegularGPTConfig(vocab_size=16, d_model=16, n_heads=2, d_ff=32, chunk_size=2, thickness=1)
TIMED_RUNS, TIME_BUDGET_S = 5, 15.0
MODULE = "benchmarks.bench_dilated_attention"


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,4096,32768")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="CPU threads (1 on a machine others share)"
    )
    parser.add_argument("--quick", action="store_true", help="a tiny model at short lengths: a smoke run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child_main(measure, args.child)
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
