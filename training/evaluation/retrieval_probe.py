"""The retrieval probe of ``python -m training text-eval --probe retrieval`` (docs/api.md, Long-context probes):
prompts of training/data/retrieval.py, one report per checkpoint and split, the held-out split reported apart.
Prompts are read and decoded as the pass-key probe does (``greedy_completions``, ``batch_plan``); a trial is right
when the completion's first value is the asked one. ``retrieval.json``: docs/training.md, "text-eval reports".
"""

from __future__ import annotations

import functools
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from model.checkpoint import LoadedCheckpoint
from model.tokenizer import Tokenizer
from training.data.retrieval import (
    OUTCOMES,
    Draw,
    RetrievalBuilder,
    RetrievalPrompt,
    Wording,
    first_value,
    formats_named,
    matched,
    outcome,
    split_formats,
)
from training.evaluation.passkey_probe import depth_entry, size_entry, size_label, sized_rows
from training.evaluation.text_eval import describe_architecture

ASK_MODES = ("one", "each")  # the first needle asked, or every needle of a haystack in turn


@dataclass(frozen=True)
class RetrievalProbe:
    """What text-eval's ``--probe retrieval`` flags ask for."""

    sizes: tuple[int, ...]
    depths: tuple[float, ...]
    fillers: tuple[str, ...]
    splits: tuple[str, ...]
    formats: str | None = None  # names for formats_named, the same in each split; None: all of the split's
    needles: int = 1
    ask: str = "one"
    trials: int = 4  # draws per size, depth and filler, their formats taken in turn
    seed: int = 0
    max_new_tokens: int = 16
    batch_size: int = 16
    max_memory: int = 4 * 2**30
    wordings: Path | None = None  # a wordings file (training.data.retrieval.wordings_from_file) for every split

    def split_formats(self, split: str) -> tuple[str, ...]:
        return formats_named(self.formats, split) if self.formats else split_formats(split)


def cell_prompts(builder: RetrievalBuilder, probe: RetrievalProbe, filler: str, size: int) -> list[RetrievalPrompt]:
    """One (split, filler, size) cell's prompts, depth by depth: ``probe.trials`` draws per depth, formats in turn,
    each asked once ("one") or about each of its needles ("each"), from a stream keyed by the seed, the split, the
    filler's name and the size."""
    rng = np.random.default_rng([probe.seed, zlib.crc32(f"{builder.split}/{filler}".encode()), size])
    formats = probe.split_formats(builder.split)
    prompts = []
    for d, depth in enumerate(probe.depths):
        for trial in range(probe.trials):
            fmt = formats[(d * probe.trials + trial) % len(formats)]
            draw: Draw = builder.draw(rng, fmt, depth, probe.needles)
            asked = range(probe.needles) if probe.ask == "each" else range(1)
            prompts += [builder.prompt(draw, size, i) for i in asked]
    return prompts


