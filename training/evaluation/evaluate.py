"""``python -m training eval``: per-length-band accuracy of a transducer's final label on fresh samples.

A band is a length range and a sampling distribution; band i is drawn from the random stream (seed, i), so every
checkpoint sees the same strings. Protocols and the ``--json`` report: docs/training.md, "eval protocols and report".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from model.checkpoint import LoadedCheckpoint
from training.data.batches import FinalLabelSet, count_correct_final
from training.data.tasks import BHATTAMISHRA_TRAIN_LENGTHS, Task
from training.evaluation.progress import progress_bar

Protocol = Literal["papers", "hard", "induction", "custom"]
NamedProtocol = Literal["papers", "hard", "induction"]  # a protocol with bands of its own (custom: the flags')
HARD_P_ONES = (0.1, 0.9)
BHATTAMISHRA_EVAL_LENGTHS = (51, 100)
DELETANG_EVAL_LENGTHS = (41, 500)
INDUCTION_LENGTHS = tuple(2**k for k in range(6, 21))
INDUCTION_BAND_SYMBOLS = 2**21  # the most symbols of an induction band, while above INDUCTION_MIN_SAMPLES
INDUCTION_MIN_SAMPLES = 4


@dataclass(frozen=True)
class Band:
    lengths: tuple[int, int]  # inclusive
    p_one: float | None = None
    samples: int | None = None  # strings to draw; None: as many as asked for every band
    p_times: float | None = None  # modular_arithmetic: P("*" among operators)


def papers_lengths(task: Task) -> tuple[int, int]:
    """The extrapolation lengths the papers report for ``task``."""
    if task.train_lengths == BHATTAMISHRA_TRAIN_LENGTHS:
        return BHATTAMISHRA_EVAL_LENGTHS
    return DELETANG_EVAL_LENGTHS


def split_lengths(lengths: tuple[int, int], count: int) -> list[tuple[int, int]]:
    """``lengths`` cut into ``count`` consecutive ranges of near-equal width (fewer if it is shorter)."""
    shortest, longest = lengths
    count = min(count, longest - shortest + 1)
    edges = [shortest + (longest - shortest + 1) * i // count for i in range(count + 1)]
    return [(edges[i], edges[i + 1] - 1) for i in range(count)]


def protocol_bands(task: Task, protocol: NamedProtocol, band_count: int, samples: int) -> list[Band]:
    """The bands of a named protocol, each length range of papers and hard (the task's ``hard_lengths``) cut into
    ``band_count`` bands; ``samples`` strings per band (induction: fewer at the longest lengths)."""
    if protocol == "papers":
        return [Band(lengths) for lengths in split_lengths(papers_lengths(task), band_count)]
    if protocol == "induction":
        fitting = {length: max(INDUCTION_MIN_SAMPLES, INDUCTION_BAND_SYMBOLS // length) for length in INDUCTION_LENGTHS}
        return [Band((length, length), samples=min(samples, fitting[length])) for length in INDUCTION_LENGTHS]
    lengths = [band for hard in task.hard_lengths for band in split_lengths(hard, band_count)]
    return [Band(band, p_one) for p_one in (None, *HARD_P_ONES) for band in lengths]


def draw_bands(
    task: Task, bands: Sequence[Band], samples: int, seed: int, power_offsets: bool = False
) -> list[FinalLabelSet]:
    """``samples`` fresh examples per band (``band.samples`` where set), band i from the random stream (seed, i);
    ``power_offsets``: the task's ``draw_power_offset`` strings."""
    return [
        FinalLabelSet.draw(
            task,
            np.random.default_rng([seed, index]),
            band.samples or samples,
            band.lengths,
            band.p_one,
            power_offsets,
            band.p_times,
        )
        for index, band in enumerate(bands)
    ]


def evaluate_checkpoint(
    loaded: LoadedCheckpoint,
    protocol: Protocol,
    bands: Sequence[Band],
    band_sets: Sequence[FinalLabelSet],
    seed: int,
    batch_size: int,
    chunk_symbols: int | None = None,
    power_offsets: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """The JSON report of one checkpoint on the drawn ``band_sets`` (``power_offsets``: drawn
    so); ``chunk_symbols``: see :func:`training.data.batches.count_correct_final`. ``progress``: a tqdm bar on
    stderr at a terminal (none elsewhere), in symbols evaluated, moved after each batch, gone once done."""
    alphabet = loaded.config.alphabet
    assert alphabet is not None
    results, correct_total, sample_total = [], 0, 0
    symbols = sum(len(string) for examples in band_sets for string in examples.strings)
    with progress_bar(
        progress, total=symbols, desc=loaded.path.name, unit="symbol", unit_scale=True, leave=False
    ) as bar:
        for band, examples in zip(bands, band_sets):
            bar.set_postfix_str(f"lengths {band.lengths[0]}-{band.lengths[1]}")
            correct = 0
            for first in range(0, len(examples), batch_size):  # count_correct_final's batches, one at a time
                part = FinalLabelSet(
                    examples.strings[first : first + batch_size], examples.final_labels[first : first + batch_size]
                )
                correct += count_correct_final(loaded.model, part, alphabet, batch_size, chunk_symbols)
                bar.update(sum(map(len, part.strings)))
            results.append(
                {
                    "lengths": list(band.lengths),
                    "p_one": band.p_one,
                    "p_times": band.p_times,
                    "samples": len(examples),
                    "accuracy": correct / len(examples),
                }
            )
            correct_total, sample_total = correct_total + correct, sample_total + len(examples)
    return {
        "checkpoint": str(loaded.path),
        "task": loaded.config.task,
        "architecture": loaded.config.architecture,
        "protocol": protocol,
        "seed": seed,
        "power_offsets": power_offsets,
        "bands": results,
        "overall": correct_total / sample_total,
    }


def combine_reports(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Max and mean over several checkpoints' reports of the same bands."""
    first = reports[0]
    bands = []
    for index, band in enumerate(first["bands"]):
        accuracies = [report["bands"][index]["accuracy"] for report in reports]
        bands.append(
            {
                "lengths": band["lengths"],
                "p_one": band["p_one"],
                "p_times": band.get("p_times"),
                "samples": band["samples"],
                "max": max(accuracies),
                "mean": sum(accuracies) / len(accuracies),
            }
        )
    overall = [report["overall"] for report in reports]
    return {
        "task": first["task"],
        "protocol": first["protocol"],
        "seed": first["seed"],
        "power_offsets": first["power_offsets"],
        "checkpoints": list(reports),
        "bands": bands,
        "max": max(overall),
        "mean": sum(overall) / len(overall),
    }


def format_table(reports: Sequence[dict[str, Any]]) -> str:
    """The text output: one row per band, one accuracy column per checkpoint (and max/mean for several)."""
    first = reports[0]
    strings = "  strings: the mark a power of two before the end" if first.get("power_offsets") else ""
    lines = [f"task {first['task']}  protocol {first['protocol']}  seed {first['seed']}{strings}"]
    if len(reports) == 1:
        lines.append(f"checkpoint {first['checkpoint']} ({first['architecture']})")
        headers = ["accuracy"]
    else:
        lines += [f"[{i}] {report['checkpoint']} ({report['architecture']})" for i, report in enumerate(reports, 1)]
        headers = [f"[{i}]" for i in range(1, len(reports) + 1)] + ["max", "mean"]
    times = any(band.get("p_times") is not None for band in first["bands"])  # its column only where asked for

    def skew(value: float | None) -> str:
        return "-" if value is None else f"{value:g}"

    head = f"{'lengths':<12}{'p_one':>7}" + (f"{'p_times':>8}" if times else "")
    lines.append(f"{head}{'samples':>9}" + "".join(f"{header:>10}" for header in headers))
    for index, band in enumerate(first["bands"]):
        row = [report["bands"][index]["accuracy"] for report in reports]
        shortest, longest = band["lengths"]
        lengths = str(shortest) if shortest == longest else f"{shortest}-{longest}"
        cells = f"{lengths:<12}{skew(band['p_one']):>7}" + (f"{skew(band.get('p_times')):>8}" if times else "")
        lines.append(f"{cells}{band['samples']:>9}" + _accuracy_cells(row))
    overall = [report["overall"] for report in reports]
    lines.append(f"{'overall':<{len(head) + 9}}" + _accuracy_cells(overall))
    return "\n".join(lines)


def _accuracy_cells(accuracies: list[float]) -> str:
    if len(accuracies) > 1:
        accuracies = [*accuracies, max(accuracies), sum(accuracies) / len(accuracies)]
    return "".join(f"{100 * accuracy:>9.2f}%" for accuracy in accuracies)
