"""/v1/transduce: latency and throughput at concurrency 1, 8 and 32, with dynamic batching and with batch-1
serving; and the HTTP + server overhead over the model call (timed inside the server) for one request of 8
inputs, beside the round trip of ``GET /health`` through the same kind of client: what any request pays before the
server does anything for it, so the least overhead a transduce could have.

    python -m benchmarks.serve.api.bench_transduce [--lengths 500,50] [--requests 64] [--threads 1]

Each request carries one random input of the given length (a second table: 8 inputs, concurrency 1).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.serve.harness import (
    TRANSDUCERS,
    add_server_arguments,
    histogram_totals,
    machine,
    ms,
    run_load,
    server_process,
    write_models,
)

CONCURRENCIES = (1, 8, 32)
BATCH_1 = {"max_batch_size": 1, "batch_wait_ms": 0}
EXECUTE_TIME = "regularlm_model_execute_time_seconds"


def inputs(count: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice("01") for _ in range(length)) for _ in range(count)]


def load_table(url: str, model_id: str, length: int, requests: int, label: str, concurrencies) -> list[float]:
    """Rows of the latency/throughput table; returns the throughput (inputs/s) per concurrency."""
    throughputs = []
    for concurrency in concurrencies:
        bodies = [{"model": model_id, "inputs": [text]} for text in inputs(requests, length, seed=concurrency)]
        run_load(url, "/v1/transduce", bodies[: 2 * concurrency], concurrency)  # warm-up
        records, wall = run_load(url, "/v1/transduce", bodies, concurrency)
        e2el = [record.e2el for record in records]
        throughputs.append(requests / wall)
        print(
            f"| {model_id} | {length} | {label} | {concurrency} | {ms(e2el, 50)} | {ms(e2el, 99)} "
            f"| {requests / wall:.1f} | {requests * length / wall:,.0f} |",
            flush=True,
        )
    return throughputs


def overhead(url: str, model_id: str, batch: list[str], repeats: int) -> tuple[float, float, float]:
    """Mean E2EL of one request of ``batch`` at concurrency 1 and the mean time the server spent in model calls
    for it (``regularlm_model_execute_time_seconds``), both in seconds, and the model calls per request: a long
    input runs in slices of ``slice_ms`` of work, each a call, so one request may take several."""
    run_load(url, "/v1/transduce", [{"model": model_id, "inputs": batch}] * 2, 1)  # warm-up
    before = histogram_totals(url, EXECUTE_TIME, model_id)
    records, _ = run_load(url, "/v1/transduce", [{"model": model_id, "inputs": batch}] * repeats, 1)
    after = histogram_totals(url, EXECUTE_TIME, model_id)
    calls = after[1] - before[1]
    assert calls >= repeats, f"expected at least one model call per request, saw {calls} for {repeats}"
    return sum(record.e2el for record in records) / repeats, (after[0] - before[0]) / repeats, calls / repeats


def health_round_trip(url: str, repeats: int) -> float:
    """Mean seconds of ``GET /health`` over one connection, one request at a time, as :func:`run_load`'s clients
    send theirs."""

    async def main() -> float:
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=1)) as client:
            for _ in range(2):  # warm-up: the connection
                (await client.get("/health")).raise_for_status()
            start = time.perf_counter()
            for _ in range(repeats):
                (await client.get("/health")).raise_for_status()
            return (time.perf_counter() - start) / repeats

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="500,50")
    parser.add_argument("--requests", type=int, default=64)
    add_server_arguments(parser)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    lengths = [int(length) for length in args.lengths.split(",")]
    print(f"machine: {machine(args.device)}; server torch threads: {args.threads}\n")
    with tempfile.TemporaryDirectory() as folder:
        models = write_models(Path(folder))
        print("| model | T | serving | concurrency | E2EL p50 (ms) | E2EL p99 (ms) | inputs/s | symbols/s |")
        print("|---|---:|---|---:|---:|---:|---:|---:|")
        gains = {}
        with server_process(models, args.threads, args.device) as url:
            for model_id in TRANSDUCERS:
                for length in lengths:
                    gains[model_id, length] = load_table(
                        url, model_id, length, args.requests, "batched", CONCURRENCIES
                    )[-1]
            batch = inputs(8, lengths[0], seed=99)
            overheads = {model_id: overhead(url, model_id, batch, args.repeats) for model_id in TRANSDUCERS}
            floor = health_round_trip(url, args.repeats)
        with server_process(models, args.threads, args.device, **BATCH_1) as url:
            for model_id in TRANSDUCERS:
                for length in lengths:
                    batch_1 = load_table(url, model_id, length, args.requests, "batch-1", CONCURRENCIES[-1:])[-1]
                    gains[model_id, length] /= batch_1
        print("\nThroughput at concurrency 32, batched over batch-1 serving:\n")
        print("| model | T | gain |\n|---|---:|---:|")
        for (model_id, length), gain in gains.items():
            print(f"| {model_id} | {length} | {gain:.2f}x |")
        print(f"\nOne request of 8 inputs of T={lengths[0]}, concurrency 1, mean of {args.repeats}:\n")
        print(
            "| model | model calls in the server (ms) | calls | HTTP E2EL (ms) | HTTP + server overhead "
            "| GET /health (ms) | its share of the model calls |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for model_id, (e2el, model_s, calls) in overheads.items():
            print(
                f"| {model_id} | {1e3 * model_s:.1f} | {calls:.0f} | {1e3 * e2el:.1f} "
                f"| {100 * (e2el - model_s) / model_s:.1f}% | {1e3 * floor:.2f} | {100 * floor / model_s:.1f}% |"
            )


if __name__ == "__main__":
    main()
