"""/v1/generate (streamed) on the LRNN language model at concurrency 1, 8 and 32: TTFT, TPOT, ITL, E2EL
(vLLM's definitions, harness.py) and throughput, with continuous batching and with batch-1 serving.

    python -m benchmarks.serve.bench_generate [--prompt-tokens 32] [--max-tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from benchmarks.serve.harness import (
    LANGUAGE_MODEL,
    add_server_arguments,
    machine,
    ms,
    run_load,
    server_process,
    write_models,
)

CONCURRENCIES = (1, 8, 32)
BATCH_1 = {"max_running": 1}


def bodies(count: int, prompt_tokens: int, max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [
        {
            "model": LANGUAGE_MODEL,
            "prompt": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(prompt_tokens)),
            "max_tokens": max_tokens,
            "seed": index,
            "stream": True,
        }
        for index in range(count)
    ]


def measure(url: str, label: str, concurrency: int, args: argparse.Namespace) -> float:
    """One table row; returns the output tokens per second."""
    requests = max(args.requests, 2 * concurrency)
    run_load(url, "/v1/generate", bodies(concurrency, args.prompt_tokens, 8, seed=0), concurrency)  # warm-up
    records, wall = run_load(
        url, "/v1/generate", bodies(requests, args.prompt_tokens, args.max_tokens, concurrency), concurrency
    )
    latencies = [
        [record.ttft for record in records if record.ttft is not None],
        [record.tpot for record in records if record.tpot is not None],
        [gap for record in records for gap in record.itl],
        [record.e2el for record in records],
    ]  # TTFT, TPOT, ITL, E2EL
    columns = " | ".join(f"{ms(values, 50)} / {ms(values, 99)}" for values in latencies)
    tokens_per_s = sum(record.output_tokens for record in records) / wall
    row = f"| {label} | {concurrency} | {requests} | {columns} | {tokens_per_s:.0f} | {requests / wall:.2f} |"
    print(row, flush=True)
    return tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=16, help="requests per row (at least 2 x concurrency)")
    add_server_arguments(parser)
    args = parser.parse_args()
    print(f"machine: {machine(args.device)}; server torch threads: {args.threads}")
    print(f"prompt {args.prompt_tokens} tokens, {args.max_tokens} output tokens per request\n")
    latencies = " | ".join(f"{name} p50/p99 (ms)" for name in ("TTFT", "TPOT", "ITL", "E2EL"))
    print(f"| serving | concurrency | requests | {latencies} | output tok/s | req/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        models = write_models(Path(folder))
        with server_process(models, args.threads, args.device) as url:
            batched = [measure(url, "continuous batching", concurrency, args) for concurrency in CONCURRENCIES]
        with server_process(models, args.threads, args.device, **BATCH_1) as url:
            batch_1 = measure(url, "batch-1 (max_running=1)", CONCURRENCIES[-1], args)
    print(f"\nThroughput at concurrency 32, continuous batching over batch-1 serving: {batched[-1] / batch_1:.2f}x")


if __name__ == "__main__":
    main()
