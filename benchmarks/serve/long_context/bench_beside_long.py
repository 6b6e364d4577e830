"""Short requests beside long work, through the server and the shipped checkpoints.

    python -m benchmarks.serve.long_context.bench_beside_long [--transduce-length 20000] [--jobs 3] [--skip-transduce]
        [--models text-regulargpt text-lrnn] [--prompt-tokens 14000 50000 limit] [--stop-after SECONDS] [--slice-ms MS]
        [--anticipate-ms MS] [--busy-core] [--many-clients N] [--threads 1]

Transduce: long ``parity_check-exact`` inputs one after another; 1 s into each, three 4-symbol
``tomita4-lrnn-compiled`` requests one at a time. Each should wait for one slice of the long input at most, whichever
input it is. Generate: 8-token greedy generates to each of ``--models``, back to back, alone and then beside one long
prompt to the same model (the pass-key filler as token ids, max_tokens 1) until its answer comes, for each of
``--prompt-tokens`` (``limit``: the model's ``max_context_tokens`` in /v1/models less the token generated), or until
``--stop-after`` seconds. The ratio is the median beside over the median alone (10 requests before the long prompt
and 10 after it); "deep" takes only the requests sent in the second half of that time, where the chunks go deepest.
``--busy-core`` first times them beside a busy-loop process: what sharing the cores alone costs them.
``--many-clients N``: instead, N clients each send six 2,000-token prompts (16 tokens each) to each model, one after
another: requests per second and the latency's median and 95th percentile, where every prompt is one of many.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.serve.harness import add_server_arguments, machine, server_process
from model.tokenizer import load_tokenizer
from server.settings import SHIPPED_CHECKPOINTS

LONG_TRANSDUCER, SHORT_TRANSDUCER = "parity_check-exact", "tomita4-lrnn-compiled"
LANGUAGE_MODELS = ("text-regulargpt", "text-lrnn")
MANY_PROMPTS, MANY_PROMPT_TOKENS = 6, 2_000  # each of --many-clients's clients
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


def filler_prompt(card: dict, tokens: int) -> list[int]:
    """``tokens`` token ids of ``FILLER`` repeated, in the tokenizer the model's ``card`` (``/v1/models/ID``) names."""
    model_id = card["id"]
    filler = load_tokenizer(card["tokenizer"], SHIPPED_CHECKPOINTS / model_id).encode(FILLER)
    return (filler * (tokens // len(filler) + 1))[:tokens]


async def generate_row(client: httpx.AsyncClient, model_id: str, size: str, stop_after: float | None) -> None:
    """One row of the generate table: 8-token requests alone, then beside a long prompt of ``size`` tokens (given up,
    the connection closed, after ``stop_after`` seconds if it has not been answered)."""

    def short(index: int) -> dict:
        return {"model": model_id, "prompt": f"Hello {index}", "max_tokens": 8, "temperature": 0}

    card = (await client.get(f"/v1/models/{model_id}")).json()
    tokens = card["limits"]["max_context_tokens"] - 1 if size == "limit" else int(size)
    prompt = {"model": model_id, "prompt": filler_prompt(card, tokens), "max_tokens": 1}
    alone = [await timed(client, "/v1/generate", short(index)) for index in range(11)][1:]
    started = time.perf_counter()
    long = asyncio.ensure_future(client.post("/v1/completions", json=prompt))
    await asyncio.sleep(0.5)
    beside: list[tuple[float, float]] = []  # (seconds since the long prompt was sent, milliseconds)
    given_up = False
    while not long.done() and not given_up:
        sent = time.perf_counter() - started
        given_up = stop_after is not None and sent >= stop_after
        if not given_up:
            beside.append((sent, await timed(client, "/v1/generate", short(len(beside)))))
    took = time.perf_counter() - started
    if given_up:
        long.cancel()  # its connection closes: the server ends it at its next slice
        await asyncio.sleep(1.0)
        prompt_tokens, its_time = f"{tokens:,}", f"stopped at {took:.0f}"
    else:
        answer = await long
        answer.raise_for_status()
        prompt_tokens, its_time = f"{answer.json()['usage']['prompt_tokens']:,}", f"{took:.1f}"
    alone += [await timed(client, "/v1/generate", short(index)) for index in range(10)]  # the load may have moved
    every = [ms for _, ms in beside]
    deep = [ms for sent, ms in beside if sent >= took / 2] or every
    median_alone, median_beside = statistics.median(alone), statistics.median(every)
    print(
        f"| {model_id} | {prompt_tokens} | {its_time} | {median_alone:.1f} "
        f"| {median_beside:.1f} | {max(every):,.0f} | {len(every)} | {median_beside / median_alone:.1f}x "
        f"| {statistics.median(deep) / median_alone:.1f}x |"
    )


async def many_clients_line(client: httpx.AsyncClient, model_id: str, clients: int) -> None:
    """``clients`` clients, each sending ``MANY_PROMPTS`` prompts of ``MANY_PROMPT_TOKENS`` tokens one after another."""
    card = (await client.get(f"/v1/models/{model_id}")).json()
    body = filler_prompt(card, MANY_PROMPT_TOKENS - 1)
    seconds: list[float] = []

    async def one_client(index: int) -> None:
        for prompt in range(MANY_PROMPTS):  # a first token of its own: no two prompts alike
            first = (index * 7 + prompt) % 200 + 1
            request = {"model": model_id, "prompt": [first, *body], "max_tokens": 16, "temperature": 0}
            seconds.append(await timed(client, "/v1/completions", request) / 1e3)

    await one_client(clients)  # a warm-up, not counted
    seconds.clear()
    started = time.perf_counter()
    await asyncio.gather(*[one_client(index) for index in range(clients)])
    wall = time.perf_counter() - started
    print(
        f"{model_id}: {clients} clients, {len(seconds)} prompts of {MANY_PROMPT_TOKENS:,} tokens in {wall:.1f} s "
        f"({len(seconds) / wall:.2f} a second), latency median {statistics.median(seconds):.2f} s, "
        f"95th percentile {statistics.quantiles(seconds, n=20)[18]:.2f} s"
    )


async def busy_core_line(client: httpx.AsyncClient, model_id: str) -> None:
    """The same 8-token requests alone and beside a process that keeps one core busy (a loop, no server work): what
    the machine alone does to them while another process computes, a floor for the ratios below on a machine with
    few cores."""

    async def median_ms() -> float:
        body = {"model": model_id, "prompt": "Hello", "max_tokens": 8, "temperature": 0}
        return statistics.median([await timed(client, "/v1/generate", body) for _ in range(11)][1:])

    alone = await median_ms()
    busy = await asyncio.create_subprocess_exec(sys.executable, "-c", "while True: pass")
    try:
        await asyncio.sleep(0.5)
        beside = await median_ms()
    finally:
        busy.kill()
        await busy.wait()
    print(f"{model_id}: 8 tokens alone {alone:.1f} ms, beside a busy core {beside:.1f} ms ({beside / alone:.1f}x)")


async def run(url: str, args: argparse.Namespace) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=httpx.Limits(max_connections=256)) as client:
        if args.many_clients:
            for model_id in args.models:
                await many_clients_line(client, model_id, args.many_clients)
            return
        if not args.skip_transduce:
            await transduce_table(client, args.transduce_length, args.jobs)
        if args.busy_core:
            print()
            for model_id in args.models:
                await busy_core_line(client, model_id)
        print(
            "\n| model | long prompt (tokens) | its time (s) | 8 tokens alone, median (ms) | beside it, median (ms) "
            "| max (ms) | requests beside | ratio | deep ratio |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for model_id in args.models:
            for size in args.prompt_tokens:
                await generate_row(client, model_id, size, args.stop_after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transduce-length", type=int, default=20_000)
    parser.add_argument("--jobs", type=int, default=3)
    parser.add_argument("--skip-transduce", action="store_true", help="only the generate table")
    parser.add_argument("--models", nargs="+", default=list(LANGUAGE_MODELS), choices=LANGUAGE_MODELS)
    parser.add_argument(
        "--prompt-tokens",
        nargs="+",
        default=["14000"],
        type=_size,
        help="long prompt sizes in tokens, or 'limit' (the model's max_context_tokens less one)",
    )
    parser.add_argument("--stop-after", type=float, help="seconds after which a long prompt is given up")
    parser.add_argument("--slice-ms", type=float, help="the server's slice_ms (default: its own default)")
    parser.add_argument("--anticipate-ms", type=float, help="the server's anticipate_ms (default: its own default)")
    parser.add_argument("--busy-core", action="store_true", help="first, the requests beside a busy core alone")
    parser.add_argument("--many-clients", type=int, help="instead: this many clients of 2,000-token prompts")
    add_server_arguments(parser)
    args = parser.parse_args()
    print(f"machine: {machine(args.device)}; server torch threads: {args.threads}\n")
    transducers = () if args.skip_transduce or args.many_clients else (LONG_TRANSDUCER, SHORT_TRANSDUCER)
    with tempfile.TemporaryDirectory() as folder:
        for model_id in (*transducers, *args.models):
            (Path(folder) / model_id).symlink_to(SHIPPED_CHECKPOINTS / model_id)
        chosen = {"slice_ms": args.slice_ms, "anticipate_ms": args.anticipate_ms}
        settings = {name: value for name, value in chosen.items() if value is not None}
        with server_process(Path(folder), args.threads, args.device, state_cache_entries=0, **settings) as url:
            asyncio.run(run(url, args))


def _size(text: str) -> str:
    if text != "limit" and not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: a number of tokens or 'limit'")
    return text


if __name__ == "__main__":
    main()
