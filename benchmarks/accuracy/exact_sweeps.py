"""Measured figures of the exact transformers (docs/exact_results.md): accuracy to n = 10,000, the PALINDROME
constructions' largest perfect n, and cross-entropy against n with and without layer norm (Fig. 2 of Chiang &
Cholak 2022). n is the number of symbols (CLS and EOS not counted). Every run is seeded and on the CPU; only
``all-outputs`` measures time. Strings are drawn label-balanced (training.data.tasks balanced sampling).

    python -m benchmarks.accuracy.exact_sweeps accuracy [--dense-until 3000] [--step 25] [--longest 10000] [--strings 1]
        [--tasks parity_check first one]
    python -m benchmarks.accuracy.exact_sweeps palindrome [--longest 10000]
    python -m benchmarks.accuracy.exact_sweeps palindrome-curve [--pairs 250]
    python -m benchmarks.accuracy.exact_sweeps palindrome-margins [--pairs 250] [--longest 100]
    python -m benchmarks.accuracy.exact_sweeps cross-entropy [--strings 1000]
        [--figure docs/figures/exact_cross_entropy.png]
    python -m benchmarks.accuracy.exact_sweeps all-outputs [--lengths 128 256 512] [--repeats 3]

``accuracy`` runs the shipped PARITY, FIRST and ONE checkpoints (training/exact_builders.py SHIPPED) on every
length up to --dense-until, then every --step-th length up to --longest, with --strings label-balanced strings
(training.data.tasks balanced sampling) plus the edge strings 0^n, 1^n, 10^(n-1), 0^(n-1)1, 01^(n-1), 1^(n-1)0 and
10^(n-2)1 at each length, final label compared with the reference labeler. ``palindrome`` runs each PALINDROME
variant on palindromes and their one-symbol flips (Nowak et al. 2022, appendix B.3: the hardest negatives)
until it fails; ``palindrome-curve`` gives their accuracy at a few lengths; ``palindrome-margins`` finds how far
one fixed zero-test margin can label the published construction right. ``all-outputs`` times ``forward`` (every
prefix re-encoded) on the shipped checkpoints.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from model.config import ExactTransformerConfig
from model.transformer.exact import ExactTransformer
from training.data.tasks import Task, get_task
from training.exact_builders import (
    CONSTRUCTIONS,
    PUBLISHED_ZERO_TEST_TOLERANCE,
    SHIPPED,
    first_log_scaled,
    palindrome,
    palindrome_mirror,
    to_model,
    with_layer_norm,
)

SEED = 0


def encode(strings: Sequence[str]) -> torch.Tensor:
    """Strings of one length -> (B, n) token ids."""
    return torch.tensor([[int(symbol) for symbol in string] for string in strings])


def final_labels(model: ExactTransformer, strings: Sequence[str]) -> list[str]:
    with torch.no_grad():
        return [str(label) for label in model.final_logits(encode(strings)).argmax(-1).tolist()]


def edge_strings(length: int) -> list[str]:
    """0^n, 1^n, a single 1 or 0 at either end, and 1 0^(n-2) 1 (the distinct ones)."""
    edges = {"0" * length, "1" * length}
    for symbol, other in (("1", "0"), ("0", "1")):
        edges |= {symbol + other * (length - 1), other * (length - 1) + symbol}
    if length >= 2:
        edges.add("1" + "0" * (length - 2) + "1")
    return sorted(edges)


def sweep_lengths(dense_until: int, step: int, longest: int) -> list[int]:
    return list(range(1, min(dense_until, longest) + 1)) + list(range(dense_until + step, longest + 1, step))


@dataclass
class Sweep:
    """Errors of one model over a list of lengths."""

    lengths: int = 0
    strings: int = 0
    errors: int = 0
    failing_lengths: list[int] = field(default_factory=list)

    @property
    def first_failure(self) -> int | None:
        return self.failing_lengths[0] if self.failing_lengths else None

    def add(self, length: int, errors: int, strings: int) -> None:
        self.lengths += 1
        self.strings += strings
        self.errors += errors
        if errors:
            self.failing_lengths.append(length)


def run_sweep(
    model: ExactTransformer,
    task: Task,
    draw: Callable[[np.random.Generator, int], list[str]],
    lengths: Iterable[int],
    stop_after_failure: bool = False,
) -> Sweep:
    """Final labels of ``draw(rng, length)`` against the task's labeler at each length (one seeded rng)."""
    rng, sweep = np.random.default_rng(SEED), Sweep()
    for length in lengths:
        strings = draw(rng, length)
        errors = sum(p != task.label(s)[-1] for p, s in zip(final_labels(model, strings), strings))
        sweep.add(length, errors, len(strings))
        if errors and stop_after_failure:
            break
    return sweep


