"""The engine core on a thread of the API process against the engine core in a process of its own, alternating in one
run: ``python -m server`` serving a tiny text LRNN whose step is nearly free (d_model 16, one layer, text-lrnn's
tokenizer, random weights), so that what is measured is the server's own cost per token. Per mode and round: output
tokens/s at ``--concurrency`` whole answers and streams, TPOT of one stream (median over its requests), the server's
CPU time per generated token in each concurrent run (user + system, the engine process's included: less noisy than a
rate where other jobs share the machine; in brackets the API process's own), and its resident memory after the
warm-up (the API process, plus the engine process where there is one).

    python -m benchmarks.serve.engine.bench_engine_process [--rounds 2] [--concurrency 64] [--requests 128]
        [--max-tokens 256] [--baseline PATH] [--model FOLDER] [--device cpu|cuda] [--setting NAME=VALUE ...]
        [--path /v1/generate|/v1/completions] [--log-level warning|info|...]

``--model FOLDER``: serve that checkpoint folder instead (e.g. checkpoints/text-lrnn). ``--baseline PATH``: a checkout
of another commit (e.g. a ``git worktree`` of the baseline commit docs/benchmarks.md names), whose
``python -m server`` serves the same model as a third mode, "baseline", in each round.
``--setting batch_invariant=false``: a server setting (REGULARLM_*) of the thread and process modes (not the
baseline's, which may not know it): batch invariance (on by default for LRNNs on the CPU) decodes rows one by one
through the row-wise kernels.
``--path /v1/completions``: the OpenAI route instead of ``/v1/generate`` (streams ask for the usage chunk).
``--log-level``: warning (default) starts each server with ``--log-level warning``; any other level starts it as the
README does, ``python -m server`` with no log option (info) or with that level, its log (uvicorn's access log too,
where it is on) written to a file beside the models.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import ssl
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import torch

from benchmarks.serve.harness import ROOT, Record, child_pids, cpu_seconds, machine, run_load, server_process
from model.checkpoint import save_checkpoint
from model.config import CheckpointConfig, LRNNConfig
from model.registry import build_model

MODEL_ID = "tiny-text-lrnn"


def write_tiny_model(directory: Path) -> Path:
    """A one-layer d16 LRNN with text-lrnn's tokenizer (8,192 tokens), random weights."""
    torch.manual_seed(0)
    config = LRNNConfig(vocab_size=8192, d_model=16, n_layers=1, block_size=8, num_blocks=2, d_ff=64)
    tokenizer = "file:tokenizer.tiktoken"
    checkpoint = CheckpointConfig(architecture="lrnn", model=config, kind="generate", tokenizer=tokenizer)
    folder = save_checkpoint(build_model("lrnn", config), checkpoint, directory / MODEL_ID)
    shutil.copy(ROOT / "checkpoints" / "text-lrnn" / "tokenizer.tiktoken", folder / "tokenizer.tiktoken")
    return directory


def for_baseline(models: Path, baseline: Path, folder: Path) -> Path:
    """A copy of ``models`` (a checkpoint folder, or a folder of them) for the baseline checkout to serve: each
    config.json labelled with the baseline's own ``FORMAT_VERSION`` (read from its model/config.py), which may be
    older than this code's. The keys stay as written and the baseline's loader checks every one: a model with a key
    the baseline does not know, or without one it needs, fails to start there rather than load as something else."""
    found = re.search(r"^FORMAT_VERSION = (\d+)$", (baseline / "model" / "config.py").read_text(), re.MULTILINE)
    if found is None:
        raise SystemExit(f"{baseline}/model/config.py has no FORMAT_VERSION")
    copy = shutil.copytree(models, folder / models.name)  # the same name: a checkpoint folder's is its model id
    for config_file in [*copy.glob("config.json"), *copy.glob("*/config.json")]:
        data = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**data, "format_version": int(found.group(1))}, indent=2))
    return copy


def bodies(model_id: str, count: int, max_tokens: int, stream: bool, path: str = "/v1/generate") -> list[dict]:
    usage = {"stream_options": {"include_usage": True}} if stream and path == "/v1/completions" else {}
    return [
        {
            "model": model_id,
            "prompt": f"Chapter {index}. It was",
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": stream,
            **usage,
        }
        for index in range(count)
    ]


