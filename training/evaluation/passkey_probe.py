"""The pass-key probe of ``python -m training text-eval --probe passkey`` (docs/api.md, Long-context probes).

Each prompt is read through the model's cache in chunks, then decoded greedily; a trial is right when the first
decoded number is the key. Rows and chunks stay within ``max_memory`` by the model's estimates (a size where one
row does not fit is skipped). ``passkey.json``: docs/training.md, "text-eval reports".
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from model.base import SequenceModel
from model.checkpoint import LoadedCheckpoint
from model.serving import largest_fitting
from model.tokenizer import Tokenizer
from training.data.corpus import DEFAULT_CORPUS
from training.data.passkey import PassKeyBuilder, PassKeyPrompt, first_number, grass_filler
from training.evaluation.text_eval import describe_architecture
from training.objectives.language_model import validation_tokens

GRASS_FILLER = "grass"
FILLER_KINDS = "'austen', 'grass', 'text:PATH' or 'owt2:PATH'"
SIZE_SUFFIXES = {"k": 2**10, "M": 2**20}


@dataclass(frozen=True)
class PassKeyProbe:
    """What text-eval's ``--probe passkey`` flags ask for."""

    sizes: tuple[int, ...]
    depths: tuple[float, ...]
    fillers: tuple[str, ...]
    trials: int = 2
    seed: int = 0
    max_new_tokens: int = 8
    batch_size: int = 16  # rows run together
    max_memory: int = 4 * 2**30  # bytes: a batch's caches and one prefill call's peak
    distractors: int = 0  # other numbers put in each prompt's filler, before and after the needle
    distractors_at: str = "either"  # on either side of the needle, or only "before" or "after" it
    number_forms: bool = (
        False  # the distractors take the forms numbers have in prose (training.data.passkey.NUMBER_FORMS)
    )


def is_filler_name(name: str) -> bool:
    """Whether ``name`` names a filler: ``grass`` or a corpus spec (training/data/corpus.py)."""
    kind, _, location = name.partition(":")
    return name in (GRASS_FILLER, DEFAULT_CORPUS) or (kind in ("text", "owt2") and bool(location))


def filler_tokens(name: str, tokenizer: Tokenizer, validation_fraction: float) -> np.ndarray:
    """A filler's token stream, (N,) int64: the "grass is green" text, or a corpus's held-out text, its documents
    joined without ``<|endoftext|>``."""
    if name == GRASS_FILLER:
        return grass_filler(tokenizer)
    documents = validation_tokens(name, validation_fraction, tokenizer)
    tokens = np.concatenate(documents) if documents else np.zeros(0, dtype=np.int64)
    return tokens[tokens != tokenizer.eot_token] if tokenizer.eot_token is not None else tokens


def cell_prompts(builder: PassKeyBuilder, probe: PassKeyProbe, filler: str, size: int) -> list[PassKeyPrompt]:
    """The prompts of one (filler, size) cell: ``probe.trials`` per depth, depth by depth, each with its own key
    and filler offset drawn from a stream keyed by the seed, the filler's name and the size."""
    rng = np.random.default_rng([probe.seed, zlib.crc32(filler.encode()), size])
    return [
        builder.prompt(size, depth, rng, distractors=probe.distractors, distractors_at=probe.distractors_at)
        for depth in probe.depths
        for _ in range(probe.trials)
    ]


