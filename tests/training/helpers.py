"""Helpers shared by the tests of the training command line (cli/test_train_cli.py, cli/test_text_train.py and
test_cuda.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from training.objectives.checkpointing import LOG_FILE, RESUME_FILE

REPO = Path(__file__).resolve().parents[2]
TINY_LRNN = ["--arch", "lrnn", "--d-model", "8", "--block-size", "2", "--num-blocks", "2", "--d-ff", "16"]
TINY_RUN = ["--batch-size", "4", "--eval-lengths", "41-60", "--eval-samples", "6", "--no-progress"]


def read_log(folder: Path) -> list[dict]:
    """The records of a run's train.jsonl."""
    return [json.loads(line) for line in (folder / LOG_FILE).read_text().splitlines()]


def run_module(*arguments: str) -> subprocess.CompletedProcess:
    """``python *arguments`` from the repository root, one OpenMP thread, output captured."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *arguments], cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )


def edit_resume_state(run: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite the state a run's resume file holds (its JSON metadata) through ``edit``, tensors unchanged: to make
    the file of a run saved by an older build."""
    resume = run / RESUME_FILE
    with safe_open(str(resume), framework="pt") as handle:
        metadata, tensors = handle.metadata(), {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    state = json.loads(metadata["state"])
    edit(state)
    save_file(tensors, str(resume), metadata={**metadata, "state": json.dumps(state)})
