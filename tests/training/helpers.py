"""Helpers shared by the tests of the training command line (test_train_cli.py, test_cuda.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from training.loop import LOG_FILE

REPO = Path(__file__).resolve().parents[2]
TINY_LRNN = ["--arch", "lrnn", "--d-model", "8", "--block-size", "2", "--num-blocks", "2", "--d-ff", "16"]
TINY_RUN = ["--batch-size", "4", "--eval-lengths", "41-60", "--eval-samples", "6", "--no-progress"]


def read_log(folder: Path) -> list[dict]:
    """The records of a run's train.jsonl."""
    return [json.loads(line) for line in (folder / LOG_FILE).read_text().splitlines()]


def run_module(*arguments: str) -> subprocess.CompletedProcess:
    """``python *arguments`` from the repository root, one OpenMP thread, output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *arguments], cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
