"""Training speed against torch's thread count, on a quiet machine and beside one busy core: the measurement
behind model/threads.py's rule (docs/benchmarks.md, "Thread policy").

Each cell is a fresh ``python -m training`` process training for ``--steps`` steps (no evaluation) with
``--threads N``; "busy" cells run a pure-Python spin loop in another process meanwhile (what a server's event
loop, a data loader or a second job does to the other core). Reported: the trainer's own tokens/s (positions
trained on per second, from its log), median of ``--repeats``.

    python -m benchmarks.models.bench_train_threads [--threads 1,2] [--steps 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.isolated import banner

RUNS = {
    "parity_check LRNN (README recipe)": ["train", "--task", "parity_check", "--arch", "lrnn", "--eval-every", "0"],
    "parity_check RegularGPT d32": [
        "train",
        "--task",
        "parity_check",
        "--arch",
        "regulargpt",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--d-ff",
        "64",
        "--eval-every",
        "0",
    ],
    "text LRNN (shipped shape)": [
        "text-train",
        "--arch",
        "lrnn",
        "--layers",
        "2",
        "--block-size",
        "8",
        "--num-blocks",
        "16",
        "--d-model",
        "128",
        "--d-ff",
        "512",
        "--tokenizer",
        "checkpoints/text-lrnn/tokenizer.tiktoken",
        "--eval-every",
        "0",
    ],
}
SPIN = "import time\nend = time.time() + 3600\nwhile time.time() < end: pass"


def tokens_per_second(arguments: list[str], steps: int, threads: int, busy: bool) -> float:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "run"
        command = [
            sys.executable,
            "-m",
            "training",
            *arguments,
            "--steps",
            str(steps),
            "--threads",
            str(threads),
            "--no-progress",
            "--log-every",
            str(steps),
            "--out",
            str(out),
        ]
        spinner = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
        try:
            subprocess.run(command, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        finally:
            if spinner is not None:
                spinner.kill()
        records = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
        last = [record for record in records if record["event"] == "train"][-1]
        return last["tokens"] / last["elapsed_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="thread counts to compare")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    counts = [int(part) for part in args.threads.split(",")]
    print(banner(torch.device("cpu"), 1).rsplit(", threads", 1)[0] + "; threads: per cell")
    print(f"{args.steps} steps per run, median of {args.repeats}; tokens/s = positions trained on per second\n")
    print("| run | other core | " + " | ".join(f"{count} thread(s)" for count in counts) + " |")
    print("|---|---|" + "---:|" * len(counts))
    for name, arguments in RUNS.items():
        for busy in (False, True):
            cells = []
            for count in counts:
                speeds = [tokens_per_second(arguments, args.steps, count, busy) for _ in range(args.repeats)]
                cells.append(f"{statistics.median(speeds):,.0f}")
            print(f"| {name} | {'busy' if busy else 'idle'} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
