"""``eval --plot PATH``: final-label accuracy against input length, one line per checkpoint and distribution."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def plot_accuracy(reports: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> None:
    """Write a PNG: x = the middle of each length band, y = accuracy, from the eval reports (evaluate.py)."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for report in reports:
        for p_one in dict.fromkeys(band["p_one"] for band in report["bands"]):  # in order, once each
            bands = [band for band in report["bands"] if band["p_one"] == p_one]
            middles = [(band["lengths"][0] + band["lengths"][1]) / 2 for band in bands]
            label = f"{report['architecture']} {report['checkpoint']}"
            if p_one is not None:
                label += f" (P(1)={p_one:g})"
            axes.plot(middles, [100 * band["accuracy"] for band in bands], marker="o", label=label)
    axes.set_xlabel("input length (band middle)")
    axes.set_ylabel("final-label accuracy (%)")
    axes.set_ylim(0, 101)
    axes.set_title(f"{reports[0]['task']}, protocol {reports[0]['protocol']}")
    save_figure(figure, axes, path)


def save_figure(figure: Figure, axes: Axes, path: str | os.PathLike[str]) -> None:
    """Grid, legend, tight layout, then write ``figure`` to ``path`` as PNG and free it."""
    axes.grid(alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)
