"""``python -m training train|eval|compile`` (SPEC section 3): argument parsing and validation only.

Each subcommand turns its arguments into typed settings and hands them to ``training.train`` or
``training.evaluate`` (``compile``: to ``training.compile_cli``). Exit codes: 0 done; 2 bad input, with one
line on stderr that says what is wrong (unknown task, architecture or flag, malformed length range, a checkpoint
folder that does not load, ...).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from model.checkpoint import CONFIG_FILE, CheckpointError, LoadedCheckpoint, load_checkpoint, read_config
from model.config import ARCHITECTURE_CONFIGS
from training.compile_cli import add_compile_arguments, run_compile
from training.distributed import setup_distributed
from training.evaluate import Band, combine_reports, draw_bands, evaluate_checkpoint, format_table, papers_lengths
from training.evaluate import protocol_bands, split_lengths
from training.model_flags import TRAINABLE_ARCHITECTURES, add_model_flags, given_model_flags, model_config
from training.tasks import Task, get_task
from training.text_cli import add_text_commands
from training.train import TrainSettings, train

PROG = "python -m training"


class UsageError(Exception):
    """Bad input: the message is printed as one line and the command exits with status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse's own errors become one line and status 2 too
        raise UsageError(f"{self.prog}: {message}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(_text_route(argv))
        return args.run(args, argv)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _text_route(argv: list[str]) -> list[str]:
    """SPEC section 3's spelling for text models: ``train --corpus ...`` is ``text-train`` and ``eval`` of a text
    checkpoint (``kind: "generate"``) is ``text-eval``; every other command line is returned as it is."""
    if argv[:1] == ["train"] and any(arg == "--corpus" or arg.startswith("--corpus=") for arg in argv):
        return ["text-train", *argv[1:]]
    if argv[:1] == ["eval"]:
        folders = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--checkpoint"]
        folders += [arg.split("=", 1)[1] for arg in argv if arg.startswith("--checkpoint=")]
        try:
            kind = read_config(folders[0]).kind if folders else None
        except CheckpointError:
            kind = None  # the eval parser reports the folder that does not load
        if kind == "generate":
            return ["text-eval", *argv[1:]]
    return argv


# ---------------------------------------------------------------- argument types


def length_range(text: str) -> tuple[int, int]:
    """"A-B" -> (A, B) with 1 <= A <= B."""
    parts = text.split("-")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"invalid length range {text!r}: expected A-B, e.g. 41-500")
    shortest, longest = int(parts[0]), int(parts[1])
    if shortest < 1:
        raise argparse.ArgumentTypeError(f"invalid length range {text!r}: lengths start at 1")
    if shortest > longest:
        raise argparse.ArgumentTypeError(f"invalid length range {text!r}: {shortest} > {longest}")
    return shortest, longest


def band_spec(text: str) -> int | list[tuple[int, int]]:
    """"N" (that many bands) or "A-B,C-D,..." (explicit bands)."""
    if text.isdigit():
        return positive_int(text)
    return [length_range(part) for part in text.split(",")]


def _checked_number(kind: type, accept: Callable[[Any], bool], requirement: str) -> Callable[[str], Any]:
    """An argparse type: ``text`` read as ``kind``, refused unless ``accept(value)``."""

    def parse(text: str) -> Any:
        value = _number(text, kind)
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value

    return parse


positive_int = _checked_number(int, lambda value: value >= 1, "a positive integer")
non_negative_int = _checked_number(int, lambda value: value >= 0, "0 or more")
positive_float = _checked_number(float, lambda value: value > 0, "positive")
probability = _checked_number(float, lambda value: 0.0 <= value <= 1.0, "a probability in [0, 1]")


def probability_or_range(text: str) -> float | tuple[float, float]:
    """"P" -> P, or "A-B" -> (A, B) with 0 <= A <= B <= 1."""
    if "-" not in text:
        return probability(text)
    parts = text.split("-")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"invalid probability range {text!r}: expected P or A-B, e.g. 0.05-0.95")
    lo, hi = (probability(part) for part in parts)
    if lo > hi:
        raise argparse.ArgumentTypeError(f"invalid probability range {text!r}: {lo} > {hi}")
    return lo, hi


def _number(text: str, kind: type) -> Any:
    try:
        return kind(text)
    except ValueError:
        expected = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


# ---------------------------------------------------------------- parsers


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Train and evaluate transducers on the tasks of SPEC section 1.")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="{train,eval,compile,bpe,text-train,text-eval}")
    _add_train_parser(commands.add_parser("train", help="train a model and write a checkpoint folder"))
    _add_eval_parser(commands.add_parser("eval", help="final-label accuracy of checkpoints per length band"))
    compile_parser = commands.add_parser("compile", help="compile a DFA JSON file into a checkpoint folder")
    add_compile_arguments(compile_parser)  # training/compile_cli.py
    compile_parser.set_defaults(run=lambda args, argv: run_compile(args))
    add_text_commands(commands)  # bpe, text-train, text-eval: training/text_cli.py
    return parser