def balanced_and_edge_strings(task: Task, count: int, rng: np.random.Generator, length: int) -> list[str]:
    return [task.sample(rng, length, balanced=True) for _ in range(count)] + edge_strings(length)


def accuracy(args: argparse.Namespace) -> None:
    lengths = sweep_lengths(args.dense_until, args.step, args.longest)
    print(
        f"lengths: 1..{args.dense_until} every one, then every {args.step}th to {args.longest} "
        f"({len(lengths)} lengths); {args.strings} balanced string(s) + the edge strings per length\n"
    )
    print("| checkpoint | construction | lengths tested | strings | errors | accuracy | failing lengths |")
    print("|---|---|---|---|---|---|---|")
    for shipped in SHIPPED:
        if shipped.task not in args.tasks:
            continue
        task = get_task(shipped.task)
        draw = partial(balanced_and_edge_strings, task, args.strings)
        model = shipped.build()
        sweep = run_sweep(model, task, draw, lengths)
        print(
            f"| {shipped.task}-exact | {describe(model.config)} "
            f"| {sweep.lengths} | {sweep.strings} | {sweep.errors} | {1 - sweep.errors / sweep.strings:.6f} "
            f"| {', '.join(map(str, sweep.failing_lengths)) or '-'} |",
            flush=True,
        )


def describe(config: ExactTransformerConfig) -> str:
    """The construction, layer norm and dtype of a model, e.g. "parity, layer norm eps=0, float64"."""
    layer_norm = f"layer norm eps={config.layer_norm_eps:g}" if config.layer_norm else "no layer norm"
    return f"{config.construction}, {layer_norm}, {config.compute_dtype}"


