"""Figure (c): decode-step time and cache memory against context length, with achieved GFLOP/s.

For each architecture (block-diagonal LRNN, RegularGPT, ALiBi transformer with its KV cache) a cache is
filled with a random context of each length, then single-token decode steps are timed. FLOPs per step are
counted by torch's FlopCounterMode (matmuls and attention), and achieved GFLOP/s is set against the peak of
a large fp32 matmul measured on the same machine in the same run.

    python -m benchmarks.models.bench_decode [--contexts 1024,4096,16384,65536] [--device cpu] [--steps 32]
        [--threads N]

On a CPU that other processes share, use --threads 1: a two-thread op whose second thread waits for a busy
core stalls for a whole scheduler time slice, many times a small step's own time.

``--text`` measures instead the shipped text models' shapes (checkpoints/text-regulargpt and text-lrnn, random
weights, ``for_serving()`` as the server does), all in one run: the decode step at batch 1
after 1k and 8k tokens of context, tokens/s of steps at batch 32 after 1k (one row's cache stacked 32 times: a
step's cost does not depend on the values) and prefill tokens/s of 8k tokens into an empty cache, in the server's
2048-token chunks and in one call. Every repeat measures every cell once, the models alternating; the table holds
each cell's median over the repeats. ``--clock cpu`` times with this thread's CPU time instead of the wall clock:
on a machine that other jobs keep busy it leaves out the time the thread waits for a core (not the slowdown
their use of the caches and memory causes).

With ``--compare-kernels`` every model runs twice in the same rounds: as the server runs it, and inside
``model.ops.cpu.cpu_decode.torch_products()`` (built and run there: MKL's products and the torch ops instead of the
compiled decode kernels, what the server ran before them and runs with more than one thread).

    python -m benchmarks.models.bench_decode --text [--repeats 3] [--threads 1] [--clock wall|cpu] [--compare-kernels]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.isolated import banner
from model.checkpoint import read_config
from model.config import LRNNConfig, RegularGPTConfig, TransformerConfig
from model.device import resolve_device
from model.ops.cpu import cpu_decode
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
    step_s = step_seconds(model, cache, steps, device, token)
    return {"step_ms": step_s * 1e3, "cache_kib": cache.nbytes / 2**10, "gflops": flops / step_s / 1e9}


TEXT_CHECKPOINTS = {"lrnn": "checkpoints/text-lrnn", "regulargpt": "checkpoints/text-regulargpt"}
TEXT_SHORT, TEXT_LONG, TEXT_BATCH, TEXT_PREFILL, SERVER_PREFILL_CHUNK = 1024, 8192, 32, 8192, 2048


def text_model(architecture: str, device: torch.device):
    """The shipped text model's shape with random weights, switched to what the server runs (``for_serving``)."""
    config = read_config(TEXT_CHECKPOINTS[architecture]).model
    model = build_model(architecture, config).to(device).eval()
    model.for_serving()
    return model


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
TORCH_PRODUCTS = ", torch products"  # the suffix of the models built and run inside cpu_decode.torch_products()


def prefill_seconds(model, tokens: torch.Tensor, chunk: int, device: torch.device, clock=time.perf_counter):
    """Seconds to prefill ``tokens`` (B, T) into an empty cache in chunks of ``chunk``, and the cache."""
    synchronize(device)
    start = clock()
    cache = model.new_cache(tokens.shape[0])
    for first in range(0, tokens.shape[1], chunk):
        model(tokens[:, first : first + chunk], cache=cache)
    synchronize(device)
    return clock() - start, cache


def step_seconds(
    model, cache, steps: int, device: torch.device, tokens: torch.Tensor | None = None, clock=time.perf_counter
) -> float:
    """Median seconds of ``steps`` decode steps of ``tokens`` (default random) on ``cache``."""
    if tokens is None:
        tokens = torch.randint(0, model.config.vocab_size, (cache.batch_size,), device=device)
    times = []
    for _ in range(steps):
        synchronize(device)
        start = clock()
        model.step(tokens, cache)
        synchronize(device)
        times.append(clock() - start)
    return statistics.median(times)


