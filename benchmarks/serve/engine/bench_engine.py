"""The engine under many clients, on the shipped checkpoints (plus a random-weight transformer language model
of the shipped text models' shape, since none ships):

- head-of-line: the latency of 4-symbol transduce requests to another model, sent every 0.5 s from 1.5 s
  after a long exact transduce started (100,000 symbols to parity_check-exact, or the largest it admits);
- generate throughput (streamed /v1/generate) at concurrency 16 over concurrency 1, per text model;
- peak RSS of the server while it serves, to each text model in turn, a prompt as long as its limits in
  /v1/models admit (max_input_symbols, and max_context_tokens less the 1 token generated).

    python -m benchmarks.serve.engine.bench_engine [--threads 1] [--device cpu] [--skip head,throughput,rss]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.serve.harness import ROOT, add_server_arguments, machine, peak_rss_bytes, run_load, server_process
from model.checkpoint import save_checkpoint
from model.config import CheckpointConfig, TransformerConfig
from model.registry import build_model

SHIPPED = ROOT / "checkpoints"
LONG_MODEL, SHORT_MODEL = "parity_check-exact", "parity_check-lrnn"
TEXT_MODELS = ("text-regulargpt", "text-lrnn", "text-transformer")
TRANSFORMER = TransformerConfig(vocab_size=8192, d_model=128, n_layers=4, n_heads=4, d_ff=512, position="alibi")


def models_folder(folder: Path) -> Path:
    """The shipped checkpoints (linked) and a random transformer with text-regulargpt's tokenizer."""
    for checkpoint in SHIPPED.iterdir():
        if checkpoint.is_dir():
            (folder / checkpoint.name).symlink_to(checkpoint)
    torch.manual_seed(0)
    target = folder / "text-transformer"
    config = CheckpointConfig(
        architecture="transformer", model=TRANSFORMER, kind="generate", tokenizer="file:tokenizer.tiktoken"
    )
    save_checkpoint(build_model("transformer", TRANSFORMER), config, target)
    (target / "tokenizer.tiktoken").write_bytes((SHIPPED / "text-regulargpt" / "tokenizer.tiktoken").read_bytes())
    return folder


def limits(url: str) -> dict[str, dict]:
    return {card["id"]: card["limits"] for card in httpx.get(f"{url}/v1/models").json()["data"]}


def head_of_line(url: str) -> None:
    long_symbols = min(100_000, limits(url)[LONG_MODEL]["max_input_symbols"])

    async def main() -> tuple[float, list[float]]:
        async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
            body = {"model": LONG_MODEL, "inputs": ["01" * (long_symbols // 2) + "1" * (long_symbols % 2)]}
            started = time.perf_counter()
            long = asyncio.ensure_future(client.post("/v1/transduce", json=body))
            await asyncio.sleep(1.5)
            latencies = []
            while not long.done():
                sent = time.perf_counter()
                response = await client.post("/v1/transduce", json={"model": SHORT_MODEL, "inputs": ["0110"]})
                response.raise_for_status()
                latencies.append(time.perf_counter() - sent)
                await asyncio.sleep(0.5)
            (await long).raise_for_status()
            return time.perf_counter() - started, latencies

    total, latencies = asyncio.run(main())
    print(
        f"head-of-line: {LONG_MODEL} on {long_symbols} symbols took {total:.1f} s; {len(latencies)} 4-symbol "
        f"{SHORT_MODEL} requests meanwhile: median {1e3 * statistics.median(latencies):.0f} ms, "
        f"max {1e3 * max(latencies):.0f} ms"
    )


def throughput(url: str, max_tokens: int) -> None:
    for model in TEXT_MODELS:
        rates = {}
        for concurrency in (1, 16):
            bodies = [
                {
                    "model": model,
                    "prompt": f"Chapter {i}. It was",
                    "max_tokens": max_tokens,
                    "seed": i,
                    "temperature": 1.0,
                    "stream": True,
                }
                for i in range(2 * concurrency)
            ]
            run_load(url, "/v1/generate", bodies[:concurrency], concurrency)  # warm-up
            records, wall = run_load(url, "/v1/generate", bodies, concurrency)
            rates[concurrency] = sum(record.output_tokens for record in records) / wall
        print(
            f"generate {model}: {rates[1]:.0f} tok/s at concurrency 1, {rates[16]:.0f} at 16 "
            f"({rates[16] / rates[1]:.2f}x)"
        )


def peak_rss(url: str) -> None:
    """Each text model's limit, as a prompt of " the" repeated (one token each in the shipped 8k BPE)."""
    model_limits = limits(url)
    print(f"server peak RSS before: {peak_rss_bytes(url.pid) / 2**20:.0f} MiB")
    for model in TEXT_MODELS:
        tokens = min(model_limits[model]["max_input_symbols"], model_limits[model]["max_context_tokens"] - 1)
        started = time.perf_counter()
        body = {"model": model, "prompt": " the" * tokens, "max_tokens": 1}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=3600)
        response.raise_for_status()
        print(
            f"prompt of {response.json()['usage']['prompt_tokens']} tokens to {model}: "
            f"{time.perf_counter() - started:.1f} s; server peak RSS now {peak_rss_bytes(url.pid) / 2**20:.0f} MiB"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per generation in the throughput runs")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: head, throughput, rss")
    add_server_arguments(parser)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    print(f"machine: {machine(args.device)}; server torch threads: {args.threads}")
    with tempfile.TemporaryDirectory() as folder:
        models = models_folder(Path(folder))
        with server_process(models, args.threads, args.device) as url:
            print("limits:", {model: limits(url)[model] for model in (LONG_MODEL, *TEXT_MODELS)})
            if "head" not in skip:
                head_of_line(url)
            if "throughput" not in skip:
                throughput(url, args.max_tokens)
            if "rss" not in skip:
                peak_rss(url)


if __name__ == "__main__":
    main()
