"""Structured outputs' cost per decode step: the time spent on token masks against the decode step time (TPOT).

In the engine, without HTTP, on a shipped text model: 32 sequences run together for ``--tokens`` steps, all
constrained or all free (runs alternate, medians over ``--repeats``). A step's mask time is the CPU time structured
outputs add to it, in the engine's thread and the mask thread that runs beside the model call: the bitmask of every
constrained row from llguidance and its 0/-inf bias (``server.structured.outputs.Masks.run``), adding it
(``server.execution.generation._constrain``) and advancing each matcher past its token (``Constraint.consume``); the
step time is ``DecodeBatch.step`` whole (model call, penalties, masks, sampling, detokenizing). The end-of-text
token's logit is lowered by 100 and the patterns cannot end sooner, so every measured step holds 32 rows.

    python -m benchmarks.serve.engine.bench_structured [--model checkpoints/text-lrnn] [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import server.execution.generation
import server.structured.outputs
from benchmarks.serve.harness import ROOT, machine
from server.api.protocol import StructuredOutputs
from server.engine.engine import Engine
from server.execution.generation import DecodeBatch, GenerationRequest
from server.execution.sampling import SamplingParams
from server.metrics import ServerMetrics
from server.settings import Settings
from server.structured.outputs import ConstraintCompiler, MaskBudget

BATCH = 32
CONSTRAINTS = {
    "none": None,
    "letters": {"regex": r"[A-Za-z ,.;'!?]*"},  # thousands of allowed tokens at every step
    "digits": {"regex": r"[0-9]*"},  # a few allowed tokens
    "json": {
        "json": {
            "type": "object",
            "properties": {
                "lines": {
                    "type": "array",
                    "minItems": 40,
                    "items": {
                        "type": "object",
                        "properties": {
                            "who": {"enum": ["Elizabeth", "Darcy", "Jane", "Bingley"]},
                            "says": {"type": "string", "maxLength": 24},
                        },
                        "required": ["who", "says"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["lines"],
        }
    },
    # a long counted repetition: every position is a new lexer state, whose mask is computed afresh
    "letters{400}": {"regex": r"[A-Za-z ,.;'!?]{400}"},
}


class Timer:
    """Wall-clock and CPU seconds (of the calling thread) spent in wrapped calls, while ``on``."""

    def __init__(self) -> None:
        self.on, self.wall, self.cpu, self.calls = False, 0.0, 0.0, 0

    def wrap(self, call: Callable) -> Callable:
        def timed(*args, **kwargs):
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return call(*args, **kwargs)
            finally:
                if self.on:
                    self.wall += time.perf_counter() - wall
                    self.cpu += time.thread_time() - cpu
                    self.calls += 1

        return timed


STEPS, MASKS = Timer(), Timer()


def instrument() -> None:
    """Time DecodeBatch.step (only at the full batch) and the mask work (module docstring) in the engine."""
    step = DecodeBatch.step

    def full_step(batch: DecodeBatch, metrics) -> None:
        STEPS.on = len(batch) == BATCH
        MASKS.on = STEPS.on
        STEPS.wrap(step)(batch, metrics)

    DecodeBatch.step = full_step
    server.execution.generation._constrain = MASKS.wrap(server.execution.generation._constrain)
    server.structured.outputs.Masks.run = MASKS.wrap(
        server.structured.outputs.Masks.run
    )  # on the mask thread, in a decode step
    server.structured.outputs.Constraint.consume = MASKS.wrap(server.structured.outputs.Constraint.consume)


async def run(engine: Engine, served, compiler: ConstraintCompiler, kind: str, tokens: int) -> dict:
    spec = CONSTRAINTS[kind]
    constraint = (
        None if spec is None else await compiler.compile(StructuredOutputs.model_validate(spec), served.tokenizer)
    )
    prompt = served.tokenizer.encode("Chapter 1. It is a truth universally acknowledged")
    never_end = ((served.tokenizer.eot_token, -100.0),)
    requests = [
        GenerationRequest(
            prompt, tokens, SamplingParams(temperature=1.0, seed=seed, logit_bias=never_end), constraint=constraint
        )
        for seed in range(BATCH)
    ]
    for timer in (STEPS, MASKS):
        timer.wall, timer.cpu, timer.calls = 0.0, 0.0, 0
    handle = engine.submit_generation(served, requests)
    texts = [""] * BATCH
    async for index, event in handle.events():
        texts[index] += getattr(event, "text", "")
    if kind == "json":
        assert all(text.startswith('{"lines":[') for text in texts), texts[0]
    steps = max(STEPS.calls, 1)
    return {
        "step_ms": 1000 * STEPS.wall / steps,
        "step_cpu_ms": 1000 * STEPS.cpu / steps,
        "mask_ms": 1000 * MASKS.wall / steps,
        "mask_cpu_ms": 1000 * MASKS.cpu / steps,
        "steps": STEPS.calls,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "checkpoints" / "text-lrnn")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    instrument()
    settings = Settings(
        models=args.model, shipped_models=False, device="cpu", torch_threads=args.threads, max_running=BATCH
    )
    engine = Engine(settings, ServerMetrics())
    engine.start()
    engine.wait_loaded()
    served = engine.models[args.model.name]
    compiler = ConstraintCompiler(
        settings.structured_max_chars, settings.structured_compile_timeout_s, MaskBudget.of(settings)
    )
    print(
        f"machine: {machine()}; torch threads: {args.threads}; {args.model.name}; batch {BATCH}, "
        f"{args.tokens} tokens; vocabulary {served.tokenizer.vocab_size}"
    )
    results: dict[str, list[dict]] = {kind: [] for kind in CONSTRAINTS}
    for _ in range(args.repeats):
        for kind in CONSTRAINTS:
            results[kind].append(asyncio.run(run(engine, served, compiler, kind, args.tokens)))
    engine.stop()
    free = {key: statistics.median(r[key] for r in results["none"]) for key in ("step_ms", "step_cpu_ms")}
    for kind, runs in results.items():
        medians = {key: statistics.median(r[key] for r in runs) for key in runs[0] if key != "steps"}
        print(
            json.dumps(
                {
                    "constraint": kind,
                    **{key: round(value, 3) for key, value in medians.items()},
                    "mask_cpu_us_per_token": round(1000 * medians["mask_cpu_ms"] / BATCH, 1),
                    "mask_cpu_of_tpot": round(medians["mask_cpu_ms"] / medians["step_ms"], 3),
                    "tpot_over_free": round(medians["step_ms"] / free["step_ms"], 3),
                    "step_cpu_over_free": round(medians["step_cpu_ms"] / free["step_cpu_ms"], 3),
                    "steps": [r["steps"] for r in runs],
                }
            )
        )


if __name__ == "__main__":
    main()
