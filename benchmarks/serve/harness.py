"""Shared pieces of the serving benchmarks: benchmark checkpoints, a server process, a load generator and
vLLM's latency definitions.

Definitions (vLLM's benchmark_serving): E2EL = request sent -> last byte; TTFT = request sent -> first
chunk with text; ITL = the gaps between consecutive chunks with text; TPOT = (E2EL - TTFT) /
(output tokens - 1) per request. Throughput counts finished requests (and output tokens or input symbols)
per second of wall time over the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from model.checkpoint import save_checkpoint
from model.config import CheckpointConfig, LRNNConfig, RegularGPTConfig
from model.ops.cpu.cpu_decode import rows_argmax
from model.registry import build_model

ROOT = Path(__file__).resolve().parents[2]

# Random-weight models: speed depends on the shapes only.
TRANSDUCERS = {
    "parity-lrnn": ("lrnn", LRNNConfig(vocab_size=2, num_labels=2, d_model=128, n_layers=2, d_ff=512)),
    "parity-regulargpt": (
        "regulargpt",
        RegularGPTConfig(vocab_size=2, num_labels=2, d_model=128, n_heads=4, d_ff=512, chunk_size=2, thickness=2),
    ),
}
LANGUAGE_MODEL = "text-lrnn"
LANGUAGE_MODEL_CONFIG = LRNNConfig(vocab_size=256, d_model=256, n_layers=4, block_size=8, num_blocks=8, d_ff=1024)


def write_models(directory: Path) -> Path:
    torch.manual_seed(0)
    for model_id, (architecture, config) in TRANSDUCERS.items():
        checkpoint = CheckpointConfig(
            architecture=architecture,
            model=config,
            kind="transduce",
            task="parity_check",
            alphabet="01",
            labels=("0", "1"),
        )
        save_checkpoint(build_model(architecture, config), checkpoint, directory / model_id)
    checkpoint = CheckpointConfig(architecture="lrnn", model=LANGUAGE_MODEL_CONFIG, kind="generate", tokenizer="bytes")
    save_checkpoint(build_model("lrnn", LANGUAGE_MODEL_CONFIG), checkpoint, directory / LANGUAGE_MODEL)
    return directory


def stub_decode_steps(model, vocabulary: int) -> None:
    """Make ``model``'s decode steps (``step``, and ``step_greedy``, which the engine calls where every row is greedy)
    advance the cache's lengths and return zero logits (one tensor per batch size), or their picks."""
    zeros: dict[int, torch.Tensor] = {}

    def step(tokens: torch.Tensor, cache) -> torch.Tensor:
        cache.lengths = cache.lengths + 1
        rows = tokens.shape[0]
        if rows not in zeros:
            zeros[rows] = torch.zeros(rows, vocabulary)
        return zeros[rows]

    model.step = step
    model.step_greedy = lambda tokens, cache: rows_argmax(step(tokens, cache))


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """--threads and --device of the server under test, the same in every serving benchmark."""
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the server")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the server runs the models")