def probe_checkpoint(
    loaded: LoadedCheckpoint,
    tokenizer: Tokenizer,
    fillers: dict[str, np.ndarray],
    probe: RetrievalProbe,
    wordings: list[Wording] | None = None,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """One report per split of ``probe`` (module docstring); ``fillers``: name -> token stream."""
    model = loaded.model.eval()
    asked = probe.needles if probe.ask == "each" else 1
    per_cell = len(probe.depths) * probe.trials * asked
    bar = tqdm(
        total=len(probe.splits) * len(fillers) * per_cell * sum(probe.sizes),
        desc=f"{loaded.path.name} retrieval",
        unit="token",
        unit_scale=True,
        disable=None if progress else True,
    )
    reports = []
    for split in probe.splits:
        started = time.perf_counter()
        report_fillers = []
        for name, stream in fillers.items():
            builder = RetrievalBuilder(tokenizer, stream, split, wordings)
            sizes = sized_rows(
                model,
                tokenizer,
                probe,
                per_cell,
                functools.partial(cell_prompts, builder, probe, name),
                lambda size, answered, skipped: _size_row(size, probe, answered, skipped),
                bar,
                {"split": split, "filler": name},
            )
            report_fillers.append({"filler": name, "filler_tokens": len(stream), "sizes": sizes})
        reports.append(
            {
                "checkpoint": str(loaded.path),
                "architecture": describe_architecture(loaded),
                "probe": "retrieval",
                "split": split,
                "wordings": str(probe.wordings) if probe.wordings else "composed",
                "formats": list(probe.split_formats(split)),
                "needles": probe.needles,
                "ask": probe.ask,
                "trials": probe.trials,
                "seed": probe.seed,
                "max_new_tokens": probe.max_new_tokens,
                "fillers": report_fillers,
                "wall_time_s": round(time.perf_counter() - started, 3),
            }
        )
    bar.close()
    return reports


def _size_row(
    size: int, probe: RetrievalProbe, answered: list[tuple[RetrievalPrompt, str]], skipped: str | None
) -> dict[str, Any]:
    """One size's entry: right/total per depth (of the first needle: with ``ask`` "each", every needle of the
    draws placed there asked in turn), per value format (with how many of each ``OUTCOMES``, and the characters
    right before the first wrong one and the values' characters, summed) and over all."""
    depths: list[dict[str, Any]] = []
    formats: dict[str, dict[str, Any]] = {}
    per_depth = len(answered) // len(probe.depths)  # cell_prompts's order: depth by depth
    for index, depth in enumerate(probe.depths):
        trials = []
        for prompt, text in answered[index * per_depth : (index + 1) * per_depth]:
            answer = first_value(text)
            how, characters_right = outcome(answer, prompt.value, prompt.values), matched(answer, prompt.value)
            trials.append(
                {
                    "key": prompt.key,
                    "value": prompt.value,
                    "format": prompt.fmt,
                    "wording": prompt.wording,
                    "asked": prompt.asked,
                    "completion": text,
                    "right": how == "right",
                    "outcome": how,
                    "matched": characters_right,
                }
            )
            counts = formats.setdefault(
                prompt.fmt,
                {"right": 0, "total": 0, "outcomes": dict.fromkeys(OUTCOMES, 0), "matched": 0, "characters": 0},
            )
            counts["right"] += how == "right"
            counts["total"] += 1
            counts["outcomes"][how] += 1
            counts["matched"] += characters_right
            counts["characters"] += len(prompt.value)
        depths.append(depth_entry(depth, trials))
    return size_entry(size, skipped, depths, formats=formats)


def format_retrieval_table(reports: list[dict[str, Any]]) -> str:
    """Markdown: one row per checkpoint, split and filler, one column per size, right/total (skipped: "-"); then
    the same by value format, over fillers; then each format's ``OUTCOMES`` over fillers and sizes, with the share of
    the values' characters answered right before the first wrong one ("-" for a format no trial drew)."""
    sizes = [row["size"] for row in reports[0]["fillers"][0]["sizes"]]
    head = " | ".join(map(size_label, sizes))
    lines = [f"| model | split | filler | {head} |", "|---" * (len(sizes) + 3) + "|"]
    by_format = [f"| model | split | format | {head} |", "|---" * (len(sizes) + 3) + "|"]
    names = " | ".join(o.replace("_", " ") for o in OUTCOMES)
    outcomes = [f"| model | split | format | {names} | characters right before the first wrong one |"]
    outcomes.append("|---" * 3 + "|---:" * (len(OUTCOMES) + 1) + "|")
    for report in reports:
        name = f"{report['architecture']} ({report['checkpoint'].rstrip('/').split('/')[-1]})"
        split = report["split"] + (
            "" if report["needles"] == 1 else f", {report['needles']} needles ask {report['ask']}"
        )
        for filler in report["fillers"]:
            cells = ["-" if row["skipped"] else f"{row['right']}/{row['total']}" for row in filler["sizes"]]
            lines.append(f"| {name} | {split} | {filler['filler']} | " + " | ".join(cells) + " |")
        for fmt in report["formats"]:
            cells = []
            for s in range(len(sizes)):
                counts = [f["sizes"][s]["formats"].get(fmt) for f in report["fillers"] if not f["sizes"][s]["skipped"]]
                counts = [c for c in counts if c]
                right, total = sum(c["right"] for c in counts), sum(c["total"] for c in counts)
                cells.append(f"{right}/{total}" if total else "-")
            by_format.append(f"| {name} | {split} | {fmt} | " + " | ".join(cells) + " |")
            rows = [row["formats"][fmt] for f in report["fillers"] for row in f["sizes"] if fmt in row["formats"]]
            if rows:
                tallies = [str(sum(row["outcomes"][how] for row in rows)) for how in OUTCOMES]
                tallies.append(f"{sum(row['matched'] for row in rows)}/{sum(row['characters'] for row in rows)}")
            else:  # no trial drew this format
                tallies = ["-"] * (len(OUTCOMES) + 1)
            outcomes.append(f"| {name} | {split} | {fmt} | " + " | ".join(tallies) + " |")
    return "\n\n".join("\n".join(table) for table in (lines, by_format, outcomes))
