"""Length extrapolation of language models (``python -m training text-eval``; RegularGPT paper, section 6):
last-token perplexity against context length on the same targets at every length, the receptive field, paired
differences between models, and the gain with context split by whether the target's token occurs only far back.
Method and the ``eval.json`` format: docs/training.md, "text-eval reports".
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch
import torch.nn.functional as F

from model.base import SequenceModel
from model.checkpoint import LoadedCheckpoint
from model.config import RegularGPTConfig, TransformerConfig
from training.evaluation.progress import progress_bar

DEFAULT_MULTIPLES = (1, 2, 4, 8, 16)


def target_positions(documents: list[np.ndarray], context: int, targets: int) -> list[tuple[int, int]]:
    """(document, position) of ``targets`` targets spread evenly over every position that has at least
    ``context`` tokens before it in its document."""
    eligible = [(index, position) for index, tokens in enumerate(documents) for position in range(context, len(tokens))]
    if len(eligible) < targets:
        raise ValueError(
            f"the held-out text has {len(eligible)} positions with {context} tokens before them; "
            f"{targets} targets asked for"
        )
    picks = np.linspace(0, len(eligible) - 1, targets).round().astype(int)
    return [eligible[pick] for pick in picks]


@torch.no_grad()
def last_token_nll(
    model: SequenceModel,
    documents: list[np.ndarray],
    positions: list[tuple[int, int]],
    length: int,
    batch_size: int,
    done: Callable[[int], object] | None = None,
) -> np.ndarray:
    """Negative log-likelihood of each target given the ``length`` tokens before it. Returns (targets,).
    ``done(tokens)`` after each batch: the context tokens it ran (a progress bar's ``update``)."""
    losses = []
    for start in range(0, len(positions), batch_size):
        chunk = positions[start : start + batch_size]
        windows = np.stack([documents[doc][position - length : position] for doc, position in chunk])  # (b, L)
        targets = torch.tensor([int(documents[doc][position]) for doc, position in chunk], device=model.device)
        logits = model.final_logits(torch.from_numpy(windows).to(model.device))  # (b, V)
        losses.append(F.cross_entropy(logits.float(), targets, reduction="none").cpu().numpy())
        if done is not None:
            done(windows.size)
    return np.concatenate(losses)


def target_digest(documents: list[np.ndarray], positions: list[tuple[int, int]]) -> str:
    """SHA-256 of the targets' (document, position, token) triples."""
    triples = np.array([(doc, position, int(documents[doc][position])) for doc, position in positions], dtype=np.int64)
    return hashlib.sha256(triples.tobytes()).hexdigest()


def seen_only_far(documents: list[np.ndarray], positions: list[tuple[int, int]], near: int, far: int) -> np.ndarray:
    """Whether each target's token occurs among the ``far`` tokens before it but not among the last ``near``."""
    flags = []
    for doc, position in positions:
        tokens, target = documents[doc], documents[doc][position]
        flags.append(
            bool(
                (tokens[position - far : position - near] == target).any()
                and not (tokens[position - near : position] == target).any()
            )
        )
    return np.array(flags, dtype=bool)


def context_gain(
    documents: list[np.ndarray],
    positions: list[tuple[int, int]],
    near: int,
    far: int,
    nll_near: np.ndarray,
    nll_far: np.ndarray,
) -> dict[str, Any]:
    """The report's ``context_gain`` (module docstring) from the per-target NLLs at the two lengths."""
    far_only = seen_only_far(documents, positions, near, far)
    report: dict[str, Any] = {"near": near, "far": far}
    for name, part in (("seen_only_far", far_only), ("other", ~far_only)):
        report[name] = {
            "targets": int(part.sum()),
            "nll_near": float(nll_near[part].mean()) if part.any() else None,
            "nll_far": float(nll_far[part].mean()) if part.any() else None,
        }
    return report


def receptive_field(
    model: SequenceModel, documents: list[np.ndarray], positions: list[tuple[int, int]], length: int
) -> list[float]:
    """Cumulative gradient-norm share per input position (module docstring), averaged over the windows."""
    embeddings: list[torch.Tensor] = []

    def keep_output(_module: torch.nn.Module, _inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        output.retain_grad()  # the token embeddings, as a leaf the gradient reaches
        embeddings.append(output)

    embedding = cast(torch.nn.Module, model.embedding)  # each trainable model's TokenEmbedding, not SequenceModel's
    hook = embedding.register_forward_hook(keep_output)
    curves = []
    try:
        for doc, position in positions:
            embeddings.clear()
            window = torch.from_numpy(documents[doc][position - length : position][None]).to(model.device)  # (1, T)
            logits = model(window)  # (1, T, V)
            loss = F.cross_entropy(
                logits[:, -1].float(), torch.tensor([int(documents[doc][position])], device=model.device)
            )
            model.zero_grad(set_to_none=True)
            loss.backward()
            grad = embeddings[0].grad
            assert grad is not None  # retain_grad above
            norms = grad[0].float().norm(dim=-1)  # (T,)
            from_end = norms.flip(0).cumsum(0).flip(0)  # (T,) sum over positions p..T-1
            curves.append((from_end / from_end[0]).cpu().numpy())
    finally:
        hook.remove()
    mean: list[float] = np.mean(curves, axis=0).tolist()
    return mean


def evaluate_text_checkpoint(
    loaded: LoadedCheckpoint,
    documents: list[np.ndarray],
    corpus: str,
    train_length: int,
    multiples: tuple[float, ...],
    targets: int,
    batch_size: int,
    receptive_windows: int,
    receptive_multiple: float,
    progress: bool = False,
) -> dict[str, Any]:
    """The report of the module docstring for one checkpoint. ``progress``: a tqdm bar on stderr at a terminal (none
    elsewhere), in context tokens run, moved after each batch."""
    started = time.perf_counter()
    model = loaded.model.eval()
    lengths = [max(1, round(multiple * train_length)) for multiple in multiples]
    positions = target_positions(documents, max(lengths), targets)
    rows, per_target = [], []
    with progress_bar(
        progress, total=len(positions) * sum(lengths), desc=f"{loaded.path.name} context", unit="token", unit_scale=True
    ) as bar:
        for multiple, length in zip(multiples, lengths):
            bar.set_postfix(length=length)
            losses = last_token_nll(model, documents, positions, length, batch_size, bar.update)  # (targets,)
            per_target.append(losses)
            nll = float(losses.mean())
            rows.append(
                {
                    "length": length,
                    "multiple": multiple,
                    "perplexity": math.exp(nll),
                    "nll": nll,
                    "nll_stderr": _stderr(losses),
                    "nll_per_target": losses.tolist(),
                }
            )
            bar.set_postfix(length=length, ppl=f"{math.exp(nll):.2f}")
    field = None
    if receptive_windows:
        field_length = round(receptive_multiple * train_length)
        field_positions = target_positions(documents, field_length, receptive_windows)
        with torch.enable_grad():
            cumulative = receptive_field(model, documents, field_positions, field_length)
        field = {"length": field_length, "windows": receptive_windows, "cumulative": cumulative}
    first = next((index for index, row in enumerate(rows) if row["multiple"] == 1), None)
    gain = None
    if first is not None and rows[-1]["length"] > rows[first]["length"]:
        gain = context_gain(
            documents, positions, rows[first]["length"], rows[-1]["length"], per_target[first], per_target[-1]
        )
    return {
        "checkpoint": str(loaded.path),
        "architecture": describe_architecture(loaded),
        "train_length": train_length,
        "corpus": corpus,
        "targets": targets,
        "target_digest": target_digest(documents, positions),
        "perplexity": rows,
        "ratio_16x": None if first is None else rows[-1]["perplexity"] / rows[first]["perplexity"],
        "log_ratio_stderr": None if first is None else _stderr(per_target[-1] - per_target[first]),
        "receptive_field": field,
        "context_gain": gain,
        "wall_time_s": round(time.perf_counter() - started, 3),
    }


def _stderr(values: np.ndarray) -> float:
    """Standard error of the mean of ``values``."""
    return float(values.std(ddof=1) / math.sqrt(len(values))) if len(values) > 1 else float("nan")


def describe_architecture(loaded: LoadedCheckpoint) -> str:
    """ "regulargpt C=64 K=4", "transformer alibi", "lrnn" ..."""
    config = loaded.model.config
    if loaded.config.architecture == "regulargpt":
        assert isinstance(config, RegularGPTConfig)  # a checkpoint's architecture names its config's class
        return f"regulargpt C={config.chunk_size} K={config.thickness}"
    if loaded.config.architecture == "transformer":
        assert isinstance(config, TransformerConfig)
        return f"transformer {config.position}"
    return loaded.config.architecture


def format_text_table(reports: list[dict[str, Any]]) -> str:
    """Markdown table: one row per context length, one column per checkpoint."""
    names = [f"{report['architecture']} ({report['checkpoint'].rstrip('/').split('/')[-1]})" for report in reports]
    lines = ["| context | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for index, row in enumerate(reports[0]["perplexity"]):
        cells = [f"{report['perplexity'][index]['perplexity']:.2f}" for report in reports]
        lines.append(f"| {row['length']} ({row['multiple']:g}x) | " + " | ".join(cells) + " |")
    ratios = [
        "-"
        if report["ratio_16x"] is None
        else f"{report['ratio_16x']:.3f} ± {report['ratio_16x'] * report['log_ratio_stderr']:.3f}"
        for report in reports
    ]
    lines.append("| longest / 1x | " + " | ".join(ratios) + " |")
    for part, label in (("seen_only_far", "token seen only beyond 1x"), ("other", "other tokens")):
        cells = []
        for report in reports:
            gain = report["context_gain"]
            if gain is None or gain[part]["targets"] == 0:
                cells.append("-")
            else:
                cells.append(f"{gain[part]['nll_near'] - gain[part]['nll_far']:+.3f} ({gain[part]['targets']})")
        lines.append(f"| NLL gain, {label} (targets) | " + " | ".join(cells) + " |")
    if len(reports) > 1:
        first = np.array(reports[0]["perplexity"][-1]["nll_per_target"])
        cells = ["-"]
        for report in reports[1:]:
            if report["target_digest"] != reports[0]["target_digest"]:  # another tokenizer or corpus: other targets
                cells.append("other targets")
                continue
            difference = np.array(report["perplexity"][-1]["nll_per_target"]) - first
            cells.append(f"{difference.mean():+.3f} ± {_stderr(difference):.3f}")
        lines.append("| longest: NLL - the first's (paired) | " + " | ".join(cells) + " |")
    return "\n".join(lines)
