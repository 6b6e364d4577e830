"""The stub server's patch (every model it loads answers zeros) must reach only the processes that run it: a
benchmark that imports the harness (one that imported the stub module would measure the stub's rates for the real
models) loads real models."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_engine_benchmark_leaves_model_loading_alone() -> None:
    code = (
        "from server.models import store as model_store; original = model_store.load_served_model; "
        "import benchmarks.serve.engine.bench_engine_loop; "
        "assert model_store.load_served_model is original, model_store.load_served_model"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
