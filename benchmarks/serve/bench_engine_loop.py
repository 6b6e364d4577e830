"""The engine alone, without HTTP: generation events per second at concurrency 1 and 16 through
``Engine.submit_generation`` on one served checkpoint, in this process (no server, no load generator sharing the
cores), to tell the engine's own throughput from the HTTP side's.

    python -m benchmarks.serve.bench_engine_loop [--model checkpoints/text-lrnn] [--threads 1] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from benchmarks.serve.harness import ROOT, machine
from server.engine import Engine
from server.generation import GenerationRequest
from server.metrics import ServerMetrics
from server.model_store import ServedModel
from server.sampling import SamplingParams
from server.settings import Settings

MAX_TOKENS = 64
REQUESTS = 32  # per measurement at concurrency 16; 4 at concurrency 1


async def events_per_second(engine: Engine, served: ServedModel, concurrency: int, requests: int) -> float:
    prompt = served.tokenizer.encode("Chapter 1. It was")

    async def one(seed: int) -> int:
        sampling = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=seed)
        handle = engine.submit_generation(served, [GenerationRequest(prompt, MAX_TOKENS, sampling)])
        return sum([1 async for _ in handle.events()])

    started, events = time.perf_counter(), 0
    for first in range(0, requests, concurrency):
        events += sum(await asyncio.gather(*(one(first + i) for i in range(concurrency))))
    return events / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "text-lrnn")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    engine = Engine(Settings(models=args.model, device="cpu", torch_threads=args.threads), ServerMetrics())
    engine.start()
    engine.wait_loaded()
    served = engine.models[args.model.name]
    print(f"machine: {machine()}; torch threads: {args.threads}; {args.model.name}, {MAX_TOKENS} tokens per request")
    for _ in range(args.repeats):
        for concurrency, requests in ((1, 4), (16, REQUESTS)):
            rate = asyncio.run(events_per_second(engine, served, concurrency, requests))
            print(f"concurrency {concurrency}: {rate:.0f} events/s", flush=True)
    engine.stop()


if __name__ == "__main__":
    main()
