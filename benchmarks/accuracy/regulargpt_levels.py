"""Where a trained RegularGPT's group word problem goes wrong, level by level (docs/results.md, "S5 and A5 word
problems"). After thick layer l (0-based, dilation C^l), position m of the parallel pass holds the product of the
window of C^(l+1) symbols ending at m (the prefix, where m is closer to the start); the output head applied there
reads that window's group element. Per level this reports, over random strings of --length symbols:

- ``window``: C^(l+1); ``positions``: the positions whose window is whole (prefixes are left out);
- ``right``: the share of them whose head reads the window's element;
- ``composed wrong``: among the positions whose C inputs at level l - 1 (or the symbols, at level 0) were all read
  right, the share read wrong: the error one application of the shared layer adds at that level;
- ``margin p1``: the 1st percentile of (logit of the right element - largest other logit) over those positions.

A final label at length T is the root of a tree of about T compositions, so the per-composition error bounds
what any length can reach: (1 - e)^T.

    python -m benchmarks.accuracy.regulargpt_levels --checkpoint runs/X [--length 4096] [--strings 8] [--seed 0]
        [--threads 1]

For the word problems whose labels are rows of balls (``s5_generators``, ``a5_generators``: the label is the running
product in one-line notation, so a window's element is inverse(P[a - 1]) composed with P[m]); checked against the
task's labeler on random windows before anything is reported.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from model.checkpoint import load_checkpoint
from model.regulargpt.cache import adaptive_depth
from model.regulargpt.model import RegularGPT
from training.data.labelers import a5_generators, s5_generators

Labeler = Callable[[str], list[str]]
LABELERS: dict[str, Labeler] = {"a5_generators": a5_generators, "s5_generators": s5_generators}


def rows(labels: list[str]) -> np.ndarray:
    """Labels "10234" -> (N, 5) int arrays."""
    return np.array([[int(ball) for ball in label] for label in labels], dtype=np.int64)


def window_elements(prefix: np.ndarray, width: int) -> np.ndarray:
    """prefix (T, 5): the running products P[0..T-1] -> (T, 5): the product of the ``width`` symbols ending at each m
    (its prefix where m < width - 1). P[uv] = P[u][P[v]], so the window (a..m) is inverse(P[a - 1])[P[m]]."""
    length = prefix.shape[0]
    inverse = np.argsort(prefix, axis=1)  # inverse(P[a]) for every a
    out = prefix.copy()
    starts = np.arange(length) - width + 1  # a
    whole = starts >= 1
    before = inverse[starts[whole] - 1]  # (W, 5): inverse(P[a - 1])
    out[whole] = np.take_along_axis(before, prefix[whole], axis=1)
    return out


def check_windows(string: str, labeler: Labeler, rng: np.random.Generator) -> None:
    """The window arithmetic against the labeler on 20 random windows of ``string``."""
    prefix = rows(labeler(string))
    for _ in range(20):
        width = int(rng.integers(1, min(len(string), 300) + 1))
        end = int(rng.integers(width - 1, len(string)))
        want = rows(labeler(string[end - width + 1 : end + 1]))[-1]
        got = window_elements(prefix, width)[end]
        if not np.array_equal(want, got):
            raise SystemExit(f"window arithmetic disagrees with the labeler at width {width}, end {end}")


def level_report(
    model: RegularGPT, strings: list[str], alphabet: str, labels: list[str], labeler: Labeler
) -> list[dict[str, Any]]:
    """One dict per level (see the module docstring)."""
    chunk = model.config.chunk_size
    length = len(strings[0])
    index = {label: i for i, label in enumerate(labels)}
    tokens = torch.tensor([[alphabet.index(symbol) for symbol in string] for string in strings])  # (B, T)
    prefixes = [rows(labeler(string)) for string in strings]
    levels = adaptive_depth(length - 1, chunk)
    report, previous_right = [], None  # (B, T) bool at the level below
    with torch.no_grad():
        x = model.embedding(tokens)  # (B, T, d)
        for level in range(levels):
            x = model._thick_layer(x, chunk**level)
            logits = model._logits(x)  # (B, T, labels)
            width = chunk ** (level + 1)
            truth = torch.tensor(
                [
                    [index["".join(map(str, element))] for element in window_elements(prefix, width)]
                    for prefix in prefixes
                ]
            )  # (B, T)
            right = logits.argmax(-1) == truth  # (B, T)
            top = logits.gather(-1, truth[..., None])[..., 0]  # (B, T)
            others = logits.scatter(-1, truth[..., None], float("-inf")).amax(-1)
            margin = top - others
            whole = torch.zeros(length, dtype=torch.bool)
            whole[width - 1 :] = True
            if previous_right is None:  # level 0's inputs are the symbols themselves
                inputs_right = torch.ones_like(right)
            else:  # position m combines m, m - C^l, ..., m - (C - 1) C^l of the level below
                inputs_right = previous_right.clone()
                step = chunk**level
                for j in range(1, chunk):
                    shifted = torch.zeros_like(previous_right)
                    shifted[:, j * step :] = previous_right[:, : length - j * step]
                    inputs_right &= shifted
            counted = whole[None, :] & inputs_right
            composed = int(counted.sum())
            report.append(
                {
                    "level": level,
                    "window": width,
                    "positions": int(whole.sum()) * len(strings),
                    "right": float(right[:, whole].float().mean()) if whole.any() else float("nan"),
                    "composed": composed,
                    "composed_wrong": float((~right[counted]).float().mean()) if composed else float("nan"),
                    "margin_p1": float(margin[counted].quantile(0.01)) if composed else float("nan"),
                }
            )
            previous_right = right
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--strings", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.length < 2 or args.strings < 1:
        parser.error("--length must be at least 2 and --strings at least 1")
    torch.set_num_threads(args.threads)
    loaded = load_checkpoint(args.checkpoint, device="cpu")
    config = loaded.config
    if config.architecture != "regulargpt" or config.task not in LABELERS:
        parser.error(f"{args.checkpoint}: a RegularGPT of {', '.join(LABELERS)} is needed, not {config.task}")
    assert config.alphabet is not None and config.labels is not None  # a transduce checkpoint
    labeler = LABELERS[config.task]
    rng = np.random.default_rng(args.seed)
    strings = ["".join(rng.choice(list(config.alphabet), args.length)) for _ in range(args.strings)]
    check_windows(strings[0], labeler, rng)
    model = loaded.model
    assert isinstance(model, RegularGPT)
    report = level_report(model, strings, config.alphabet, list(config.labels), labeler)
    print(f"{args.checkpoint}: {config.task}, {args.strings} strings of {args.length} symbols, seed {args.seed}")
    print("| level | window | positions | right | compositions with right inputs | composed wrong | margin p1 |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for row in report:
        print(
            f"| {row['level']} | {row['window']} | {row['positions']} | {100 * row['right']:.2f} | {row['composed']} "
            f"| {row['composed_wrong']:.2e} | {row['margin_p1']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