def _add_train_parser(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=_run_train)
    what = parser.add_argument_group("what to train")
    what.add_argument("--task", required=True, help="a task of SPEC section 1, e.g. parity_check")
    what.add_argument("--arch", required=True, help=f"architecture: {', '.join(TRAINABLE_ARCHITECTURES)}")
    what.add_argument("--steps", required=True, type=positive_int, help="optimizer steps (at most)")
    what.add_argument("--out", required=True, type=Path, help="checkpoint folder to write (train.jsonl beside)")
    what.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--batch-size", type=positive_int, default=128, help="sequences per step and process")
    optim.add_argument("--lr", type=positive_float, default=3e-4, help="peak learning rate")
    optim.add_argument("--optimizer", choices=("adam", "adamw"), default="adam")
    optim.add_argument("--weight-decay", type=float, default=0.0)
    optim.add_argument("--schedule", choices=("constant", "cosine"), default="constant",
                       help="learning rate after the warm-up")
    optim.add_argument("--warmup-steps", type=non_negative_int, default=0, help="linear learning-rate warm-up")
    optim.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    optim.add_argument("--seed", type=int, default=0, help="weights, data (keyed by rank too) and eval set")
    data = parser.add_argument_group("data")
    data.add_argument("--train-lengths", type=length_range, help="A-B (default: the task's, 1-40 or 1-50)")
    data.add_argument("--curriculum", choices=("uniform", "growing"), default="uniform",
                      help="uniform: lengths uniform over the range throughout; growing: the longest length rises "
                           "linearly from --curriculum-start to the maximum over --curriculum-fraction of the steps")
    data.add_argument("--curriculum-start", type=positive_int, default=10)
    data.add_argument("--curriculum-fraction", type=probability, default=0.5)
    data.add_argument("--p-one", type=probability_or_range,
                      help="P(second symbol: '1' or 'b'; modular_arithmetic: of the digit '1'), the other symbols "
                           "sharing the rest; A-B: each string draws its own P uniformly "
                           "from [A, B] (mixes dense and sparse strings, for skewed inputs at test time)")
    data.add_argument("--balanced", action="store_true", help="draw the final label uniformly, then the string")
    checks = parser.add_argument_group("extrapolation evaluation and early stopping")
    checks.add_argument("--eval-every", type=non_negative_int, default=500, help="steps between evaluations (0: none)")
    checks.add_argument("--eval-lengths", type=length_range, help="A-B (default: the papers protocol's range)")
    checks.add_argument("--eval-samples", type=positive_int, default=200)
    checks.add_argument("--eval-batch-size", type=positive_int, default=64)
    checks.add_argument("--patience", type=positive_int, help="stop after this many evaluations without a new best")
    checks.add_argument("--target-accuracy", type=probability, help="stop once the best accuracy reaches this")
    run = parser.add_argument_group("run")
    run.add_argument("--log-every", type=positive_int, default=10, help="steps between train.jsonl records")
    run.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (torchrun: the local rank's)")
    run.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                     help="bfloat16: autocast for the forward pass; weights stay float32")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="tqdm progress bar")
    add_model_flags(parser)


def _add_eval_parser(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=_run_eval)
    parser.add_argument("--checkpoint", required=True, action="append", type=Path,
                        help="checkpoint folder; repeat it (e.g. one per seed) for max and mean")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--protocol", choices=("papers", "hard"),
                       help="papers: 41-500 (d*/tomita*: 51-100); hard: 501-2000, plus P(1)=0.1 and 0.9 "
                            "(default: papers)")
    which.add_argument("--lengths", type=length_range, help="A-B: a custom length range, e.g. 41-500")
    parser.add_argument("--bands", type=band_spec, default=10,
                        help="N bands over the range (default 10), or an explicit list A-B,C-D,...")
    parser.add_argument("--p-one", type=probability, action="append",
                        help="with --lengths or a list of --bands: sample with P(second symbol) = P instead of the "
                             "task's generator (repeatable: one set of bands per value)")
    parser.add_argument("--samples", type=positive_int, default=100, help="samples per band")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--json", action="store_true", help="print the JSON report (schema: training/evaluate.py)")
    parser.add_argument("--plot", type=Path, help="write a PNG of accuracy against length here")


# ---------------------------------------------------------------- train


