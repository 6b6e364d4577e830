"""``text-eval --plots``: PNGs of last-token perplexity against context length and of the
receptive field (cumulative gradient-norm share against position, as regulargpt.txt Fig. 4)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from training.plots import save_figure  # its import selects the file-only Agg backend before any figure


def _label(report: dict[str, Any]) -> str:
    return f"{report['architecture']} ({Path(report['checkpoint']).name})"


def plot_perplexity(reports: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    """x = context length (log scale, marked in multiples of L_tr), y = last-token perplexity."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for report in reports:
        rows = report["perplexity"]
        axes.plot([row["length"] for row in rows], [row["perplexity"] for row in rows], marker="o",
                  label=_label(report))
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


def plot_receptive_field(reports: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
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