def load(url: str, path: str, bodies: list[dict], concurrency: int) -> tuple[list[Record], float]:
    """harness.run_load's records and wall time; on /v1/completions, with the OpenAI chunks read for streams (each
    worker one client with one connection, as there)."""
    if path == "/v1/generate" or not any(body["stream"] for body in bodies):
        return run_load(url, path, bodies, concurrency)

    async def send(client: httpx.AsyncClient, body: dict) -> Record:
        record, start = Record(), time.perf_counter()
        async with client.stream("POST", path, json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if any(choice["text"] for choice in chunk["choices"]):
                    record.chunk_times.append(time.perf_counter() - start)
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
        record.e2el = time.perf_counter() - start
        record.ttft = record.chunk_times[0] if record.chunk_times else None
        return record

    async def main() -> tuple[list[Record], float]:
        records: list[Record | None] = [None] * len(bodies)
        pending = iter(enumerate(bodies))
        tls = ssl.create_default_context()

        async def worker() -> None:
            limits = httpx.Limits(max_connections=1)
            async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, verify=tls) as client:
                for index, body in pending:
                    records[index] = await send(client, body)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(bodies)))))
        return records, time.perf_counter() - start

    return asyncio.run(main())


def resident_mib(pid: int) -> float:
    """VmRSS of the process and its children (the engine process), MiB."""
    total = 0
    for each in [pid, *child_pids(pid)]:
        for line in Path(f"/proc/{each}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def measure(url: str, model_id: str, args: argparse.Namespace) -> dict[str, float]:
    load(url, args.path, bodies(model_id, args.concurrency, 8, False, args.path), args.concurrency)  # warm-up
    figures = {"rss_mib": resident_mib(url.pid)}
    for stream in (False, True):
        sent = bodies(model_id, args.requests, args.max_tokens, stream, args.path)
        kind = "streams" if stream else "whole"
        used, used_here = cpu_seconds(url.pid, children=True), cpu_seconds(url.pid)
        records, wall = load(url, args.path, sent, args.concurrency)
        tokens = sum(record.output_tokens for record in records)
        figures[kind] = tokens / wall
        figures[f"cpu_{kind}"] = 1e6 * (cpu_seconds(url.pid, children=True) - used) / tokens
        figures[f"api_cpu_{kind}"] = 1e6 * (cpu_seconds(url.pid) - used_here) / tokens
    records, _ = load(url, args.path, bodies(model_id, args.single, args.max_tokens, True, args.path), 1)
    figures["tpot_ms"] = 1e3 * statistics.median(record.tpot for record in records if record.tpot is not None)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128, help="requests of each concurrent run")
    parser.add_argument("--single", type=int, default=8, help="requests sent one at a time for the TPOT")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--baseline", type=Path, help="a checkout whose python -m server is the 'baseline' mode")
    parser.add_argument("--model", type=Path, help="a checkpoint folder to serve instead of the tiny LRNN")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--setting", action="append", default=[], help="NAME=VALUE, a setting of this code's modes")
    parser.add_argument("--path", choices=["/v1/generate", "/v1/completions"], default="/v1/generate")
    parser.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default="warning",
        help="the servers' log level; other than warning: started as the README does (info: no log option)",
    )
    args = parser.parse_args()
    extra = dict(setting.split("=", 1) for setting in args.setting)
    modes = {"thread": {"engine_process": "false", **extra}, "process": {"engine_process": "true", **extra}}
    if args.baseline is not None:
        modes = {"baseline": {}, **modes}
    print(f"# {machine(args.device)}, load {os.getloadavg()[0]:.1f}; {args.path}, log level {args.log_level}")
    print(
        "| round | mode | whole answers tokens/s | streams tokens/s | TPOT one stream (ms) | server CPU us/token, "
        "whole / streams (the API process's share) | RSS (MiB) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory() as baseline_folder:
        models = args.model.resolve() if args.model else write_tiny_model(Path(folder))
        model_id = models.name if args.model else MODEL_ID
        baseline_models = None if args.baseline is None else for_baseline(models, args.baseline, Path(baseline_folder))
        for round_ in range(1, args.rounds + 1):
            for mode, settings in modes.items():
                cwd, served = (args.baseline, baseline_models) if mode == "baseline" else (ROOT, models)
                log = None if args.log_level == "warning" else Path(folder) / f"{mode}.log"
                server = server_process(served, 1, args.device, cwd=cwd, log_level=args.log_level, log=log, **settings)
                with server as url:
                    figures = measure(url, model_id, args)
                print(
                    f"| {round_} | {mode} | {figures['whole']:,.0f} | {figures['streams']:,.0f} | "
                    f"{figures['tpot_ms']:.3f} | {figures['cpu_whole']:.0f} ({figures['api_cpu_whole']:.0f}) / "
                    f"{figures['cpu_streams']:.0f} ({figures['api_cpu_streams']:.0f}) | "
                    f"{figures['rss_mib']:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
