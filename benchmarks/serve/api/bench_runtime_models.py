"""POST /v1/models end to end: how long compiling and installing a runtime model takes against its DFA's states.

For counters modulo n (n states, every one reachable, as DFA JSON; ``automata/samples.py``), each cell
posts the model to an in-process app (``TestClient``, one torch thread, CPU) and reports the wall time of the
request: the compile (DFA -> weights, in a thread of its own) plus the engine's measurement of the new model.
Median of ``--repeats``; each repeat deletes the model again. RegularGPT takes at most 16 states.

    python -m benchmarks.serve.api.bench_runtime_models [--states 10,100,1000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from fastapi.testclient import TestClient

from automata.compiler import MAX_REGULARGPT_MONOID
from automata.samples import counter
from benchmarks.isolated import banner
from server.api.app import create_app
from server.settings import Settings


def post_seconds(client: TestClient, body: dict, repeats: int) -> tuple[float, int]:
    """Median wall time of POST /v1/models with ``body``, and the parameter count of the model."""
    times, parameters = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        response = client.post("/v1/models", json=body)
        times.append(time.perf_counter() - started)
        assert response.status_code == 201, response.text
        parameters = response.json()["parameters"]
        assert client.delete(f"/v1/models/{body['id']}").status_code == 200
    return statistics.median(times), parameters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--states", default="10,100,1000")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        models = Path(folder)
        from tests.server.checkpoints import write_checkpoints  # a small served folder to start from

        write_checkpoints(models)
        settings = Settings(
            models=models,
            shipped_models=False,
            device="cpu",
            torch_threads=1,
            runtime_model_max_states=1024,
            runtime_compile_timeout_s=600,
        )
        app = create_app(settings)
        with TestClient(app) as client:
            app.state.engine.wait_loaded()
            print(banner(torch.device("cpu"), 1))
            print(f"median of {args.repeats} POST /v1/models (compile + measure), in-process\n")
            print("| automaton | states | architecture | POST (s) | parameters |")
            print("|---|---:|---|---:|---:|")
            for states in (int(part) for part in args.states.split(",")):
                for architecture in ("lrnn", "regulargpt"):
                    if architecture == "regulargpt" and states > MAX_REGULARGPT_MONOID:  # counter: n elements
                        continue
                    body = {"id": f"counter{states}", "dfa": counter(states), "architecture": architecture}
                    seconds, parameters = post_seconds(client, body, args.repeats)
                    print(
                        f"| counter mod {states} (DFA JSON) | {states} | {architecture} | {seconds:.3f} | "
                        f"{parameters:,} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
