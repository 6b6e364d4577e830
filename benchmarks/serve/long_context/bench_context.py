"""LRNN decoding through the server at growing context: time per output token stays flat because a decode
step runs the O(1) recurrent step on a fixed-size state.

    python -m benchmarks.serve.long_context.bench_context [--contexts 100,1000,10000,100000] [--max-tokens 256]
        [--threads 1]

One streamed request per context (a prompt of that many byte tokens), concurrency 1. TTFT includes the
prefill of the whole context (chunked, ``prefill_chunk_tokens`` per scheduler iteration).
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="100,1000,10000,100000")
    parser.add_argument("--max-tokens", type=int, default=256)
    add_server_arguments(parser)
    args = parser.parse_args()
    contexts = [int(context) for context in args.contexts.split(",")]
    print(f"machine: {machine(args.device)}; server torch threads: {args.threads}; {args.max_tokens} output tokens\n")
    print("| context tokens | TTFT (s) | TPOT (ms) | ITL p50 (ms) | ITL p99 (ms) | TPOT / TPOT at first context |")
    print("|---:|---:|---:|---:|---:|---:|")
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as folder:
        models = write_models(Path(folder))
        with server_process(
            models, args.threads, args.device, max_input_symbols=max(contexts), state_cache_entries=0
        ) as url:
            warm_up = {"model": LANGUAGE_MODEL, "prompt": "warm up", "max_tokens": 16, "stream": True}
            run_load(url, "/v1/generate", [warm_up], 1)
            first = None
            for context in contexts:
                prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(context))
                body = {
                    "model": LANGUAGE_MODEL,
                    "prompt": prompt,
                    "max_tokens": args.max_tokens,
                    "seed": 0,
                    "stream": True,
                }
                (record,), _ = run_load(url, "/v1/generate", [body], 1)
                first = first or record.tpot
                print(
                    f"| {context:,} | {record.ttft:.2f} | {1e3 * record.tpot:.2f} | {ms(record.itl, 50)} "
                    f"| {ms(record.itl, 99)} | {record.tpot / first:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