@torch.no_grad()
def greedy_completions(
    model: SequenceModel,
    prompts: torch.Tensor,
    max_new_tokens: int,
    chunk_tokens: int,
    on_prefill: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Greedy decoding of ``max_new_tokens`` tokens after each prompt: the prompts go through a new cache
    ``chunk_tokens`` positions at a time, then one step per new token. ``on_prefill(tokens)`` after each chunk.

    prompts: (B, T) int64 on the model's device. Returns (B, max_new_tokens) int64.
    """
    rows, length = prompts.shape
    cache = model.new_cache(rows)
    for start in range(0, length, chunk_tokens):
        chunk = prompts[:, start : start + chunk_tokens]  # (B, c)
        if model.selects_positions:  # the head on the prompt's last position only (none before the last chunk)
            positions = torch.zeros_like(chunk, dtype=torch.bool)
            positions[:, -1] = start + chunk_tokens >= length
            last = model(chunk, cache, positions=positions)  # (B, V) at the last chunk, else (0, V)
        else:
            last = model(chunk, cache)[:, -1]  # (B, V)
        if on_prefill is not None:
            on_prefill(chunk.numel())
    tokens = [last.argmax(-1)]  # each (B,)
    for _ in range(max_new_tokens - 1):
        tokens.append(model.step(tokens[-1], cache).argmax(-1))
    return torch.stack(tokens, dim=1)  # (B, max_new_tokens)


def batch_plan(model: SequenceModel, rows: int, size: int, max_memory: int) -> tuple[int, int] | str:
    """(rows run together, prefill chunk length) for prompts of ``size`` tokens within ``max_memory`` (module
    docstring), or why the size is skipped."""

    def need(rows: int, chunk: int) -> int:  # bytes: the rows' caches at full size and the call's peak there
        return rows * model.cache_nbytes(size) + model.cost("cached", rows, chunk, size).nbytes

    if need(1, 1) > max_memory:
        return (
            f"one row at {size} tokens needs {need(1, 1) / 2**30:.3g} GiB (its cache and a one-token prefill), "
            f"over --max-memory {max_memory / 2**30:.3g} GiB"
        )
    rows = largest_fitting(lambda count: need(count, 1) <= max_memory, rows)
    return rows, largest_fitting(lambda chunk: need(rows, chunk) <= max_memory, size)


def probe_checkpoint(
    loaded: LoadedCheckpoint,
    tokenizer: Tokenizer,
    fillers: dict[str, np.ndarray],
    probe: PassKeyProbe,
    progress: bool = False,
) -> dict[str, Any]:
    """The report of the module docstring for one checkpoint; ``fillers``: name -> token stream."""
    started = time.perf_counter()
    model = loaded.model.eval()
    prompts_per_cell = len(probe.depths) * probe.trials
    total = len(fillers) * prompts_per_cell * sum(probe.sizes)
    bar = tqdm(
        total=total,
        desc=f"{loaded.path.name} pass key",
        unit="token",
        unit_scale=True,
        disable=None if progress else True,
    )  # at a terminal only
    report_fillers = []
    for name, stream in fillers.items():
        builder = PassKeyBuilder(tokenizer, stream, probe.number_forms)
        sizes = sized_rows(
            model,
            tokenizer,
            probe,
            prompts_per_cell,
            lambda size: cell_prompts(builder, probe, name, size),
            lambda size, answered, skipped: _size_row(size, probe, answered, skipped),
            bar,
            {"filler": name},
        )
        report_fillers.append({"filler": name, "filler_tokens": len(stream), "sizes": sizes})
    bar.close()
    return {
        "checkpoint": str(loaded.path),
        "architecture": describe_architecture(loaded),
        "probe": "passkey",
        "trials": probe.trials,
        "seed": probe.seed,
        "max_new_tokens": probe.max_new_tokens,
        "distractors": probe.distractors,
        "distractors_at": probe.distractors_at,
        "number_forms": probe.number_forms,
        "fillers": report_fillers,
        "wall_time_s": round(time.perf_counter() - started, 3),
    }


def sized_rows(
    model: SequenceModel,
    tokenizer: Tokenizer,
    probe: Any,
    per_cell: int,
    cell: Callable[[int], Sequence[Any]],
    row: Callable[[int, list[tuple[Any, str]], str | None], dict[str, Any]],
    bar: tqdm,
    postfix: dict[str, str],
) -> list[dict[str, Any]]:
    """One report row per size of ``probe`` (its sizes, batch_size, max_memory and max_new_tokens): ``row(size,
    [(prompt, completion), ...], None)`` for the ``cell(size)`` prompts (each with ``.tokens``, ``per_cell`` of them)
    read and decoded greedily, or ``row(size, [], why)`` when one row does not fit (``batch_plan``)."""
    rows = []
    for size in probe.sizes:
        bar.set_postfix(**postfix, size=size_label(size))
        plan = batch_plan(model, min(probe.batch_size, per_cell), size, probe.max_memory)
        if isinstance(plan, str):
            rows.append(row(size, [], plan))
            bar.update(per_cell * size)
            continue
        prompts = cell(size)
        texts = complete_greedily(
            model, tokenizer, [prompt.tokens for prompt in prompts], plan, probe.max_new_tokens, bar.update
        )
        rows.append(row(size, list(zip(prompts, texts)), None))
    return rows


def complete_greedily(
    model: SequenceModel,
    tokenizer: Tokenizer,
    prompts: Sequence[np.ndarray],
    plan: tuple[int, int],
    max_new_tokens: int,
    on_prefill: Callable[[int], None],
) -> list[str]:
    """The decoded greedy completion of each prompt ((size,) tokens, all of one size), ``plan[0]`` rows at a time,
    read in chunks of ``plan[1]``."""
    rows, chunk = plan
    texts: list[str] = []
    for start in range(0, len(prompts), rows):
        batch = np.stack(prompts[start : start + rows])  # (b, size)
        tokens = greedy_completions(
            model, torch.from_numpy(batch).to(model.device), max_new_tokens, chunk, on_prefill
        )  # (b, max_new_tokens)
        texts.extend(tokenizer.decode(row) for row in tokens.tolist())
    return texts


def _size_row(
    size: int, probe: PassKeyProbe, answered: list[tuple[PassKeyPrompt, str]], skipped: str | None
) -> dict[str, Any]:
    """One size's entry of the report: right/total per depth and over all depths."""
    depths = []
    for depth in probe.depths:
        trials = [
            {"key": prompt.key, "completion": text, "right": first_number(text) == prompt.key}
            for prompt, text in answered
            if prompt.depth == depth
        ]
        depths.append(depth_entry(depth, trials))
    return size_entry(size, skipped, depths)


def depth_entry(depth: float, trials: list[dict[str, Any]]) -> dict[str, Any]:
    """One depth's entry of a probe report: its trials (each with ``right``) and right/total."""
    return {"depth": depth, "right": sum(trial["right"] for trial in trials), "total": len(trials), "trials": trials}


def size_entry(size: int, skipped: str | None, depths: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """One size's entry of a probe report: its ``depth_entry`` rows, right/total and accuracy over them (None when
    skipped), and ``extra`` fields before the depths."""
    right, total = sum(row["right"] for row in depths), sum(row["total"] for row in depths)
    accuracy = right / total if total else None
    return {
        "size": size,
        "skipped": skipped,
        "right": right,
        "total": total,
        "accuracy": accuracy,
        **extra,
        "depths": depths,
    }


def size_label(size: int) -> str:
    """1024 -> "1k", 1048576 -> "1M", 1000 -> "1000"."""
    for suffix, unit in sorted(SIZE_SUFFIXES.items(), key=lambda item: -item[1]):
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)


def format_passkey_table(reports: list[dict[str, Any]]) -> str:
    """Markdown table: one row per checkpoint and filler (with its distractor numbers), one column per size,
    right/total (skipped: "-")."""
    sizes = [row["size"] for row in reports[0]["fillers"][0]["sizes"]]
    lines = ["| model | filler | " + " | ".join(map(size_label, sizes)) + " |", "|---" * (len(sizes) + 2) + "|"]
    for report in reports:
        name = f"{report['architecture']} ({report['checkpoint'].rstrip('/').split('/')[-1]})"
        numbers = ""
        if report.get("distractors"):
            forms = " in prose forms" if report.get("number_forms") else ""
            place = report.get("distractors_at", "either")
            where = "" if place == "either" else f" {place} the needle"
            numbers = f" + {report['distractors']} numbers{forms}{where}"
        for filler in report["fillers"]:
            cells = ["-" if row["skipped"] else f"{row['right']}/{row['total']}" for row in filler["sizes"]]
            lines.append(f"| {name} | {filler['filler']}{numbers} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
