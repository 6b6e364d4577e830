"""A million tokens of context through the server: a pass-key prompt of ~2^20 tokens, its prefill and its cache.

The prompt is in tokens of the model's own tokenizer, sent through /v1/completions and /v1/generate; measured are the
server's memory, the prefill time, short requests beside the prefill, and second questions on the same prefix
answered from the prompt-state cache.

    python -m benchmarks.serve.long_context.bench_million [--models checkpoints] [--model text-lrnn] [--tokens 1048576]
        [--max-tokens 8] [--probe passkey|retrieval] [--formats number] [--seed 0] [--threads 1] [--json PATH]

Serves ``--models/--model`` alone (``python -m server`` on a folder holding only it, default settings) and sends,
one after another, each streamed and greedy (``--max-tokens`` tokens):

1. prompt A (the pass-key prompt of docs/api.md, Long-context probes; the "grass is green" filler, the key at 1/3)
   through /v1/completions, while 8-token requests are sent one at a time, a second apart, until its first token
   comes;
2. prompt B (another key at 1/10: a prefix of its own from there) through /v1/generate;
3. prompt A with another question through /v1/generate: all but its last tokens are prompt A's, whose state
   the cache kept ``state_cache_tail_tokens`` before its end;
4. prompt A again through /v1/completions: the whole prompt is in the cache.

With ``--probe retrieval`` the prompts are the retrieval probe's (docs/api.md, Retrieval) on the same filler, from its
held-out split (wordings, keys and values no training run draws), ``--formats`` giving the value formats: A holds two
needles, the first at 1/3 and asked, the second at a uniform depth and asked by A's other question; B one needle at
1/10.

Recorded: the model's published limits, TTFT and end-to-end time of each, the prompt tokens taken from the state
cache (``regularlm_prefix_cache_hits`` on /metrics), the latencies of the short requests, and the server's VmRSS
(before, the most seen while each ran, after) and VmHWM from /proc/<pid>/status. Prints a markdown table and the
figures as JSON (also to ``--json``), and each answer's first number (pass key) or first value (retrieval) against the
one asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.serve.harness import add_server_arguments, child_pids, machine, server_process
from model.checkpoint import read_config
from model.tokenizer import load_tokenizer
from server.settings import SHIPPED_CHECKPOINTS
from training.data.passkey import first_number
from training.data.retrieval import HELD_OUT, RetrievalBuilder, first_value, formats_named
from training.evaluation.passkey_probe import GRASS_FILLER, filler_tokens

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there. "
)
QUESTION = "What is the pass key? The pass key is"
OTHER_QUESTION = "Now tell me: what is the pass key? The pass key is"
SHORT_PROMPT = "Mr. Darcy"


def pass_key_prompt(tokenizer, tokens: int, key: int, depth: float, question: str = QUESTION) -> str:
    """The pass-key prompt (docs/api.md, Long-context probes) of about ``tokens`` tokens: the filler repeated, the key
    sentence after ``depth`` of it."""
    per_filler = len(tokenizer.encode(FILLER * 64)) / 64
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    fixed = len(tokenizer.encode(INTRO + needle + question))
    repeats = max(2, round((tokens - fixed) / per_filler))
    before = round(repeats * depth)
    return INTRO + FILLER * before + needle + FILLER * (repeats - before) + question


def pass_key_prompts(tokenizer, tokens: int) -> dict[str, tuple[str, str]]:
    """Prompts A, A with another question, and B of the pass-key probe, each with the key it asks for."""
    prompt_a = pass_key_prompt(tokenizer, tokens, 31415, 1 / 3)
    other_question = prompt_a.removesuffix(QUESTION) + OTHER_QUESTION
    return {
        "A": (prompt_a, "31415"),
        "A other": (other_question, "31415"),
        "B": (pass_key_prompt(tokenizer, tokens, 27182, 1 / 10), "27182"),
    }


def retrieval_prompts(tokenizer, tokens: int, formats: str, seed: int) -> dict[str, tuple[str, str]]:
    """Prompts A (two needles of the retrieval probe's held-out split, the first at 1/3 and asked), A asking for its
    second needle (A's tokens but its question), and B (another draw, one needle at 1/10), of ``tokens`` tokens of
    the "grass is green" filler, as texts, each with the value it asks for. ValueError naming a format that is not
    in the held-out split."""
    names = formats_named(formats, HELD_OUT)
    rng = np.random.default_rng(seed)
    builder = RetrievalBuilder(tokenizer, filler_tokens(GRASS_FILLER, tokenizer, 0.0), HELD_OUT)
    draw_a = builder.draw(rng, names[int(rng.integers(len(names)))], 1 / 3, needles=2)
    prompt_a = builder.prompt(draw_a, tokens)
    shared = prompt_a.tokens[: len(prompt_a.tokens) - len(builder.question(draw_a, 0))].tolist()
    other = tokenizer.decode([*shared, *builder.question(draw_a, 1).tolist()])
    prompt_b = builder.prompt(builder.draw(rng, names[int(rng.integers(len(names)))], 1 / 10), tokens)
    return {
        "A": (tokenizer.decode(prompt_a.tokens.tolist()), prompt_a.value),
        "A other": (other, draw_a.values[1]),
        "B": (tokenizer.decode(prompt_b.tokens.tolist()), prompt_b.value),
    }


def memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of the server, in bytes: its process and its children (the engine process that
    ``python -m server`` starts, docs/serving.md), summed."""
    fields = {"VmRSS": 0, "VmHWM": 0}
    for each in [pid, *child_pids(pid)]:
        for line in Path(f"/proc/{each}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in fields:
                fields[name] += int(value.split()[0]) * 1024
    return fields


async def prefix_cache_hits(client: httpx.AsyncClient, model_id: str) -> float:
    """Prompt tokens the server has taken from its state cache for the model so far."""
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("regularlm_prefix_cache_hits") and f'model_name="{model_id}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def streamed(client: httpx.AsyncClient, path: str, body: dict, expected: str, probe: str) -> dict:
    """Send one streamed request; its TTFT (first chunk), end-to-end time, text and answer: the text's first number
    (``probe`` "passkey") or first value ("retrieval"), and whether it is ``expected``."""
    started = time.perf_counter()
    first, pieces = None, []
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{path}: {response.status_code} {(await response.aread()).decode()[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"{path}: {chunk['error']}")
            first = first or time.perf_counter() - started
            pieces.append(chunk["choices"][0]["text"] if "choices" in chunk else chunk["text"])
    text = "".join(pieces)
    answer = first_number(text) if probe == "passkey" else first_value(text)
    return {
        "ttft_s": first,
        "e2e_s": time.perf_counter() - started,
        "text": text,
        "answer": answer,
        "expected": expected,
        "right": answer == expected,
    }


async def measured(
    url: str, pid: int, path: str, body: dict, asked: tuple[str, str], tokenizer, probe: str, beside: bool = False
) -> dict:
    """One long request, with the server's memory sampled every 0.25 s while it runs and (``beside``) 8-token
    requests sent one at a time, a second apart, from 2 s in until its first token."""
    model_id = body["model"]
    prompt, expected = asked
    body = {**body, "prompt": prompt}
    async with httpx.AsyncClient(base_url=url, timeout=7200) as client:
        hits = await prefix_cache_hits(client, model_id)
        before = memory(pid)
        peak_rss, short_ms = before["VmRSS"], []
        long = asyncio.ensure_future(streamed(client, path, body, expected, probe))
        started = time.perf_counter()
        next_short = started + 2.0
        while not long.done():
            peak_rss = max(peak_rss, memory(pid)["VmRSS"])
            if beside and time.perf_counter() >= next_short:
                sent = time.perf_counter()
                short = {"model": model_id, "prompt": SHORT_PROMPT, "max_tokens": 8, "temperature": 0}
                response = await client.post("/v1/generate", json=short)
                response.raise_for_status()
                if not long.done():  # answered while the long prompt was still without its first token
                    short_ms.append(1e3 * (time.perf_counter() - sent))
                next_short = time.perf_counter() + 1.0
            await asyncio.sleep(0.25)
        result = await long
        after = memory(pid)
        cached_tokens = await prefix_cache_hits(client, model_id) - hits
    result.update(
        path=path,
        prompt_tokens=len(tokenizer.encode(body["prompt"])),
        body_bytes=len(json.dumps(body)),
        cached_tokens=cached_tokens,
        rss_before=before["VmRSS"],
        rss_peak_seen=peak_rss,
        rss_after=after["VmRSS"],
        hwm_after=after["VmHWM"],
    )
    if beside:
        result["short_requests_beside_ms"] = short_ms
    return result


async def run(url: str, pid: int, args: argparse.Namespace, tokenizer) -> dict:
    model_id = args.model
    if args.probe == "passkey":
        prompts = pass_key_prompts(tokenizer, args.tokens)
    else:
        prompts = retrieval_prompts(tokenizer, args.tokens, args.formats, args.seed)
    greedy = {"model": model_id, "max_tokens": args.max_tokens, "temperature": 0}
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        card = (await client.get(f"/v1/models/{model_id}")).json()
        alone = []
        for _ in range(6):
            sent = time.perf_counter()
            response = await client.post("/v1/generate", json={**greedy, "prompt": SHORT_PROMPT, "max_tokens": 8})
            response.raise_for_status()
            alone.append(1e3 * (time.perf_counter() - sent))
    probe = args.probe
    runs = {
        "completions_A": await measured(
            url, pid, "/v1/completions", greedy, prompts["A"], tokenizer, probe, beside=True
        ),
        "generate_B": await measured(url, pid, "/v1/generate", greedy, prompts["B"], tokenizer, probe),
        "generate_A_other_question": await measured(
            url, pid, "/v1/generate", greedy, prompts["A other"], tokenizer, probe
        ),
        "completions_A_again": await measured(url, pid, "/v1/completions", greedy, prompts["A"], tokenizer, probe),
    }
    return {
        "machine": machine(args.device),
        "probe": probe
        if probe == "passkey"
        else f"retrieval, held-out split, formats {args.formats}, seed {args.seed}",
        "server_threads": args.threads,
        "model": model_id,
        "limits": card["limits"],
        "short_request_alone_ms": alone[1:],
        "runs": runs,
        "memory_after": memory(pid),
    }


def table(figures: dict) -> str:
    mib = 2**20
    alone = statistics.median(figures["short_request_alone_ms"])
    lines = [
        (
            f"machine: {figures['machine']}; server torch threads: {figures['server_threads']}; {figures['model']} "
            f"limits {figures['limits']}; probe: {figures['probe']}; 8-token request alone: median {alone:.0f} ms\n"
        ),
        (
            "| request | prompt tokens | from the cache | TTFT (s) | end to end (s) "
            "| VmRSS before / most seen / after (MiB) | VmHWM after (MiB) | 8-token requests beside: n, median, max (ms) "
            "| answer (asked) |"
        ),
        "|---|---:|---:|---:|---:|---|---:|---|---|",
    ]
    for name, run in figures["runs"].items():
        beside = run.get("short_requests_beside_ms")
        beside_cell = "-"
        if beside is not None:
            beside_cell = f"{len(beside)}, {statistics.median(beside):.0f}, {max(beside):.0f}" if beside else "0"
        lines.append(
            f"| {name} {run['path']} | {run['prompt_tokens']:,} | {run['cached_tokens']:,.0f} "
            f"| {run['ttft_s']:.2f} | {run['e2e_s']:.2f} | {run['rss_before'] / mib:,.0f} / "
            f"{run['rss_peak_seen'] / mib:,.0f} / {run['rss_after'] / mib:,.0f} | {run['hwm_after'] / mib:,.0f} "
            f"| {beside_cell} | {run['answer']} ({run['expected']}) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=SHIPPED_CHECKPOINTS, help="a folder of checkpoint folders")
    parser.add_argument("--model", default="text-lrnn", help="the checkpoint folder under --models to serve")
    parser.add_argument("--tokens", type=int, default=2**20 - 64, help="prompt tokens (about)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--probe", choices=("passkey", "retrieval"), default="passkey", help="the prompts' kind")
    parser.add_argument(
        "--formats", default="number", help="retrieval: value formats of the held-out split (as text-eval's)"
    )
    parser.add_argument("--seed", type=int, default=0, help="retrieval: draws the needles and the filler's offsets")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    add_server_arguments(parser)
    args = parser.parse_args()
    try:
        formats_named(args.formats, HELD_OUT)
    except ValueError as error:
        parser.error(f"--formats: {error}")  # exit 2
    checkpoint = args.models.resolve() / args.model
    tokenizer = load_tokenizer(read_config(checkpoint).tokenizer, checkpoint)
    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / args.model).symlink_to(checkpoint)
        with server_process(Path(folder), args.threads, args.device) as url:
            figures = asyncio.run(run(url, url.pid, args, tokenizer))
    print(table(figures))
    print(json.dumps(figures, indent=1))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
