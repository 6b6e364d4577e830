"""The engine alone, without HTTP: generated tokens per second at concurrency 1 and 16 through
``Engine.submit_generation`` on one served checkpoint, in this process (no server, no load generator sharing the
cores), to tell the engine's own throughput from the HTTP side's.

    python -m benchmarks.serve.engine.bench_engine_loop [--model checkpoints/text-lrnn] [--threads 1] [--repeats 2]
        [--device cpu|cuda] [--concurrencies 1,16] [--max-tokens 64] [--temperature 1] [--whole] [--stub] [--profile]
        [--default-gc]

``--whole``: requests that do not stream (their events come at the end). ``--stub``: the model's decode step returns
zero logits at once, so that the rate is the engine's own per-token cost (scheduling, sampling, text, metrics,
delivery) and the consuming coroutines'.

The garbage collector is tuned as ``python -m server`` tunes it (``server/heap.py``); ``--default-gc`` keeps
CPython's defaults instead.

``--profile``: the engine's thread runs under cProfile (its rates are then the profiled ones, lower), and its 30
costliest functions (cumulative) are printed at the end, to see where an iteration's time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import time
from pathlib import Path

from benchmarks.serve.harness import ROOT, machine, stub_decode_steps
from model.cuda_graphs import Decoder
from server.engine.engine import Engine
from server.execution.generation import Finished, GenerationRequest
from server.execution.sampling import SamplingParams
from server.heap import freeze_startup_heap, tune_garbage_collector
from server.metrics import ServerMetrics
from server.models.store import ServedModel
from server.sched.scheduler import Scheduler
from server.settings import Settings


async def tokens_per_second(
    engine: Engine, served: ServedModel, concurrency: int, requests: int, args: argparse.Namespace
) -> float:
    """Generated tokens per second (tokens, not events: a whole answer has a single event)."""
    prompt = served.tokenizer.encode("Chapter 1. It was")

    async def one(seed: int) -> int:
        sampling = SamplingParams(temperature=args.temperature, top_p=1.0, top_k=0, seed=seed)
        request = GenerationRequest(prompt, args.max_tokens, sampling, stream=not args.whole)
        handle = engine.submit_generation(served, [request])
        return sum([event.completion_tokens async for _, event in handle.events() if isinstance(event, Finished)])

    started, tokens = time.perf_counter(), 0
    for first in range(0, requests, concurrency):
        tokens += sum(await asyncio.gather(*(one(first + i) for i in range(concurrency))))
    return tokens / (time.perf_counter() - started)


def profiled(loop):
    """Scheduler.loop under cProfile, kept in ``profiled.profile``."""

    def run(self: Scheduler) -> None:
        profiled.profile.enable()
        try:
            loop(self)
        finally:
            profiled.profile.disable()

    return run


profiled.profile = cProfile.Profile()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "text-lrnn")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--concurrencies", default="1,16")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--whole", action="store_true", help="requests that do not stream")
    parser.add_argument("--stub", action="store_true", help="a decode step that returns zeros at once")
    parser.add_argument("--profile", action="store_true", help="profile the engine thread (see above)")
    parser.add_argument(
        "--default-gc", action="store_true", help="CPython's garbage collector settings, not the server's"
    )
    args = parser.parse_args()
    concurrencies = [int(value) for value in args.concurrencies.split(",")]
    if args.profile:
        Scheduler.loop = profiled(Scheduler.loop)
    settings = Settings(models=args.model, shipped_models=False, device=args.device, torch_threads=args.threads)
    if not args.default_gc:
        tune_garbage_collector()
    engine = Engine(settings, ServerMetrics(), on_ready=None if args.default_gc else freeze_startup_heap)
    engine.start()
    engine.wait_loaded()
    if args.model.name not in engine.models:
        engine.stop()
        parser.error(f"--model {args.model}: no model was loaded from it (the log above says why)")
    served = engine.models[args.model.name]
    if args.stub:
        stub_decode_steps(served.model, served.config.model.vocab_size)
        served.decoder = Decoder(served.model, "stub: zero logits at once")
    print(
        f"machine: {machine(args.device)}; torch threads: {args.threads}; {args.model.name}, {args.max_tokens} "
        f"tokens per request, temperature {args.temperature:g}, {'whole' if args.whole else 'streamed'}; decode: "
        f"{'stub (zeros)' if args.stub else served.decoder.path}; garbage collector: "
        f"{'CPython defaults' if args.default_gc else 'as the server'}"
    )
    for _ in range(args.repeats):
        for concurrency in concurrencies:
            requests = 2 * concurrency if concurrency > 1 else 4
            rate = asyncio.run(tokens_per_second(engine, served, concurrency, requests, args))
            print(f"concurrency {concurrency}: {rate:.0f} tokens/s", flush=True)
    engine.stop()
    if args.profile:
        pstats.Stats(profiled.profile).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    main()
