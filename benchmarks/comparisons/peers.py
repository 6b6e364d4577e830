"""Our LRNN, RegularGPT and transformer against Hugging Face GPT-2 (KV cache) and Mamba.

Every system (benchmarks/comparisons/peer_systems.py: which, at which sizes, driven how) runs with random fp32 weights,
no grad, on random tokens:

- decode at batch 1: the median step after a cache filled with ``short`` (1k) and ``long`` (8k) tokens;
- tokens/s at batch 32: decode steps of 32 rows at the short context (one row's filled cache repeated 32 times:
  a step's cost does not depend on the values);
- prefill tokens/s: ``prefill`` (8k) tokens into an empty cache, batch 1;
- cache bytes after the short and long contexts (ours ``cache.nbytes``, Hugging Face's the tensors in its cache).

Each figure is set against a floor measured in the same run: at batch 1 the fp32 weight bytes over the memory
bandwidth (a 256 MiB copy, counted as 512 MiB moved, read and write, as STREAM does), at batch 32 two FLOPs per
parameter per token over the rate of a 2048^3 fp32 matmul (each the best of 5). A "targets" block says which of
the peer targets of docs/benchmarks.md this run meets; each is a ratio of two figures of the run.

Every cell (system x size x measurement, and the floors) runs in a fresh process (benchmarks/isolated.py); a
repeat runs every cell once, alternating the systems within each measurement (their order rotates by one each
repeat), and the tables hold the median of the repeats.

    python -m benchmarks.comparisons.peers [--sizes s,L] [--systems lrnn,gpt2,lrnn=mamba,...] [--repeats 5]
        [--threads 1] [--device cpu|cuda] [--json results.json] [--quick]

On a CPU that other processes share keep --threads 1 (benchmarks/models/bench_decode.py says why).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from benchmarks.comparisons.peer_systems import OURS, PEERS, SIZES, build_system, describe, label, system_config
from benchmarks.isolated import banner, child_main, run_isolated, time_calls
from model.device import resolve_device

STEPS, STEP_BUDGET_S = 32, 10.0  # timed decode steps per cell, fewer past the budget
POSITION_MARGIN = 256  # GPT-2's position table covers the longest context plus the steps taken after it


@dataclass(frozen=True)
class Plan:
    """What one run measures."""

    sizes: tuple[str, ...] = ("s", "L")
    systems: tuple[str, ...] = (*OURS, *PEERS, "lrnn=gpt2", "lrnn=mamba", "regulargpt=mamba", "transformer=mamba")
    short: int = 1024
    long: int = 8192
    batch: int = 32
    prefill: int = 8192
    repeats: int = 5
    threads: int = 1
    device: str = "cpu"
    copy_bytes: int = 256 * 2**20  # the bandwidth floor's copy
    matmul_size: int = 2048  # the FLOP floor's matmul
    large: str = "L"  # the sizes the targets read
    small: str = "s"

    @property
    def cells(self) -> list[tuple[str, int, int]]:
        """(measurement, context or prompt length, batch) in the order a repeat runs them."""
        return [
            ("decode", self.short, 1),
            ("decode", self.long, 1),
            ("decode", self.short, self.batch),
            ("prefill", self.prefill, 1),
        ]


QUICK = Plan(
    sizes=("tiny",),
    short=64,
    long=256,
    batch=4,
    prefill=256,
    repeats=1,
    copy_bytes=2**24,
    matmul_size=256,
    large="tiny",
    small="tiny",
)


# --- one cell, in its own process ---------------------------------------------------------------------------------


def measure(case: dict) -> dict:
    """In the child: one cell. ``case``: system, size, measurement ("floors", "decode" or "prefill"), length,
    batch, positions (GPT-2's table), device, copy_bytes and matmul_size (the floors). Returns seconds (per step,
    or for the whole prefill) and what else the cell knows."""
    device = resolve_device(case["device"])
    if case["measurement"] == "floors":
        return {
            "copy_gb_per_s": copy_bandwidth(device, case["copy_bytes"]),
            "matmul_gflop_per_s": matmul_rate(device, case["matmul_size"]),
        }
    size = SIZES[case["size"]]
    runner, count = build_system(case["system"], case["size"], case["positions"], device)
    tokens = torch.randint(0, size.vocab, (1, case["length"]), device=device)
    result = {"parameters": count}
    if case["measurement"] == "prefill":
        runner.prefill(tokens[:, :64])  # warm-up
        result["seconds"] = seconds(lambda: runner.prefill(tokens), device)
        return result
    cache = runner.prefill(tokens)
    if case["batch"] > 1:
        cache = runner.repeat(cache, case["batch"])
    result["cache_bytes"] = runner.cache_bytes(cache)
    token = torch.randint(0, size.vocab, (case["batch"],), device=device)

    def step() -> None:
        nonlocal cache
        _, cache = runner.step(token, cache)

    times, _ = time_calls(step, device, STEPS, STEP_BUDGET_S)
    result["seconds"] = statistics.median(times)
    return result


def seconds(call: Callable[[], object], device: torch.device) -> float:
    """Wall-clock seconds of one call (the device's queue drained before and after)."""
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """GB/s of the best of ``repeats`` copies of ``nbytes`` after a warm-up, counting the bytes read and written."""
    source = torch.randn(nbytes // 4, device=device)
    target = torch.empty_like(source)
    target.copy_(source)
    best = min(seconds(lambda: target.copy_(source), device) for _ in range(repeats))
    return 2 * nbytes / best / 1e9


def matmul_rate(device: torch.device, size: int, repeats: int = 5) -> float:
    """GFLOP/s of the best of ``repeats`` size^3 fp32 matmuls after a warm-up."""
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    a @ b
    best = min(seconds(lambda: a @ b, device) for _ in range(repeats))
    return 2 * size**3 / best / 1e9


# --- the run, in the parent ---------------------------------------------------------------------------------------

Key = tuple[str, str, str, int, int]  # system, size, measurement, length, batch
RunCell = Callable[[dict], dict]


def isolated(case: dict) -> dict:
    """A cell in a fresh process; a failure is recorded (its traceback is on stderr) instead of ending the run."""
    try:
        return run_isolated("benchmarks.comparisons.peers", case)
    except RuntimeError as error:
        return {"oom": False, "error": str(error)}


def run(plan: Plan, run_cell: RunCell = isolated, log: Callable[[str], None] = print) -> dict[Key, list[dict]]:
    """Every cell of ``plan``, ``plan.repeats`` times: per repeat the floors, then per size and measurement every
    system once (the systems' order rotates by one each repeat)."""
    results: dict[Key, list[dict]] = {}
    positions = max(plan.long, plan.prefill) + POSITION_MARGIN
    base = {
        "device": plan.device,
        "threads": plan.threads,
        "positions": positions,
        "copy_bytes": plan.copy_bytes,
        "matmul_size": plan.matmul_size,
    }
    total = plan.repeats * (1 + len(plan.sizes) * len(plan.cells) * len(plan.systems))
    done, start = 0, time.monotonic()
    for repeat in range(plan.repeats):
        shift = repeat % len(plan.systems)
        systems = plan.systems[shift:] + plan.systems[:shift]
        keys = [("floors", "", "floors", 0, 0)]
        keys += [(system, size, *cell) for size in plan.sizes for cell in plan.cells for system in systems]
        for key in keys:
            system, size, measurement, length, batch = key
            case = {
                **base,
                "system": system,
                "size": size,
                "measurement": measurement,
                "length": length,
                "batch": batch,
            }
            result = {**run_cell(case), "load": os.getloadavg()[0]}  # the 1-minute load average as the cell ends
            results.setdefault(key, []).append(result)
            done += 1
            log(f"[{done}/{total}, {time.monotonic() - start:.0f} s] {' '.join(map(str, key))}: {result}")
    return results


def median(results: dict[Key, list[dict]], key: Key, field: str) -> float | None:
    return median_or_none([run[field] for run in results.get(key, []) if field in run])


def median_or_none(values: list[float | None]) -> float | None:
    values = [value for value in values if value is not None]
    return statistics.median(values) if values else None


class Figures:
    """The medians of a run and the floors they are read against."""

    def __init__(self, plan: Plan, results: dict[Key, list[dict]]) -> None:
        self.plan, self.results = plan, results
        self.bandwidth = median(results, ("floors", "", "floors", 0, 0), "copy_gb_per_s")
        self.matmul = median(results, ("floors", "", "floors", 0, 0), "matmul_gflop_per_s")

    def value(self, system: str, size: str, measurement: str, length: int, batch: int, field: str) -> float | None:
        return median(self.results, (system, size, measurement, length, batch), field)

    def step_ms(self, system: str, size: str, context: int) -> float | None:
        seconds = self.value(system, size, "decode", context, 1, "seconds")
        return None if seconds is None else 1e3 * seconds

    def batch_tokens_per_s(self, system: str, size: str) -> float | None:
        seconds = self.value(system, size, "decode", self.plan.short, self.plan.batch, "seconds")
        return None if seconds is None else self.plan.batch / seconds

    def prefill_tokens_per_s(self, system: str, size: str) -> float | None:
        seconds = self.value(system, size, "prefill", self.plan.prefill, 1, "seconds")
        return None if seconds is None else self.plan.prefill / seconds

    def parameters(self, system: str, size: str) -> int | None:
        for key, runs in self.results.items():
            counts = [run["parameters"] for run in runs if key[:2] == (system, size) and "parameters" in run]
            if counts:
                return counts[0]
        return None

    def bandwidth_floor_ms(self, system: str, size: str) -> float | None:
        """Batch 1: the fp32 weights read once at the measured bandwidth."""
        count = self.parameters(system, size)
        return None if count is None or not self.bandwidth else 1e3 * 4 * count / (self.bandwidth * 1e9)

    def flop_floor_tokens_per_s(self, system: str, size: str) -> float | None:
        """Batch 32: 2 FLOPs per parameter per token at the measured matmul rate."""
        count = self.parameters(system, size)
        return None if count is None or not self.matmul else self.matmul * 1e9 / (2 * count)

    def cache_kib(self, system: str, size: str, context: int) -> float | None:
        """One row's cache after ``context`` tokens."""
        nbytes = self.value(system, size, "decode", context, 1, "cache_bytes")
        return None if nbytes is None else nbytes / 2**10

    def status(self, system: str, size: str, measurement: str, length: int, batch: int) -> str:
        """What a cell without a figure shows: "OOM", "failed" or "-" (not run)."""
        runs = self.results.get((system, size, measurement, length, batch), [])
        if any(r.get("oom") for r in runs):
            return "OOM"
        return "failed" if runs else "-"


def short_length(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


def number(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(figures: Figures, size: str) -> list[str]:
    plan = figures.plan
    short, long, batch, prefill = (short_length(n) for n in (plan.short, plan.long, plan.batch, plan.prefill))
    header = (
        f"| system | config | parameters | decode {short} (ms) | decode {long} (ms) | batch-1 floor (ms) | "
        f"batch {batch} at {short} (tok/s) | batch-{batch} floor (tok/s) | prefill {prefill} (tok/s) | "
        f"cache {short} (KiB) | cache {long} (KiB) |"
    )
    lines = [header, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for system in plan.systems:
        family, config = system_config(system, size)
        floor_ms, floor_tps = figures.bandwidth_floor_ms(system, size), figures.flop_floor_tokens_per_s(system, size)
        steps = []
        for context in (plan.short, plan.long):
            ms = figures.step_ms(system, size, context)
            steps.append(with_share(ms, ratio(floor_ms, ms), 2) or figures.status(system, size, "decode", context, 1))
        tps = figures.batch_tokens_per_s(system, size)
        batch_cell = with_share(tps, ratio(tps, floor_tps), 0) or figures.status(
            system, size, "decode", plan.short, plan.batch
        )
        prefill_tps = figures.prefill_tokens_per_s(system, size)
        prefill_cell = number(prefill_tps) if prefill_tps else figures.status(system, size, "prefill", plan.prefill, 1)
        kib = [figures.cache_kib(system, size, n) for n in (plan.short, plan.long)]
        lines.append(
            f"| {label(system)} | {describe(family, config)} | {number(figures.parameters(system, size))} | "
            f"{steps[0]} | {steps[1]} | {number(floor_ms, 2)} | {batch_cell} | {number(floor_tps)} | "
            f"{prefill_cell} | {number(kib[0], 1)} | {number(kib[1], 1)} |"
        )
    return lines


def with_share(value: float | None, of_floor: float | None, digits: int) -> str:
    """``value`` and, in brackets, the share of its floor it reaches ("" without a value)."""
    if value is None:
        return ""
    return f"{value:,.{digits}f}" + ("" if of_floor is None else f" ({100 * of_floor:.0f}%)")


@dataclass(frozen=True)
class Target:
    """One of the peer targets of docs/benchmarks.md: met when every ratio reaches the threshold."""

    text: str
    ratios: tuple[tuple[str, float | None], ...]  # (what, measured ratio)
    threshold: float

    @property
    def met(self) -> bool | None:
        """None when a figure is missing."""
        values = [ratio for _, ratio in self.ratios]
        return None if None in values else min(values) >= self.threshold

    def line(self, repeats_met: tuple[int, int] | None = None) -> str:
        """The target's line; ``repeats_met``: in how many of how many repeats, each read alone, it was met."""
        verdict = {None: "not measured", True: "met", False: "missed"}[self.met]
        shown = ", ".join(f"{what} {number(ratio, 2)}".strip() for what, ratio in self.ratios)
        alone = f"; met in {repeats_met[0]} of {repeats_met[1]} repeats alone" if repeats_met else ""
        return f"- {verdict}: {self.text} (need >= {self.threshold:g}; {shown}{alone})"


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def targets(figures: Figures) -> list[Target]:
    """The peer targets of docs/benchmarks.md, each a set of ratios of this run's figures that must all reach a
    threshold."""
    f, plan = figures, figures.plan
    large, small = plan.large, plan.small
    contexts = [(short_length(n), n) for n in (plan.short, plan.long)]
    step, tps, prefill = f.step_ms, f.batch_tokens_per_s, f.prefill_tokens_per_s
    long = short_length(plan.long)
    equal_width = ratio(step("gpt2", large, plan.long), step("lrnn", large, plan.long))
    return [
        Target(
            f"LRNN {large}: batch-1 step at 80% of the bandwidth floor or more (floor time / step time)",
            tuple((c, ratio(f.bandwidth_floor_ms("lrnn", large), step("lrnn", large, n))) for c, n in contexts),
            0.8,
        ),
        Target(
            f"LRNN {large}: batch {plan.batch} at half the FLOP floor or more (tokens/s / floor)",
            (("", ratio(tps("lrnn", large), f.flop_floor_tokens_per_s("lrnn", large))),),
            0.5,
        ),
        Target(
            f"LRNN {large} at Mamba's parameter count faster than Mamba {large} (Mamba's time / ours)",
            (
                *((f"batch 1 {c}", ratio(step("mamba", large, n), step("lrnn=mamba", large, n))) for c, n in contexts),
                (f"batch {plan.batch}", ratio(tps("lrnn=mamba", large), tps("mamba", large))),
            ),
            1.0,
        ),
        Target(
            f"LRNN {large} at GPT-2's parameter count >= 3x GPT-2 {large} at {long} context, batch 1 (GPT-2's step / "
            f"ours; at equal d_model {number(equal_width, 2)})",
            (("", ratio(step("gpt2", large, plan.long), step("lrnn=gpt2", large, plan.long))),),
            3.0,
        ),
        Target(
            f"RegularGPT {small}: batch-1 decode within 2x of LRNN {small} (LRNN's step / RegularGPT's)",
            tuple((c, ratio(step("lrnn", small, n), step("regulargpt", small, n))) for c, n in contexts),
            0.5,
        ),
        Target(
            f"RegularGPT {small}: prefill of {short_length(plan.prefill)} at half GPT-2 {small}'s tokens/s or more",
            (("", ratio(prefill("regulargpt", small), prefill("gpt2", small))),),
            0.5,
        ),
    ]


def report(plan: Plan, results: dict[Key, list[dict]]) -> str:
    """The floors, a table per size and the targets: on the medians, and how often each target is met by the
    repeats read one at a time."""
    figures = Figures(plan, results)
    floors = (
        f"floors (median of {plan.repeats}): copy {number(figures.bandwidth, 1)} GB/s "
        f"({plan.copy_bytes / 2**20:g} MiB, read + write), matmul {number(figures.matmul, 1)} GFLOP/s "
        f"({plan.matmul_size}^3 fp32)"
    )
    loads = sorted(run["load"] for runs in results.values() for run in runs if "load" in run) or [None]
    load = (
        f"load average (1 min) as the cells ended: median {number(median_or_none(loads), 1)}, "
        f"range {number(loads[0], 1)}-{number(loads[-1], 1)}"
    )
    lines = [
        floors,
        load,
        "cells: median of the repeats; (x%): the share of the floor reached (floor time / measured time)",
    ]
    for size in plan.sizes:
        lines += ["", f"### size {size}", "", *table(figures, size)]
    alone = [targets(Figures(plan, one_repeat(results, repeat))) for repeat in range(plan.repeats)]
    lines += ["", "targets (on the medians):"]
    for index, target in enumerate(targets(figures)):
        met = sum(bool(repeat[index].met) for repeat in alone)
        lines.append(target.line((met, plan.repeats) if plan.repeats > 1 else None))
    return "\n".join(lines)


def one_repeat(results: dict[Key, list[dict]], repeat: int) -> dict[Key, list[dict]]:
    """The results of one repeat alone."""
    return {key: runs[repeat : repeat + 1] for key, runs in results.items()}


def save_results(path: str, header: list[str], plan: Plan, results: dict[Key, list[dict]]) -> None:
    with open(path, "w") as out:
        json.dump(
            {"header": header, "plan": asdict(plan), "results": [[*key, runs] for key, runs in results.items()]}, out
        )


def load_results(path: str) -> tuple[list[str], Plan, dict[Key, list[dict]]]:
    """What :func:`save_results` (``--json``) wrote: the header lines, the plan and the results."""
    with open(path) as source:
        saved = json.load(source)
    plan = Plan(**{key: tuple(value) if isinstance(value, list) else value for key, value in saved["plan"].items()})
    return saved.get("header", []), plan, {tuple(entry[:5]): entry[5] for entry in saved["results"]}


def revision() -> str:
    """The commit, and the uncommitted files of the models and this benchmark (other work in the checkout) if any;
    "unknown" outside a git checkout (e.g. a ``git archive`` export, which is how to run a fixed commit while others
    edit the checkout)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    git = functools.partial(subprocess.run, cwd=root, capture_output=True, text=True, check=False)
    try:
        commit = git(["git", "rev-parse", "HEAD"])
        paths = ["model", "benchmarks/comparisons/peers.py", "benchmarks/comparisons/peer_systems.py"]
        dirty = git(["git", "status", "--porcelain", "--", *paths]).stdout.split("\n")
    except OSError:
        return "unknown"
    if commit.returncode:
        return "unknown (not a git checkout)"
    changed = [line[3:] for line in dirty if line.strip()]
    return commit.stdout.strip() + (f" (uncommitted: {', '.join(changed)})" if changed else "")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", help=f"comma-separated, of {sorted(SIZES)} (default s,L)")
    parser.add_argument("--systems", help="comma-separated: lrnn, regulargpt, transformer, gpt2, mamba, OURS=PEER")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per cell (1 on a shared machine)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", help="also write every cell's result of every repeat here")
    parser.add_argument("--report", metavar="JSON", help="print the report of a run that --json wrote, and stop")
    parser.add_argument("--quick", action="store_true", help="the tiny size, short contexts, one repeat: a smoke run")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(measure, args.child)
        return
    if args.report:
        header, plan, results = load_results(args.report)
        print("\n".join([*header, report(plan, results)]))
        return
    plan = replace(QUICK if args.quick else Plan(), threads=args.threads, device=args.device)
    if args.sizes:
        plan = replace(plan, sizes=tuple(args.sizes.split(",")))
    if args.systems:
        plan = replace(plan, systems=tuple(args.systems.split(",")))
    if args.repeats:
        plan = replace(plan, repeats=args.repeats)
    for size in plan.sizes:  # refuse an unknown size or system before the first cell
        if size not in SIZES:
            parser.error(f"unknown size {size!r}; known: {sorted(SIZES)}")
        for system in plan.systems:
            try:
                system_config(system, size)
            except ValueError as error:
                parser.error(str(error))
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    results = run(plan, log=lambda line: print(line, file=sys.stderr, flush=True))
    header = [
        f"{banner(resolve_device(plan.device), plan.threads)}; started {started}; commit {revision()}",
        f"command: python -m benchmarks.comparisons.peers {' '.join(sys.argv[1:] if argv is None else argv)}",
        f"load average (1, 5, 15 min) before {load_before}, after {os.getloadavg()}",
    ]
    print("\n".join([*header, report(plan, results)]))
    if args.json:
        save_results(args.json, header, plan, results)


if __name__ == "__main__":
    main()
