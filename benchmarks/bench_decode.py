"""Figure (c): decode-step time and cache memory against context length, with achieved GFLOP/s.

For each architecture (block-diagonal LRNN, RegularGPT, ALiBi transformer with its KV cache) a cache is
filled with a random context of each length, then single-token decode steps are timed. FLOPs per step are
counted by torch's FlopCounterMode (matmuls and attention), and achieved GFLOP/s is set against the peak of
a large fp32 matmul measured on the same machine in the same run.

    python -m benchmarks.bench_decode [--contexts 1024,4096,16384,65536] [--device cpu] [--steps 32] [--threads N]

On a CPU that other processes share, use --threads 1: a two-thread op whose second thread waits for a busy
core stalls for a scheduler time slice, which turns an 8 ms LRNN step into 250 ms (seen here).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.isolated import banner
from model.config import LRNNConfig, RegularGPTConfig, TransformerConfig
from model.device import resolve_device
from model.registry import build_model

VOCAB = 8192
PREFILL_CHUNK = 1024

CONFIGS = {
    "lrnn": LRNNConfig(vocab_size=VOCAB, d_model=256, n_layers=4, block_size=8, num_blocks=8, d_ff=1024),
    "regulargpt": RegularGPTConfig(vocab_size=VOCAB, d_model=256, n_heads=4, d_ff=1024, chunk_size=2, thickness=2),
    "transformer": TransformerConfig(vocab_size=VOCAB, d_model=256, n_layers=4, n_heads=4, d_ff=1024),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak_gflops(device: torch.device, size: int = 2048, repeats: int = 10) -> float:
    """Best GFLOP/s of a size x size fp32 matmul: the machine's practical peak."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def fill_cache(model, context: int, device: torch.device):
    """A cache holding ``context`` random tokens, filled in chunks (one pass for RegularGPT, which
    prefills an empty cache from its parallel pass)."""
    cache = model.new_cache(batch_size=1)
    tokens = torch.randint(0, VOCAB, (1, context), device=device)
    chunk = context if isinstance(model.config, RegularGPTConfig) else PREFILL_CHUNK
    for start in range(0, context, chunk):
        model(tokens[:, start : start + chunk], cache=cache)
    return cache


def measure(model, context: int, steps: int, device: torch.device) -> dict[str, float]:
    cache = fill_cache(model, context, device)
    token = torch.randint(0, VOCAB, (1,), device=device)
    model.step(token, cache)  # a context of C**L tokens makes RegularGPT's next step grow its depth once
    flops_cache = cache.clone()
    with FlopCounterMode(display=False) as counter:
        model.step(token, flops_cache)
    flops = counter.get_total_flops()
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        model.step(token, cache)
        synchronize(device)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    return {"step_ms": step_s * 1e3, "cache_kib": cache.nbytes / 2**10, "gflops": flops / step_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096,16384,65536")
    parser.add_argument("--architectures", default=",".join(CONFIGS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    torch.manual_seed(0)
    peak = matmul_peak_gflops(device)
    print(banner(device, args.threads))
    print(f"large-matmul peak (2048^3 fp32): {peak:.1f} GFLOP/s\n")
    print("| architecture | context | step (ms) | cache (KiB) | GFLOP/s | % of matmul peak |")
    print("|---|---:|---:|---:|---:|---:|")
    for architecture in args.architectures.split(","):
        model = build_model(architecture, CONFIGS[architecture]).to(device).eval()
        for context in (int(c) for c in args.contexts.split(",")):
            with torch.no_grad():
                result = measure(model, context, args.steps, device)
            print(
                f"| {architecture} | {context} | {result['step_ms']:.2f} | {result['cache_kib']:.1f} "
                f"| {result['gflops']:.2f} | {100 * result['gflops'] / peak:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
