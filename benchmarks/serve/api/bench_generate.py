"""/v1/generate (streamed) on the LRNN language model at concurrency 1, 8 and 32: TTFT, TPOT, ITL, E2EL
(vLLM's definitions, benchmarks/serve/harness.py) and throughput, with continuous batching and with batch-1 serving.

    python -m benchmarks.serve.api.bench_generate [--prompt-tokens 32] [--max-tokens 64] [--threads 1]
        [--model checkpoints/text-lrnn] [--concurrencies 1,8,32] [--decode graphs,eager] [--no-stream]
        [--no-batch-1] [--device cuda] [--stub] [--temperature T]

``--stub``: the server's decode steps return zero logits at once (benchmarks/serve/stub_server.py), so that the
figures are the server's own cost per token. ``--model``: a checkpoint folder to serve instead of the random-weight
LRNN (d_model 256, 4 layers, bytes). ``--decode``: one set of rows per decode path on CUDA (``graphs``: the
default, CUDA graphs where the model allows; ``eager``: ``cuda_graphs`` false). ``--no-stream``: whole answers, so
that a Python client can keep up with a server at tens of thousands of tokens per second (the latencies but E2EL
are then "-"). Throughput counts the output
tokens the answers report (a request may end before ``--max-tokens`` at the end-of-text token).
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


def bodies(args: argparse.Namespace, count: int, max_tokens: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    sampling = {} if args.temperature is None else {"temperature": args.temperature}
    return [
        {
            "model": args.model_id,
            "prompt": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(args.prompt_tokens)),
            "max_tokens": max_tokens,
            "seed": index,
            "stream": args.stream,
            **sampling,
        }
        for index in range(count)
    ]


def measure(url: str, label: str, concurrency: int, args: argparse.Namespace) -> float:
    """One table row; returns the output tokens per second."""
    requests = max(args.requests, 2 * concurrency)
    run_load(url, "/v1/generate", bodies(args, concurrency, 8, 0), concurrency)  # warm-up
    records, wall = run_load(url, "/v1/generate", bodies(args, requests, args.max_tokens, concurrency), concurrency)
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
    parser.add_argument("--model", type=Path, help="a checkpoint folder (default: a random-weight LRNN)")
    parser.add_argument("--concurrencies", default=",".join(map(str, CONCURRENCIES)))
    parser.add_argument("--decode", default="graphs", help="graphs, eager or both (graphs,eager): rows per path")
    parser.add_argument("--no-stream", dest="stream", action="store_false", help="whole answers, not streamed")
    parser.add_argument("--no-batch-1", dest="batch_1", action="store_false", help="skip the batch-1 row")
    parser.add_argument("--stub", action="store_true", help="decode steps that return zeros at once (see above)")
    parser.add_argument("--temperature", type=float, help="every request's (default: the API's, 1)")
    add_server_arguments(parser)
    args = parser.parse_args()
    concurrencies = [int(value) for value in args.concurrencies.split(",")]
    paths = args.decode.split(",")
    if not set(paths) <= {"graphs", "eager"}:
        parser.error(f"--decode: graphs, eager or graphs,eager, not {args.decode!r}")
    print(f"machine: {machine(args.device)}; server torch threads: {args.threads}")
    print(f"prompt {args.prompt_tokens} tokens, {args.max_tokens} output tokens per request\n")
    latencies = " | ".join(f"{name} p50/p99 (ms)" for name in ("TTFT", "TPOT", "ITL", "E2EL"))
    print(f"| serving | concurrency | requests | {latencies} | output tok/s | req/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder:
        models = args.model.resolve() if args.model else write_models(Path(folder))
        args.model_id = models.name if args.model else LANGUAGE_MODEL
        batched = 0.0
        module = "benchmarks.serve.stub_server" if args.stub else "server"
        for path in paths:
            settings = {"cuda_graphs": path == "graphs", "max_running": max(64, *concurrencies)}
            with server_process(models, args.threads, args.device, module, **settings) as url:
                for concurrency in concurrencies:
                    batched = measure(url, f"continuous batching, {path}", concurrency, args)
        if args.batch_1:
            with server_process(models, args.threads, args.device, module, **BATCH_1) as url:
                batch_1 = measure(url, "batch-1 (max_running=1)", concurrencies[-1], args)
            print(
                f"\nThroughput at concurrency {concurrencies[-1]}, continuous batching over batch-1 serving: "
                f"{batched / batch_1:.2f}x"
            )


if __name__ == "__main__":
    main()
