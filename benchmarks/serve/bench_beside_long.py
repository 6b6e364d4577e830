"""Short requests beside long work, through the server and the shipped checkpoints (issue 30 points 3 and 4).

    python -m benchmarks.serve.bench_beside_long [--transduce-length 20000] [--jobs 3] [--prompt-words 10000]
        [--threads 1]

Transduce: long ``parity_check-exact`` inputs one after another; 1 s into each, three 4-symbol
``tomita4-lrnn-compiled`` requests one at a time. Each should wait for one slice of the long input at most, whichever
input it is. Generate: 8-token greedy generates to ``text-regulargpt`` and ``text-lrnn``, back to back, alone and then
beside one long prompt to the same model (the pass-key filler, max_tokens 1) until its answer comes.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.serve.harness import add_server_arguments, machine, server_process
from server.settings import SHIPPED_CHECKPOINTS

LONG_TRANSDUCER, SHORT_TRANSDUCER = "parity_check-exact", "tomita4-lrnn-compiled"
LANGUAGE_MODELS = ("text-regulargpt", "text-lrnn")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


async def timed(client: httpx.AsyncClient, path: str, body: dict) -> float:
    """Milliseconds to the answer (which must be a 200)."""
    started = time.perf_counter()
    response = await client.post(path, json=body)
    response.raise_for_status()
    return 1e3 * (time.perf_counter() - started)


async def transduce_table(client: httpx.AsyncClient, length: int, jobs: int) -> None:
    short = {"model": SHORT_TRANSDUCER, "inputs": ["0101"]}
    alone = [await timed(client, "/v1/transduce", short) for _ in range(6)][1:]
    print(f"{SHORT_TRANSDUCER} alone: median {statistics.median(alone):.1f} ms\n")
    print(f"| {LONG_TRANSDUCER} input ({length:,} symbols) | its time (s) | 4-symbol requests beside it (ms) |")
    print("|---:|---:|---|")
    for job in range(jobs):
        started = time.perf_counter()
        body = {"model": LONG_TRANSDUCER, "inputs": ["01" * (length // 2)]}
        long = asyncio.ensure_future(timed(client, "/v1/transduce", body))
        await asyncio.sleep(1.0)
        beside = [await timed(client, "/v1/transduce", short) for _ in range(3)]
        await long
        print(f"| {job + 1} | {time.perf_counter() - started:.1f} | {', '.join(f'{ms:,.0f}' for ms in beside)} |")


async def generate_row(client: httpx.AsyncClient, model_id: str, words: int) -> None:
    def short(index: int) -> dict:
        return {"model": model_id, "prompt": f"Hello {index}", "max_tokens": 8, "temperature": 0}

    alone = [await timed(client, "/v1/generate", short(index)) for index in range(11)][1:]
    started = time.perf_counter()
    prompt = {"model": model_id, "prompt": FILLER * (words // 18 + 1), "max_tokens": 1}
    long = asyncio.ensure_future(client.post("/v1/generate", json=prompt))
    await asyncio.sleep(0.5)
    beside = []
    while not long.done():
        beside.append(await timed(client, "/v1/generate", short(len(beside))))
    answer = (await long).json()
    median_alone, median_beside = statistics.median(alone), statistics.median(beside)
    print(
        f"| {model_id} | {answer['usage']['prompt_tokens']:,} | {time.perf_counter() - started:.1f} | {median_alone:.1f} "
        f"| {median_beside:.1f} | {max(beside):,.0f} | {len(beside)} | {median_beside / median_alone:.1f}x |"
    )


async def run(url: str, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        await transduce_table(client, args.transduce_length, args.jobs)
        print("\n| model | long prompt (tokens) | its time (s) | 8 tokens alone, median (ms) | beside it, median (ms) "
              "| max (ms) | requests beside | ratio |")  # fmt: skip
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for model_id in LANGUAGE_MODELS:
            await generate_row(client, model_id, args.prompt_words)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transduce-length", type=int, default=20_000)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--prompt-words", type=int, default=10_000)
    add_server_arguments(parser)
    args = parser.parse_args()
    print(f"machine: {machine(args.device)}; server torch threads: {args.threads}\n")
    with tempfile.TemporaryDirectory() as folder:
        for model_id in (LONG_TRANSDUCER, SHORT_TRANSDUCER, *LANGUAGE_MODELS):
            (Path(folder) / model_id).symlink_to(SHIPPED_CHECKPOINTS / model_id)
        with server_process(Path(folder), args.threads, args.device, state_cache_entries=0) as url:
            asyncio.run(run(url, args))


if __name__ == "__main__":
    main()
