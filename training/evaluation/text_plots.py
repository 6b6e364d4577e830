"""``text-eval --plots``: PNGs of last-token perplexity against context length and of the
receptive field (cumulative gradient-norm share against position, as the RegularGPT paper's Fig. 4); with ``--probe
passkey`` and ``--probe retrieval`` the needle heat map (accuracy by prompt size and needle depth; retrieval: per value
family too)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from training.data.retrieval import value_family
from training.evaluation.plots import save_figure  # its import selects the file-only Agg backend before any figure


def _label(report: dict[str, Any]) -> str:
    return f"{report['architecture']} ({Path(report['checkpoint']).name})"


def plot_perplexity(reports: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """x = context length (log scale, marked in multiples of L_tr), y = last-token perplexity."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for report in reports:
        rows = report["perplexity"]
        axes.plot(
            [row["length"] for row in rows], [row["perplexity"] for row in rows], marker="o", label=_label(report)
        )
    rows = reports[0]["perplexity"]
    values = [row["perplexity"] for report in reports for row in report["perplexity"]]
    if max(values) > 10 * min(values):  # an exploding baseline would flatten the others
        axes.set_yscale("log")
    axes.set_xscale("log", base=2)
    axes.set_xticks([row["length"] for row in rows], [f"{row['length']}\n({row['multiple']:g}x)" for row in rows])
    axes.set_xlabel(f"context length (multiples of L_tr = {reports[0]['train_length']})")
    axes.set_ylabel(f"last-token perplexity ({reports[0]['targets']} targets)")
    axes.set_title(f"length extrapolation on {reports[0]['corpus']} (held-out text)")
    save_figure(figure, axes, path)


def plot_receptive_field(reports: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """x = input position, y = share of the last token's gradient norm on positions >= x (1 at position 0)."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for report in reports:
        field = report["receptive_field"]
        if field is not None:
            label = f"{_label(report)}, {field['windows']} windows"
            axes.plot(range(field["length"]), field["cumulative"], label=label)
    axes.set_xlabel("position in the window (the predicting token is the last)")
    axes.set_ylabel("cumulative gradient-norm share")
    axes.set_ylim(0, 1.02)
    axes.set_title("receptive field (cumulative gradient analysis, Chi et al. 2022b)")
    save_figure(figure, axes, path)


def plot_passkey(reports: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """The needle heat map: one panel per checkpoint and filler (retrieval: and split and value family), rows =
    needle depth, columns = prompt size, colour = accuracy (red 0 .. green 1), each cell marked right/total; skipped
    sizes grey."""
    from training.evaluation.passkey_probe import size_label

    panels = [
        (report, filler, family)
        for report in reports
        for filler in report["fillers"]
        for family in (_families(report) if report.get("probe") == "retrieval" else [None])
    ]
    columns = min(len(panels), 2 if len(panels) < 6 else 3)
    rows = -(-len(panels) // columns)
    figure, axes_grid = plt.subplots(rows, columns, figsize=(6 * columns, 3.6 * rows), squeeze=False)
    for axes, (report, filler, family) in zip(axes_grid.flat, panels):
        sizes = filler["sizes"]
        depths = [row["depth"] for row in sizes[0]["depths"]]
        counts = [[_cell(row, d, family) for row in sizes] for d in range(len(depths))]  # (depths, sizes)
        accuracy = np.ma.masked_invalid(
            [[right / total if total else np.nan for right, total in line] for line in counts]
        )
        colours = plt.get_cmap("RdYlGn").with_extremes(bad="lightgrey")
        image = axes.imshow(accuracy, cmap=colours, vmin=0, vmax=1, aspect="auto")
        for d, line in enumerate(counts):
            for s, (right, total) in enumerate(line):
                text = f"{right}/{total}" if total else "skipped" if sizes[s]["skipped"] else "-"
                axes.text(s, d, text, ha="center", va="center", fontsize="small")
        axes.set_xticks(range(len(sizes)), [size_label(row["size"]) for row in sizes])
        axes.set_yticks(range(len(depths)), [f"{depth:g}" for depth in depths])
        axes.set_xlabel("prompt size (tokens)")
        axes.set_ylabel("needle depth")
        split = f", {report['split']} split" if "split" in report else ""
        values = f", {family}s" if family else ""
        axes.set_title(f"{_label(report)}, filler {filler['filler']}{split}{values}", fontsize="medium")
        figure.colorbar(image, ax=axes, label="accuracy")
    for axes in list(axes_grid.flat)[len(panels) :]:
        axes.set_visible(False)
    probe = "retrieval" if reports[0].get("probe") == "retrieval" else "pass key"
    figure.suptitle(f"{probe}: greedy answers, {reports[0]['trials']} per size, depth and filler")
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)


def _families(report: dict[str, Any]) -> list[str]:
    """A retrieval report's value families ("number" for number-4 ...), in the order of its formats."""
    return list(dict.fromkeys(map(value_family, report["formats"])))


def _cell(row: dict[str, Any], depth: int, family: str | None) -> tuple[int, int]:
    """right, total of one size's ``depth``-th entry: all its trials, or those of one value family."""
    cell = row["depths"][depth]
    if family is None:
        return cell["right"], cell["total"]
    trials = [trial for trial in cell["trials"] if value_family(trial["format"]) == family]
    return sum(trial["right"] for trial in trials), len(trials)
