"""Rows of docs/results.md from ``python -m training eval --json`` reports: one row per checkpoint, one column
per protocol part (papers lengths; hard lengths with the task's generator, P(1) = 0.1 and P(1) = 0.9), each the
overall accuracy over that part's bands and, in brackets, its worst band.

    python -m benchmarks.accuracy.results_table runs/eval/parity_check-lrnn-papers.json
        runs/eval/parity_check-lrnn-hard.json ...
    python -m benchmarks.accuracy.results_table --pivot runs/eval/t1-*-papers.json

``--by-p-one`` prints one row per report and one column per P(1) of its bands (the layout of Table 2 of Chi et al.
2023, for ``eval --lengths A-B --bands 1 --p-one 0.1 --p-one 0.3 ...`` reports).

``--pivot`` prints the papers-protocol accuracy as a task x model grid instead (the layout of Table 1 of Chi et al.
2023), the model being what follows the task in the run folder's name less a seed suffix (``t1-parity_check-lstm``
and ``t1-parity_check-lstm-s1`` -> ``lstm``). A cell of one run is its accuracy; of several (seeds), the papers' "max /
avg" with the number of runs in brackets.

Reports of the same checkpoint (its ``checkpoint`` path) are merged into one row; the checkpoint's training
metadata (steps, wall time, parameters) is read from its folder when it is still there.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors import safe_open

from model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, read_config

PARTS = (("papers", None), ("hard", None), ("hard", 0.1), ("hard", 0.9))


def _pooled(bands: Sequence[dict[str, Any]]) -> float:
    """Accuracy over all the samples of ``bands`` (NaN for none)."""
    samples = sum(band["samples"] for band in bands)
    return sum(band["accuracy"] * band["samples"] for band in bands) / samples if samples else math.nan


def part_cell(report: dict[str, Any], p_one: float | None) -> str:
    """``overall % (worst band %)`` over the bands of ``report`` sampled with ``p_one``."""
    bands = [band for band in report["bands"] if band["p_one"] == p_one]
    if not bands:
        return "-"
    worst = min(band["accuracy"] for band in bands)
    return f"{100 * _pooled(bands):.1f} ({100 * worst:.1f})"


def training_cells(checkpoint: Path) -> list[str]:
    """Steps run, wall time and parameter count from the checkpoint folder, or dashes when it is gone."""
    if not (checkpoint / CONFIG_FILE).exists():
        return ["-", "-", "-"]
    metadata = read_config(checkpoint).metadata
    with safe_open(checkpoint / WEIGHTS_FILE, framework="pt") as weights:
        parameters = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118 (safe_open is not iterable)
    return [str(metadata["steps"]), f"{metadata['wall_time_s']:.0f}", f"{parameters:,}"]


def rows(reports: Sequence[dict[str, Any]]) -> list[str]:
    by_checkpoint: dict[str, dict[str, dict[str, Any]]] = {}
    for report in reports:
        by_checkpoint.setdefault(report["checkpoint"], {})[report["protocol"]] = report
    lines = []
    for checkpoint, protocols in by_checkpoint.items():
        first = next(iter(protocols.values()))
        cells = [part_cell(protocols[protocol], p_one) if protocol in protocols else "-" for protocol, p_one in PARTS]
        lines.append(
            f"| {first['task']} | {first['architecture']} | `{Path(checkpoint).name}` | "
            + " | ".join(cells + training_cells(Path(checkpoint)))
            + " |"
        )
    return lines


def pivot(reports: Sequence[dict[str, Any]]) -> list[str]:
    """Task x model grid of papers-protocol accuracy (%), tasks in the order of docs/api.md, Tasks; seeds of a model
    pooled as max / avg."""
    from training.data.tasks import TASKS

    cells: dict[str, dict[str, list[float]]] = {}
    for report in reports:
        if report["protocol"] == "papers":
            model = Path(report["checkpoint"]).name.split(report["task"] + "-", 1)[-1]
            model = re.sub(r"-s\d+$", "", model)  # seeds of one model share a cell
            cells.setdefault(report["task"], {}).setdefault(model, []).append(100 * report["overall"])
    models = sorted({model for row in cells.values() for model in row})
    lines = ["| task | " + " | ".join(models) + " |", "|---|" + "---:|" * len(models)]
    for task in (name for name in TASKS if name in cells):
        lines.append(f"| {task} | " + " | ".join(seed_cell(cells[task].get(model, [])) for model in models) + " |")
    return lines


def seed_cell(accuracies: Sequence[float]) -> str:
    """``-`` for no run, ``a`` for one, ``max / avg (n)`` for n runs."""
    if not accuracies:
        return "-"
    if len(accuracies) == 1:
        return f"{accuracies[0]:.1f}"
    return f"{max(accuracies):.1f} / {sum(accuracies) / len(accuracies):.1f} ({len(accuracies)})"


def by_p_one(reports: Sequence[dict[str, Any]]) -> list[str]:
    """One row per report (checkpoint and lengths), one accuracy (%) column per P(1)."""
    p_ones = sorted({band["p_one"] for report in reports for band in report["bands"] if band["p_one"] is not None})
    lines = [
        "| model | run | lengths | " + " | ".join(f"P(1)={p:g}" for p in p_ones) + " |",
        "|---|---|---|" + "---:|" * len(p_ones),
    ]
    for report in reports:
        accuracy = {p: 100 * _pooled([band for band in report["bands"] if band["p_one"] == p]) for p in p_ones}
        lengths = sorted({tuple(band["lengths"]) for band in report["bands"]})
        span = f"{lengths[0][0]}-{lengths[-1][1]}"
        lines.append(
            f"| {report['architecture']} | `{Path(report['checkpoint']).name}` | {span} | "
            + " | ".join("-" if math.isnan(accuracy[p]) else f"{accuracy[p]:.1f}" for p in p_ones)
            + " |"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="eval --json outputs (one checkpoint each)")
    parser.add_argument("--pivot", action="store_true", help="a task x model grid of the papers protocol")
    parser.add_argument("--by-p-one", action="store_true", help="one column per P(1) of the reports' bands")
    args = parser.parse_args(argv)
    reports = []
    for path in args.reports:
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError) as error:  # e.g. the empty output of an evaluation that was stopped
            print(f"skipping {path}: not an eval --json report ({error})", file=sys.stderr)
    if args.pivot or args.by_p_one:
        print("\n".join(pivot(reports) if args.pivot else by_p_one(reports)))
        return 0
    print(
        "| task | model | run | 41-500 (papers) | 501-2000 | 501-2000, P(1)=0.1 | 501-2000, P(1)=0.9 | steps | "
        "train wall (s) | parameters |"
    )
    print("|---|---|---|---|---|---|---|---:|---:|---:|")
    print("\n".join(rows(reports)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