def text_cells(model, device: torch.device, steps: int, clock) -> dict[str, float]:
    """One repeat of every ``--text`` measurement of one model (each timed step after an untimed one)."""
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (1, TEXT_LONG), device=device)
    cells = {}
    chunked, cache = prefill_seconds(model, tokens[:, :TEXT_PREFILL], SERVER_PREFILL_CHUNK, device, clock)
    cells["prefill_chunked"] = TEXT_PREFILL / chunked
    one_call, _ = prefill_seconds(model, tokens[:, :TEXT_PREFILL], TEXT_PREFILL, device, clock)
    cells["prefill_one_call"] = TEXT_PREFILL / one_call
    step_seconds(model, cache, 1, device)  # a context of C**L tokens makes RegularGPT's next step grow its depth
    cells["step_long_ms"] = 1e3 * step_seconds(model, cache, steps, device, clock=clock)
    _, short = prefill_seconds(model, tokens[:, :TEXT_SHORT], SERVER_PREFILL_CHUNK, device)
    batch = type(short).stack([short] * TEXT_BATCH)
    step_seconds(model, short, 1, device)
    cells["step_short_ms"] = 1e3 * step_seconds(model, short, steps, device, clock=clock)
    step_seconds(model, batch, 1, device)
    cells["batch_tokens_per_s"] = TEXT_BATCH / step_seconds(model, batch, max(4, steps // 4), device, clock=clock)
    return cells


def text_main(device: torch.device, repeats: int, steps: int, clock, compare_kernels: bool = False) -> None:
    """The ``--text`` table: RegularGPT s against LRNN s, every cell the median of ``repeats``; with
    ``compare_kernels`` also each model built and run inside ``torch_products()`` ("name, torch products")."""
    variants = [("", contextlib.nullcontext)]
    if compare_kernels:
        variants.append((TORCH_PRODUCTS, cpu_decode.torch_products))
    models = {}
    for name in TEXT_CHECKPOINTS:
        for suffix, products in variants:
            with products():
                models[name + suffix] = (text_model(name, device), products)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in models}
    with torch.inference_mode():
        for _ in range(repeats):
            for name, (model, products) in models.items():
                with products():
                    runs[name].append(text_cells(model, device, steps, clock))
    median = {
        name: {key: statistics.median(run[key] for run in cells) for key in cells[0]} for name, cells in runs.items()
    }
    print(
        f"| model | step b1 @{TEXT_SHORT} (ms) | step b1 @{TEXT_LONG} (ms) | b{TEXT_BATCH} @{TEXT_SHORT} (tok/s) "
        f"| prefill {TEXT_PREFILL} in {SERVER_PREFILL_CHUNK}-token chunks (tok/s) | prefill {TEXT_PREFILL} in one call "
        "(tok/s) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, cells in median.items():
        print(
            f"| {name.replace(',', ' s,', 1) if ',' in name else name + ' s'} | {cells['step_short_ms']:.2f} | {cells['step_long_ms']:.2f} "
            f"| {cells['batch_tokens_per_s']:,.0f} | {cells['prefill_chunked']:,.0f} "
            f"| {cells['prefill_one_call']:,.0f} |"
        )
    for suffix in ("", TORCH_PRODUCTS) if compare_kernels else ("",):
        text_ratios(median["regulargpt" + suffix], median["lrnn" + suffix], repeats, suffix)


def text_ratios(ours: dict[str, float], base: dict[str, float], repeats: int, suffix: str) -> None:
    """The line of the two RegularGPT s targets of docs/benchmarks.md (decode step, prefill against GPT-2 s)."""
    print(
        f"\nRegularGPT s / LRNN s{suffix} decode step at batch 1: {ours['step_short_ms'] / base['step_short_ms']:.2f}x "
        f"@{TEXT_SHORT}, {ours['step_long_ms'] / base['step_long_ms']:.2f}x @{TEXT_LONG} (target <= 2x); "
        f"RegularGPT s prefill of {TEXT_PREFILL} (chunked) / GPT-2 s's 7.3k tok/s (a fixed figure): "
        f"{ours['prefill_chunked'] / 7300:.0%} (target >= 50%); repeats {repeats}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="1024,4096,16384,65536")
    parser.add_argument("--architectures", default=",".join(CONFIGS))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--text", action="store_true", help="the text models' shapes (see above)")
    parser.add_argument("--repeats", type=int, default=3, help="--text: repeats of every cell (the median is kept)")
    parser.add_argument("--clock", choices=CLOCKS, default="wall", help="--text: wall clock or this thread's CPU time")
    parser.add_argument(
        "--compare-kernels", action="store_true", help="--text: also every model inside torch_products() (see above)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    torch.manual_seed(0)
    if args.text:
        print(f"{banner(device, args.threads)}, clock {args.clock}")
        text_main(device, args.repeats, args.steps, CLOCKS[args.clock], args.compare_kernels)
        return
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