def _run_train(args: argparse.Namespace, argv: list[str]) -> int:
    task = _task(args.task)
    if args.arch not in TRAINABLE_ARCHITECTURES:
        kind = "is built by hand, not trained" if args.arch in ARCHITECTURE_CONFIGS else "is unknown"
        raise UsageError(f"architecture {args.arch!r} {kind}; trainable: {', '.join(TRAINABLE_ARCHITECTURES)}")
    _check_sampling(task, args.p_one, args.balanced)
    if args.eval_every == 0 and (args.patience or args.target_accuracy is not None):
        raise UsageError("--patience and --target-accuracy need evaluations: set --eval-every above 0")
    if (args.out / CONFIG_FILE).exists() and not args.overwrite:
        raise UsageError(f"{args.out} already holds a checkpoint; pass --overwrite to replace it")
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} exists and is not a folder")
    try:
        config = model_config(args.arch, task, given_model_flags(args))
    except ValueError as error:
        raise UsageError(str(error)) from None
    settings = TrainSettings(
        task=task.name, architecture=args.arch, steps=args.steps, out=args.out,
        train_lengths=args.train_lengths or task.train_lengths,
        eval_lengths=args.eval_lengths or papers_lengths(task),
        batch_size=args.batch_size, lr=args.lr, optimizer=args.optimizer, weight_decay=args.weight_decay,
        schedule=args.schedule, warmup_steps=args.warmup_steps, grad_clip=args.grad_clip, seed=args.seed,
        curriculum=args.curriculum, curriculum_start=args.curriculum_start,
        curriculum_fraction=args.curriculum_fraction, p_one=args.p_one, balanced=args.balanced,
        eval_every=args.eval_every, eval_samples=args.eval_samples, eval_batch_size=args.eval_batch_size,
        patience=args.patience, target_accuracy=args.target_accuracy, log_every=args.log_every,
        dtype=args.dtype, progress=args.progress,
    )
    try:
        dist = setup_distributed(args.device)
    except ValueError as error:
        raise UsageError(str(error)) from None
    try:
        metadata = train(settings, config, _command_line(argv, dist.world_size, dist.local_world_size), dist)
    finally:
        dist.close()
    if dist.is_main:
        best = metadata["best_eval"]
        summary = "no evaluation"
        if best is not None:
            summary = f"best extrapolation accuracy {best['accuracy']:.4f} at step {best['step']}"
        print(f"wrote {args.out}: {metadata['steps']} steps in {metadata['wall_time_s']:.1f} s, {summary}")
    return 0


def _command_line(argv: list[str], world_size: int, local_world_size: int) -> str:
    """The command as typed: ``python -m training ...`` or its torchrun form."""
    if world_size == 1:
        launcher = ["python", "-m", "training"]
    else:
        nodes = [f"--nnodes={world_size // local_world_size}"] if world_size != local_world_size else []
        launcher = ["torchrun", *nodes, f"--nproc_per_node={local_world_size}", "-m", "training"]
    return shlex.join(launcher + argv)


def _task(name: str) -> Task:
    try:
        return get_task(name)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _check_sampling(task: Task, p_one: float | tuple[float, float] | None, balanced: bool) -> None:
    if balanced and p_one is not None:
        raise UsageError("--balanced and --p-one cannot be combined: balanced draws condition on the label")
    if balanced and task.draw_with_final_label is None:
        raise UsageError(f"{task.name} offers no balanced sampling")


# ---------------------------------------------------------------- eval


def _run_eval(args: argparse.Namespace, argv: list[str]) -> int:
    explicit_bands = not isinstance(args.bands, int)
    if explicit_bands and (args.lengths or args.protocol):
        raise UsageError("give --bands as a list of ranges or --lengths/--protocol, not both")
    if args.p_one and not (args.lengths or explicit_bands):
        raise UsageError("--p-one goes with --lengths or a list of --bands; the protocols set their own")
    checkpoints = [_load_transducer(path, args.device) for path in args.checkpoint]
    task_names = sorted({loaded.config.task for loaded in checkpoints})
    if len(task_names) > 1:
        raise UsageError(f"the checkpoints are of different tasks ({', '.join(task_names)}); evaluate them apart")
    task = _task(task_names[0])
    for p_one in args.p_one or []:
        _check_sampling(task, p_one, balanced=False)
    if args.lengths or explicit_bands:
        ranges = args.bands if explicit_bands else split_lengths(args.lengths, args.bands)
        bands = [Band(lengths, p_one) for p_one in (args.p_one or [None]) for lengths in ranges]
        protocol = "custom"
    else:
        protocol = args.protocol or "papers"
        bands = protocol_bands(task, protocol, args.bands)
    band_sets = draw_bands(task, bands, args.samples, args.seed)
    reports = [evaluate_checkpoint(loaded, protocol, bands, band_sets, args.seed, args.batch_size)
               for loaded in checkpoints]
    output = reports[0] if len(reports) == 1 else combine_reports(reports)
    print(json.dumps(output, indent=2) if args.json else format_table(reports))
    if args.plot:
        from training.plots import plot_accuracy  # matplotlib only when asked for

        plot_accuracy(reports, args.plot)
    return 0


def _load_transducer(path: Path, device: str) -> LoadedCheckpoint:
    try:
        loaded = load_checkpoint(path, device=device)
    except (CheckpointError, ValueError) as error:  # ValueError: a device that is not there
        raise UsageError(str(error)) from None
    if loaded.config.kind != "transduce":
        raise UsageError(
            f"{path} is a text model (kind {loaded.config.kind!r}); evaluate text models apart from transducers")
    if loaded.config.task is None:
        raise UsageError(f"{path} names no task (a compiled automaton?), so there is no generator to sample from")
    return loaded