def machine(device: str = "cpu") -> str:
    gpu = f", GPU {torch.cuda.get_device_name()}" if device == "cuda" and torch.cuda.is_available() else ""
    return (
        f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores{gpu}, "
        f"Python {platform.python_version()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )


class ServerURL(str):
    """A server's base URL that also knows the server's process id."""

    pid: int


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set size so far (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def cpu_seconds(pid: int, children: bool = False) -> float:
    """User + system CPU time of the process so far (fields 14 and 15 of /proc/PID/stat), with ``children`` its child
    processes' too (the engine process of a server)."""
    total = 0
    for each in [pid, *(child_pids(pid) if children else [])]:
        fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    """The process's children, every thread's (/proc/PID/task/*/children); those found before it went, if it has."""
    found = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            found += [int(child) for child in (task / "children").read_text().split()]
    except OSError:
        pass
    return found


def models_arguments(models: Path, cwd: Path) -> list[str]:
    """The options that serve ``models`` alone with the checkout at ``cwd``: ``--no-shipped-models --models`` where it
    serves ``--models`` beside its shipped checkpoints, ``--models`` in an older checkout, where it replaced them."""
    settings = cwd / "server" / "settings.py"
    beside = settings.exists() and "shipped_models" in settings.read_text()
    return ["--no-shipped-models", "--models", str(models)] if beside else ["--models", str(models)]


@contextmanager
def server_process(
    models: Path,
    threads: int,
    device: str = "cpu",
    module: str = "server",
    cwd: Path = ROOT,
    start_timeout_s: float = 120,
    log_level: str = "warning",
    log: Path | None = None,
    **settings: object,
) -> Iterator[ServerURL]:
    """``python -m server`` (or ``module``, which takes its arguments) on a free port with REGULARLM_* settings, run
    from ``cwd`` (another checkout serves its own code); yields its URL (with ``.pid``) once /health answers 200, which
    it may take ``start_timeout_s`` to; SIGTERM at the end. ``log_level`` "info" passes no ``--log-level`` (the
    README's command); ``log``: a file its output is appended to (by default it goes to this process's)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {key: value for key, value in os.environ.items() if not key.startswith("REGULARLM_")}
    env.update({f"REGULARLM_{key.upper()}": str(value) for key, value in settings.items()})
    env["REGULARLM_TORCH_THREADS"] = str(threads)
    command = [
        sys.executable,
        "-m",
        module,
        *models_arguments(models, cwd),
        "--port",
        str(port),
        "--device",
        device,
    ]
    if log_level != "info":
        command += ["--log-level", log_level]
    if log is None:
        process = subprocess.Popen(command, cwd=cwd, env=env)
    else:
        with log.open("ab") as output:
            process = subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=subprocess.STDOUT)
    url = ServerURL(f"http://127.0.0.1:{port}")
    url.pid = process.pid
    try:
        deadline = time.monotonic() + start_timeout_s
        while not _healthy(url):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {url} did not start" + (f" (its log: {log})" if log else ""))
            time.sleep(0.1)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(60)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


@dataclass
class Record:
    """One request's timings in seconds from when it was sent."""

    e2el: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0

    @property
    def itl(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


async def _send(client: httpx.AsyncClient, path: str, body: dict) -> Record:
    record, start = Record(), time.perf_counter()
    if not body.get("stream"):
        response = await client.post(path, json=body)
        response.raise_for_status()
        record.e2el = time.perf_counter() - start
        record.output_tokens = response.json().get("usage", {}).get("completion_tokens", 0)
        return record
    async with client.stream("POST", path, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk["text"]:
                record.chunk_times.append(time.perf_counter() - start)
            if chunk.get("usage"):
                record.output_tokens = chunk["usage"]["completion_tokens"]
    record.e2el = time.perf_counter() - start
    record.ttft = record.chunk_times[0] if record.chunk_times else None
    return record


def run_load(url: str, path: str, bodies: list[dict], concurrency: int) -> tuple[list[Record], float]:
    """Send the bodies with at most ``concurrency`` in flight; the records (in the bodies' order) and the wall time of
    the run. Each of the ``concurrency`` workers is one client with one connection, taking the next body when its
    last request has ended, as that many users would. One client whose pool holds every connection costs far more:
    httpcore walks its pool for every request it queues and every connection it frees, 4.2 M ``is_idle`` calls for
    384 requests at 64, and the load generator then took ~70 us of CPU per generated token of a whole answer, on
    the cores the server runs on (with one client per worker, below 10)."""

    async def main() -> tuple[list[Record], float]:
        records: list[Record | None] = [None] * len(bodies)
        pending = iter(enumerate(bodies))

        tls = ssl.create_default_context()  # one for all: each client would load the CA store anew (50 ms)

        async def worker() -> None:
            async with httpx.AsyncClient(
                base_url=url, timeout=600, limits=httpx.Limits(max_connections=1), verify=tls
            ) as client:
                for index, body in pending:
                    records[index] = await _send(client, path, body)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
        return records, time.perf_counter() - start

    return asyncio.run(main())


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear between ranks, as numpy's default."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ms(values: list[float], q: float) -> str:
    return f"{1e3 * percentile(values, q):.1f}" if values else "-"


def histogram_totals(url: str, name: str, model: str) -> tuple[float, float]:
    """(sum, count) of one model's histogram on the server's /metrics."""
    totals = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f'{name}_{part}{{model_name="{model}"}}'):
                totals[part] = float(line.rsplit(" ", 1)[1])
    return totals.get("sum", 0.0), totals.get("count", 0.0)