def one_flip_strings(rng: np.random.Generator, length: int, pairs: int) -> list[str]:
    """Palindromes and each with one symbol flipped (not the middle one): the first symbol, the one left of the
    middle, and ``pairs`` - 2 uniform positions."""
    strings = []
    for index in range(pairs):
        half = "".join(rng.choice(["0", "1"], length // 2))
        middle = "".join(rng.choice(["0", "1"], length % 2))
        string = half + middle + half[::-1]
        strings.append(string)
        if length < 2:
            continue
        position = (0, length // 2 - 1)[index] if index < 2 else int(rng.integers(length // 2))
        position = position if rng.random() < 0.5 else length - 1 - position
        strings.append(string[:position] + ("1" if string[position] == "0" else "0") + string[position + 1 :])
    return strings


PALINDROME_VARIANTS: dict[str, Callable[[], ExactTransformer]] = {
    "published, float32, y = I[s = 0]": lambda: to_model(palindrome(), compute_dtype="float32"),
    "published, float32, abs(s) <= 1e-7 (the paper's code)": lambda: to_model(
        palindrome(), compute_dtype="float32", zero_test_tolerance=PUBLISHED_ZERO_TEST_TOLERANCE
    ),
    "published, float64, abs(s) <= 1e-12": lambda: to_model(
        palindrome(), compute_dtype="float64", zero_test_tolerance=1e-12
    ),
    "mirror attention, float32": lambda: to_model(palindrome_mirror(), compute_dtype="float32"),
    "mirror attention, float64 (shipped)": lambda: to_model(palindrome_mirror(), compute_dtype="float64"),
}


def palindrome_sweep(args: argparse.Namespace) -> None:
    task = get_task("palindrome")
    lengths = sweep_lengths(args.dense_until, args.step, args.longest)
    print(
        f"lengths: every one to {args.dense_until}, then every {args.step}th to {args.longest}; {args.pairs} "
        f"palindromes + {args.pairs} one-flip negatives per length; a variant stops at its first error\n"
    )
    print("| variant | largest n tested before the first error | first failing n | lengths | strings |")
    print("|---|---|---|---|---|")
    for name, build in PALINDROME_VARIANTS.items():
        draw = partial(one_flip_strings, pairs=args.pairs)
        sweep = run_sweep(build(), task, draw, lengths, stop_after_failure=True)
        failure = sweep.first_failure
        if failure is None:
            largest = f"{lengths[-1]} (no error)"
        else:
            largest = str(lengths[sweep.lengths - 2]) if sweep.lengths > 1 else "none"
        print(f"| {name} | {largest} | {failure or '-'} | {sweep.lengths} | {sweep.strings} |", flush=True)


CURVE_LENGTHS = (10, 20, 22, 23, 30, 37, 38, 39, 45, 50, 60, 70, 100)


def palindrome_curve(args: argparse.Namespace) -> None:
    """Accuracy of each published variant at CURVE_LENGTHS (Fig. 2 of Nowak et al. 2022)."""
    task = get_task("palindrome")
    print(f"{args.pairs} palindromes + {args.pairs} one-flip negatives per length\n")
    print("| variant | " + " | ".join(f"n={n}" for n in CURVE_LENGTHS) + " |")
    print("|---|" + "---|" * len(CURVE_LENGTHS))
    for name, build in PALINDROME_VARIANTS.items():
        model, rng, row = build(), np.random.default_rng(SEED), []
        for length in CURVE_LENGTHS:
            strings = one_flip_strings(rng, length, args.pairs)
            right = sum(p == task.label(s)[-1] for p, s in zip(final_labels(model, strings), strings))
            row.append(f"{right / len(strings):.3f}")
        print(f"| {name} | " + " | ".join(row) + " |", flush=True)


def palindrome_margins(args: argparse.Namespace) -> None:
    """|s| of the published PALINDROME (the value its zero test y = I[|s| <= margin] reads) on palindromes and
    their one-symbol flips at every length 1..--longest, in float32 and float64. A fixed margin labels every
    string of lengths 1..m right iff every |s| of a palindrome there is <= it and every |s| of a flip is > it."""
    task = get_task("palindrome")
    print(f"{args.pairs} palindromes + {args.pairs} one-flip negatives per length 1..{args.longest}\n")
    print(
        "| dtype | largest m that one fixed margin separates (lengths 1..m) | margins that do | "
        "largest \\|s\\| on a palindrome, lengths 1..m + 1 (at) | smallest \\|s\\| on a flip at m + 1 |"
    )
    print("|---|---|---|---|---|")
    for dtype in ("float32", "float64"):
        model = to_model(replace(palindrome(), output="logits"), compute_dtype=dtype)
        rng, noise, noise_at, previous_noise = np.random.default_rng(SEED), 0.0, 0, 0.0
        smallest_flip, separated = math.inf, 0
        for length in range(1, args.longest + 1):
            strings = one_flip_strings(rng, length, args.pairs)
            magnitudes = _final_logits(model, strings).diff(dim=1)[:, 0].double().abs().tolist()  # |s| per string
            is_palindrome = [task.label(string)[-1] == "1" for string in strings]
            palindromes = [value for value, flag in zip(magnitudes, is_palindrome) if flag]
            flips = [value for value, flag in zip(magnitudes, is_palindrome) if not flag]
            if max(palindromes) > noise:
                noise, noise_at = max(palindromes), length
            if min([smallest_flip, *flips]) <= noise:  # no margin separates lengths 1..length
                print(
                    f"| {dtype} | {separated} | [{previous_noise:.3g}, {smallest_flip:.3g}) "
                    f"| {noise:.3g} (m = {noise_at}) | {min(flips, default=math.inf):.3g} |",
                    flush=True,
                )
                break
            previous_noise, smallest_flip, separated = noise, min([smallest_flip, *flips]), length
        else:
            print(
                f"| {dtype} | {separated} (no overlap up to --longest) | [{noise:.3g}, {smallest_flip:.3g}) "
                f"| {noise:.3g} (m = {noise_at}) | - |",
                flush=True,
            )


CROSS_ENTROPY_LENGTHS = (10, 30, 100, 300, 1000, 3000, 10000)


def cross_entropy_models() -> dict[tuple[str, str], ExactTransformer]:
    """(task, variant) -> model: each construction without layer norm, with it at eps = 1e-5 and at eps = 0;
    FIRST also log-length scaled (Proposition 3); the mirror PALINDROME."""
    models = {}
    for name, task in (("parity", "parity_check"), ("first", "first"), ("one", "one")):
        models[task, "no layer norm"] = to_model(CONSTRUCTIONS[name]())
        for eps in (1e-5, 0.0):
            models[task, f"layer norm, eps={eps:g}"] = to_model(
                with_layer_norm(CONSTRUCTIONS[name]()), layer_norm=True, layer_norm_eps=eps
            )
    models["first", "no layer norm, log-length scaled"] = to_model(CONSTRUCTIONS["first"](), log_length_scaling=True)
    models["first", "log-length scaled, readout scaled (Prop. 3)"] = to_model(first_log_scaled())
    models["palindrome", "mirror attention, float64"] = to_model(palindrome_mirror(), compute_dtype="float64")
    return models


def cross_entropy(args: argparse.Namespace) -> None:
    """Mean cross-entropy (bits per string) of the final label over random strings of each length."""
    results: dict[tuple[str, str], list[float]] = {}
    for (task_name, variant), model in cross_entropy_models().items():
        task, rng, values = get_task(task_name), np.random.default_rng(SEED), []
        for length in CROSS_ENTROPY_LENGTHS:
            count = args.strings if length <= 1000 else args.long_strings
            strings = [task.sample(rng, length, balanced=True) for _ in range(count)]
            labels = torch.tensor([int(task.label(string)[-1]) for string in strings])
            logits = torch.cat([_final_logits(model, strings[start : start + 100]) for start in range(0, count, 100)])
            nats = torch.nn.functional.cross_entropy(logits.double(), labels)
            values.append(float(nats) / math.log(2))
        results[task_name, variant] = values
        print(f"{task_name} / {variant}: " + ", ".join(f"{v:.3g}" for v in values), file=sys.stderr, flush=True)
    print("| task | variant | " + " | ".join(f"n={n}" for n in CROSS_ENTROPY_LENGTHS) + " |")
    print("|---|---|" + "---|" * len(CROSS_ENTROPY_LENGTHS))
    for (task_name, variant), values in results.items():
        print(f"| {task_name} | {variant} | " + " | ".join(f"{v:.3g}" for v in values) + " |")
    plot_cross_entropy(results, args.figure)


def all_outputs_time(args: argparse.Namespace) -> None:
    """Wall time of ``forward`` (the label of every prefix: a server's outputs "all") on one random string per
    length, median of --repeats runs, per shipped checkpoint: what ExactTransformer.max_all_outputs_symbols
    rests on."""
    print(f"torch threads {torch.get_num_threads()}; median of {args.repeats} runs, one string per length\n")
    print("| checkpoint | " + " | ".join(f"T={length}" for length in args.lengths) + " |")
    print("|---|" + "---|" * len(args.lengths))
    rng = np.random.default_rng(SEED)
    for shipped in SHIPPED:
        model, row = shipped.build(), []
        for length in args.lengths:
            tokens = torch.from_numpy(rng.integers(0, 2, (1, length)))  # (1, T)
            seconds = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                with torch.no_grad():
                    model(tokens)
                seconds.append(time.perf_counter() - start)
            row.append(f"{statistics.median(seconds):.2f} s")
        print(f"| {shipped.folder_name} | " + " | ".join(row) + " |", flush=True)


def _final_logits(model: ExactTransformer, strings: Sequence[str]) -> torch.Tensor:
    with torch.no_grad():
        return model.final_logits(encode(strings))


def plot_cross_entropy(results: dict[tuple[str, str], list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    tasks = list(dict.fromkeys(task for task, _ in results))
    rows = math.ceil(len(tasks) / 2)
    figure, axes = plt.subplots(rows, 2, figsize=(11, 4 * rows), sharey=True, squeeze=False)
    for axis, task in zip(axes.flat, tasks):
        for (task_name, variant), values in results.items():
            if task_name == task:
                axis.plot(CROSS_ENTROPY_LENGTHS, values, marker="o", label=variant)
        axis.set(xscale="log", yscale="log", title=task, xlabel="n (symbols)")
        axis.axhline(1.0, color="grey", linewidth=0.5)
        axis.legend(fontsize=8)
    for axis in axes[:, 0]:
        axis.set_ylabel("cross-entropy (bits per string)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    print(f"\nwrote {path}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.accuracy.exact_sweeps", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name, defaults in (("accuracy", (3000, 25, 10000)), ("palindrome", (2000, 100, 10000))):
        command = commands.add_parser(name)
        command.add_argument("--dense-until", type=int, default=defaults[0])
        command.add_argument("--step", type=int, default=defaults[1])
        command.add_argument("--longest", type=int, default=defaults[2])
    commands.choices["accuracy"].add_argument("--strings", type=int, default=1)
    commands.choices["accuracy"].add_argument(
        "--tasks", nargs="+", default=["parity_check", "first", "one"], choices=["parity_check", "first", "one"]
    )
    commands.choices["palindrome"].add_argument("--pairs", type=int, default=4)
    commands.add_parser("palindrome-curve").add_argument("--pairs", type=int, default=250)
    command = commands.add_parser("cross-entropy")
    command.add_argument("--strings", type=int, default=1000, help="strings per length up to n = 1000")
    command.add_argument("--long-strings", type=int, default=100, help="strings per length above n = 1000")
    command.add_argument("--figure", type=Path, default=Path("docs/figures/exact_cross_entropy.png"))
    command = commands.add_parser("palindrome-margins")
    command.add_argument("--pairs", type=int, default=250)
    command.add_argument("--longest", type=int, default=100)
    command = commands.add_parser("all-outputs")
    command.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512])
    command.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    commands_run = {
        "accuracy": accuracy,
        "palindrome": palindrome_sweep,
        "palindrome-curve": palindrome_curve,
        "cross-entropy": cross_entropy,
        "palindrome-margins": palindrome_margins,
        "all-outputs": all_outputs_time,
    }
    commands_run[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
