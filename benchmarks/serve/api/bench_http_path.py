"""The server's own cost of one /v1/transduce request of 8 inputs of 500 symbols, model call excluded.

The CPU time the server process spends per request, in all its threads (HTTP parsing, JSON, validation, encoding,
the event loop, the engine's scheduling, building the model's input tensor, the response), with the model call
answering at once (``benchmarks/serve/stub_server.py``), so that nothing of the model's own time is in it.

    python -m benchmarks.serve.api.bench_http_path [--rounds 10] [--requests 300] [--inputs 8] [--length 500]

Requests are sent one at a time over one keep-alive connection, from this process. The server's CPU time is read
from /proc (Linux) per round; on a shared machine other processes inflate some rounds, so the table gives the
median and the lowest round.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.serve.harness import machine, server_process
from model.checkpoint import save_checkpoint
from model.config import CheckpointConfig, LRNNConfig
from model.registry import build_model

MODEL = "parity-lrnn"
CONFIG = LRNNConfig(vocab_size=2, num_labels=2, d_model=4, n_layers=1, block_size=2, num_blocks=2, d_ff=8)
STUB = "benchmarks.serve.stub_server"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def write_model(directory: Path) -> Path:
    torch.manual_seed(0)
    checkpoint = CheckpointConfig(
        architecture="lrnn", model=CONFIG, kind="transduce", task="parity_check", alphabet="01", labels=("0", "1")
    )
    save_checkpoint(build_model("lrnn", CONFIG), checkpoint, directory / MODEL)
    return directory


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """User + system CPU time of each thread of a process (/proc/<pid>/task/<tid>/stat, fields 14 and 15)."""
    seconds = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        seconds[int(task.name)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return seconds


def measure(url: str, pid: int, body: dict, rounds: int, requests: int) -> list[dict[str, float]]:
    """Per round, per request in seconds: the client's latency, the server's CPU time in all threads and in the
    event loop's (the main thread's)."""
    results = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(50):  # warm-up
            client.post("/v1/transduce", json=body).raise_for_status()
        for _ in range(rounds):
            before, started = thread_cpu_seconds(pid), time.perf_counter()
            for _ in range(requests):
                client.post("/v1/transduce", json=body).raise_for_status()
            wall, after = time.perf_counter() - started, thread_cpu_seconds(pid)
            spent = {tid: seconds - before.get(tid, 0.0) for tid, seconds in after.items()}
            cpu, loop = sum(spent.values()) / requests, spent[pid] / requests
            results.append({"e2el": wall / requests, "cpu": cpu, "loop": loop})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--requests", type=int, default=300, help="requests per round")
    parser.add_argument("--inputs", type=int, default=8)
    parser.add_argument("--length", type=int, default=500)
    parser.add_argument("--outputs", choices=["final", "all"], default="final")
    args = parser.parse_args()
    rng = random.Random(0)
    texts = ["".join(rng.choice("01") for _ in range(args.length)) for _ in range(args.inputs)]
    body = {"model": MODEL, "inputs": texts, "outputs": args.outputs}
    stack = [name for name in ("httptools", "uvloop") if importlib.util.find_spec(name) is not None]
    print(f"machine: {machine()}; uvicorn picks up: {', '.join(stack) or 'neither httptools nor uvloop'}\n")
    with tempfile.TemporaryDirectory() as folder, server_process(write_model(Path(folder)), 1, module=STUB) as url:
        results = measure(url, url.pid, body, args.rounds, args.requests)
    print(
        f"{args.rounds} rounds of {args.requests} requests of {args.inputs} x {args.length} symbols, outputs "
        f"{args.outputs!r}, one at a time; per request, median of the rounds (lowest round):\n"
    )
    print("| E2EL (ms) | server CPU (ms) | of which the event loop's thread (ms) |\n|---:|---:|---:|")
    cells = []
    for key in ("e2el", "cpu", "loop"):
        values = [1e3 * result[key] for result in results]
        cells.append(f"{statistics.median(values):.3f} ({min(values):.3f})")
    print(f"| {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
