"""``python -m training train|eval|compile|upgrade|export|snap`` (docs/api.md, Command line): argument parsing and
validation; text subcommands are in text.py, ``compile`` in compile.py. Every subcommand first sets torch's threads.
Exit codes: 0 done; 2 bad input, with one line on stderr that says what is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from model.checkpoint import (
    CONFIG_FILE,
    CheckpointError,
    LoadedCheckpoint,
    load_checkpoint,
    read_config,
    upgrade_config,
)
from model.config import ARCHITECTURE_CONFIGS
from model.threads import set_threads
from model.tokenizer import TokenizerError
from training import level_codes, state_codes
from training.cli.arguments import (
    Parser,
    UsageError,
    add_threads,
    band_spec,
    length_range,
    positive_float,
    positive_int,
    probability,
    probability_or_range,
)
from training.cli.compile import add_compile_arguments, run_compile
from training.cli.model_flags import TRAINABLE_ARCHITECTURES, given_model_flags, model_config
from training.cli.text import TEXT_COMMANDS, Runner, add_text_commands
from training.cli.train import (
    NewRun,
    add_training_flags,
    check_new_run,
    check_resume_flags,
    command_line,
    launch,
    require_new_run_flags,
    resuming,
    settings_from_args,
)
from training.data.tasks import Task, get_task
from training.evaluation.evaluate import (
    Band,
    NamedProtocol,
    Protocol,
    combine_reports,
    draw_bands,
    evaluate_checkpoint,
    format_table,
    papers_lengths,
    protocol_bands,
    split_lengths,
)
from training.objectives.checkpointing import ResumeError, export_weights
from training.objectives.transduction import TaskData, TransductionObjective

PROG = "python -m training"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        args = parser.parse_args(_text_route(argv))
        set_threads(args.threads, processes=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if getattr(args, "resume", False):  # train, text-train
            check_resume_flags(args, argv, lambda started: parser.parse_args(_text_route(started)))
        run: Runner = args.run  # the subcommand's (its parser's default)
        return run(args, argv)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _text_route(argv: list[str]) -> list[str]:
    """The documented spelling for text models (docs/api.md, Command line): ``train --corpus ...`` is
    ``text-train`` and ``eval`` of a text checkpoint is ``text-eval``; other command lines are returned as they are."""
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


# ---------------------------------------------------------------- parsers


COMMANDS = {  # each command's one-line summary: ``python -m training --help`` lists them, ``<command> --help`` opens with it
    "train": "train a transducer on a task and write a checkpoint folder",
    "eval": "final-label accuracy of transducer checkpoints per length band (of a text model: text-eval)",
    "compile": "compile a DFA JSON file into a checkpoint folder",
    "upgrade": "rewrite old checkpoints' config.json in the current format",
    "export": "write a run's weights as of its last resume save (between evaluations) as a checkpoint folder",
    "snap": "give a transducer codes to stay on: RegularGPT level codes, block-diagonal LRNN state codes",
    **TEXT_COMMANDS,
}


def _parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS)) + 2
    listing = "\n".join(f"  {name:<{width}}{summary}" for name, summary in COMMANDS.items())
    parser = Parser(
        prog=PROG,
        usage=f"{PROG} <command> [flags]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train and evaluate transducers on the tasks of docs/api.md (Tasks), and language models.\n\n"
        f"commands ({PROG} <command> --help lists a command's flags):\n{listing}",
        epilog=f"e.g. {PROG} train --help",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="<command>", help=argparse.SUPPRESS)

    def command(name: str) -> argparse.ArgumentParser:
        return commands.add_parser(
            name, prog=f"{PROG} {name}", description=COMMANDS[name][0].upper() + COMMANDS[name][1:] + "."
        )

    _add_train_parser(command("train"))
    _add_eval_parser(command("eval"))
    compile_parser = command("compile")
    add_compile_arguments(compile_parser)  # training/cli/compile.py
    compile_parser.set_defaults(run=lambda args, argv: run_compile(args))
    add_threads(compile_parser)
    _add_upgrade_parser(command("upgrade"))
    _add_export_parser(command("export"))
    _add_snap_parser(command("snap"))
    add_text_commands(command)  # bpe, text-train, text-eval: training/cli/text.py
    return parser


TASK_DEFAULTS = {
    "batch_size": 128,
    "lr": 3e-4,
    "optimizer": "adam",
    "beta2": 0.999,
    "weight_decay": 0.0,
    "schedule": "constant",
    "warmup_steps": 0,
    "min_lr_fraction": 0.0,
    "eval_every": 500,
    "dtype": "float32",
}


def _add_train_parser(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=_run_train)
    what = parser.add_argument_group("what to train")
    what.add_argument("--task", help="a task of docs/api.md (Tasks), e.g. parity_check")
    what.add_argument("--arch", help=f"architecture: {', '.join(TRAINABLE_ARCHITECTURES)}")
    data = parser.add_argument_group("data")
    data.add_argument("--train-lengths", type=length_range, help="A-B (default: the task's, 1-40 or 1-50)")
    data.add_argument(
        "--curriculum",
        choices=("uniform", "growing"),
        default="uniform",
        help="uniform: lengths uniform over the range throughout; growing: the longest length rises "
        "linearly from --curriculum-start to the maximum over --curriculum-fraction of the steps",
    )
    data.add_argument("--curriculum-start", type=positive_int, default=10)
    data.add_argument("--curriculum-fraction", type=probability, default=0.5)
    data.add_argument(
        "--p-one",
        type=probability_or_range,
        help="P(second symbol: '1' or 'b'; modular_arithmetic: of the digit '1'), the other symbols "
        "sharing the rest; A-B: each string draws its own P uniformly "
        "from [A, B] (mixes dense and sparse strings, for skewed inputs at test time)",
    )
    data.add_argument(
        "--p-times",
        type=probability_or_range,
        help="modular_arithmetic: P('*' among the operators), '+' and '-' sharing the rest; A-B: each string "
        "draws its own (long products, which uniform strings of the training lengths rarely hold)",
    )
    data.add_argument("--balanced", action="store_true", help="draw the final label uniformly, then the string")
    data.add_argument(
        "--power-offset-fraction",
        type=probability,
        default=0.0,
        help="the fraction of training strings whose decisive symbol lies a power of two before the "
        "last one, where dilated attention reads it in one hop (induction_heads: the '#'; such "
        "strings are rare when drawn uniformly); the evaluation keeps the task's own strings",
    )
    data.add_argument(
        "--final-only",
        action="store_true",
        help="the loss on each training string's last position only, as the RegularGPT authors' code "
        "trains (default: every position's label)",
    )
    checks = parser.add_argument_group("extrapolation evaluation")
    checks.add_argument("--eval-lengths", type=length_range, help="A-B (default: the papers protocol's range)")
    checks.add_argument("--eval-samples", type=positive_int, default=200)
    checks.add_argument("--eval-batch-size", type=positive_int, default=64)
    checks.add_argument("--target-accuracy", type=probability, help="stop once the best accuracy reaches this")
    add_training_flags(parser, TASK_DEFAULTS)


def _add_eval_parser(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=_run_eval)
    parser.add_argument(
        "--checkpoint",
        required=True,
        action="append",
        type=Path,
        help="checkpoint folder; repeat it (e.g. one per seed) for max and mean",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--protocol",
        choices=("papers", "hard", "induction"),
        help="papers: 41-500 (d*/tomita*: 51-100); hard: 501-2000 (s5/a5_generators: and 2001-5000), "
        "plus P(1)=0.1 and 0.9; "
        "induction: lengths 2^6, 2^7, ..., 2^20, fewer samples past 2^14 (default: papers)",
    )
    which.add_argument("--lengths", type=length_range, help="A-B: a custom length range, e.g. 41-500")
    parser.add_argument(
        "--bands",
        type=band_spec,
        default=10,
        help="N bands over the range (default 10), or an explicit list A-B,C-D,...",
    )
    parser.add_argument(
        "--p-one",
        type=probability,
        action="append",
        help="with --lengths or a list of --bands: sample with P(second symbol) = P instead of the "
        "task's generator (repeatable: one set of bands per value)",
    )
    parser.add_argument(
        "--p-times",
        type=probability,
        action="append",
        help="modular_arithmetic, with --lengths or a list of --bands: P('*' among the operators) = P "
        "(repeatable: one set of bands per value, each with every --p-one)",
    )
    parser.add_argument(
        "--power-offsets",
        action="store_true",
        help="draw every string with its decisive symbol a power of two before the end (induction_heads:"
        " the mark 2^k before the final '#', what RegularGPT's last position reads in one hop)",
    )
    parser.add_argument("--samples", type=positive_int, default=100, help="samples per band")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=positive_int, default=64)
    parser.add_argument(
        "--chunk-symbols",
        type=positive_int,
        help="run each batch through the model's cache in chunks of at most this many symbols "
        "(bounded memory at any length, e.g. 2^20-symbol inputs to an LRNN; default: "
        "final_logits over whole batches)",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--json", action="store_true", help="print the JSON report (schema: training/evaluation/evaluate.py)"
    )
    parser.add_argument("--plot", type=Path, help="write a PNG of accuracy against length here")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a tqdm progress bar on stderr, at a terminal (symbols evaluated)",
    )
    add_threads(parser)


def _add_upgrade_parser(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=_run_upgrade, threads=None)
    parser.add_argument("checkpoint", nargs="+", type=Path, help="checkpoint folders")


def _add_export_parser(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=_run_export, threads=None)
    parser.add_argument(
        "folder",
        metavar="RUN",
        type=Path,
        help="a training run's folder (train or text-train --out), once it has evaluated: its "
        "config.json is the checkpoint's",
    )
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint folder to write")
    parser.add_argument(
        "--best", action="store_true", help="the best weights the run has kept so far, not the last saved step's"
    )


def _run_export(args: argparse.Namespace, argv: list[str]) -> int:
    try:
        metadata = export_weights(args.folder, args.out, args.best)
    except (ResumeError, CheckpointError, TokenizerError) as error:
        raise UsageError(str(error)) from None
    print(
        f"wrote {args.out}: the {'best' if args.best else 'current'} weights of {args.folder} at step "
        f"{metadata['steps']}"
    )
    return 0


def _add_snap_parser(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=_run_snap)
    parser.add_argument(
        "--checkpoint", type=Path, required=True, help="a RegularGPT or block-diagonal LRNN transducer's folder"
    )
    parser.add_argument("--out", type=Path, required=True, help="the checkpoint folder to write")
    parser.add_argument(
        "--strings",
        type=positive_int,
        default=512,
        help="strings of the training lengths whose windows (RegularGPT) or states (LRNN) make the codes (default 512)",
    )
    lrnn = parser.add_argument_group("block-diagonal LRNN state codes")
    lrnn.add_argument(
        "--radius",
        type=positive_float,
        help=f"a block's states closer than this share a code (default {state_codes.RADIUS})",
    )
    lrnn.add_argument(
        "--every",
        type=positive_int,
        help=f"snap each block's state after every this many symbols (default {state_codes.EVERY})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    add_threads(parser)


def _run_snap(args: argparse.Namespace, argv: list[str]) -> int:
    """training/level_codes.py (RegularGPT) or training/state_codes.py (LRNN): the codes, the check on
    training-length strings, the folder."""
    loaded = _load_transducer(args.checkpoint, "cpu")
    if args.out.resolve() == args.checkpoint.resolve():
        raise UsageError("--out must be another folder than --checkpoint")
    if (args.out / CONFIG_FILE).exists() and not args.overwrite:
        raise UsageError(f"{args.out} already holds a checkpoint; pass --overwrite to replace it")
    lrnn = loaded.config.architecture == "lrnn"
    if not lrnn and (args.radius is not None or args.every is not None):
        raise UsageError("--radius and --every are for block-diagonal LRNN state codes")
    task = _task(_task_name(loaded))
    try:
        command = command_line(argv, world_size=1, local_world_size=1)
        if lrnn:
            radius, every = args.radius or state_codes.RADIUS, args.every or state_codes.EVERY
            snapped = state_codes.snap(loaded, task, args.strings, radius, every, args.seed, command)
        else:
            snapped = level_codes.snap(loaded, task, args.strings, args.seed, command)
    except level_codes.SnapError as error:
        raise UsageError(str(error)) from None
    level_codes.write(snapped, args.out)
    print(
        f"wrote {args.out}: {snapped.summary}; right at every position of {level_codes.CHECK_STRINGS} strings of "
        "the training lengths, with the codes as without"
    )
    return 0


def _run_upgrade(args: argparse.Namespace, argv: list[str]) -> int:
    """Rewrite each folder's config.json in the current format (model/config.py says what older ones meant)."""
    for folder in args.checkpoint:
        try:
            changed = upgrade_config(folder)
        except CheckpointError as error:
            raise UsageError(str(error)) from None
        print(f"{folder}: {'rewritten' if changed else 'already current'}")
    return 0


# ---------------------------------------------------------------- train


def _run_train(args: argparse.Namespace, argv: list[str]) -> int:
    metadata = launch(args, argv, None if resuming(args) else _new_transduction_run(args))
    if metadata["world_size"] == 1 or int(os.environ.get("RANK", "0")) == 0:
        best = metadata.get("best_eval")
        summary = "no evaluation"
        if best is not None:
            summary = f"best extrapolation accuracy {best['accuracy']:.4f} at step {best['step']}"
        print(
            f"wrote {args.out}: {metadata['steps']} steps in {metadata['wall_time_s']:.1f} s "
            f"(stopped: {metadata['stopped']}), {summary}"
        )
    return 0


def _new_transduction_run(args: argparse.Namespace) -> NewRun:
    """The settings, model config and objective of a new ``train`` run, all input checked."""
    require_new_run_flags(args, "--task", "--arch")
    task = _task(args.task)
    if args.arch not in TRAINABLE_ARCHITECTURES:
        kind = "is built by hand, not trained" if args.arch in ARCHITECTURE_CONFIGS else "is unknown"
        raise UsageError(f"architecture {args.arch!r} {kind}; trainable: {', '.join(TRAINABLE_ARCHITECTURES)}")
    _check_sampling(task, args.p_one, args.balanced, args.p_times)
    if args.power_offset_fraction:
        _check_power_offsets(
            task,
            "--power-offset-fraction",
            ["--p-one", "--p-times", "--balanced"],
            args.p_one is not None or args.p_times is not None or args.balanced,
        )
    _check_lengths(task, [args.train_lengths or task.train_lengths, args.eval_lengths or papers_lengths(task)])
    check_new_run(args)
    try:
        config = model_config(args.arch, task, given_model_flags(args))
    except ValueError as error:
        raise UsageError(str(error)) from None
    settings = settings_from_args(args, args.arch, target=args.target_accuracy)
    data = TaskData(
        task=task.name,
        train_lengths=args.train_lengths or task.train_lengths,
        eval_lengths=args.eval_lengths or papers_lengths(task),
        curriculum=args.curriculum,
        curriculum_start=args.curriculum_start,
        curriculum_fraction=args.curriculum_fraction,
        p_one=args.p_one,
        balanced=args.balanced,
        power_offset_fraction=args.power_offset_fraction,
        final_only=args.final_only,
        p_times=args.p_times,
        eval_samples=args.eval_samples,
        eval_batch_size=args.eval_batch_size,
    )
    return (
        settings,
        config,
        lambda settings, dist: TransductionObjective(data, settings.steps, settings.batch_size, settings.seed, dist),
    )


def _task(name: str) -> Task:
    try:
        return get_task(name)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _check_lengths(task: Task, ranges: list[tuple[int, int]]) -> None:
    too_short = [lengths for lengths in ranges if lengths[0] < task.shortest_length]
    if too_short:
        raise UsageError(
            f"{task.name} strings have at least {task.shortest_length} symbols; "
            f"length range {too_short[0][0]}-{too_short[0][1]} starts below"
        )


def _check_power_offsets(task: Task, flag: str, exclusive: list[str], excluded_given: bool) -> None:
    """``flag`` draws strings by the task's ``draw_power_offset``: the task must have them, and none of the
    ``exclusive`` sampling flags may be given (``excluded_given``)."""
    if task.draw_power_offset is None:
        raise UsageError(f"{flag}: {task.name} has no such strings (only induction_heads has)")
    if excluded_given:
        named = f"{', '.join(exclusive[:-1])} or {exclusive[-1]}" if len(exclusive) > 1 else exclusive[0]
        raise UsageError(f"{flag} draws its strings uniformly; it cannot be combined with {named}")


def _check_sampling(
    task: Task,
    p_one: float | tuple[float, float] | None,
    balanced: bool,
    p_times: float | tuple[float, float] | None = None,
) -> None:
    if balanced and (p_one is not None or p_times is not None):
        flag = "--p-one" if p_one is not None else "--p-times"
        raise UsageError(f"--balanced and {flag} cannot be combined: balanced draws condition on the label")
    if p_times is not None and task.draw_products is None:
        raise UsageError(f"--p-times: {task.name} has no operators (only modular_arithmetic has)")
    if balanced and task.draw_with_final_label is None:
        raise UsageError(f"{task.name} offers no balanced sampling")


# ---------------------------------------------------------------- eval


def _run_eval(args: argparse.Namespace, argv: list[str]) -> int:
    explicit_bands = not isinstance(args.bands, int)
    if explicit_bands and (args.lengths or args.protocol):
        raise UsageError("give --bands as a list of ranges or --lengths/--protocol, not both")
    for flag, given in (("--p-one", args.p_one), ("--p-times", args.p_times)):
        if given and not (args.lengths or explicit_bands):
            raise UsageError(f"{flag} goes with --lengths or a list of --bands; the protocols set their own")
    checkpoints = [_load_transducer(path, args.device) for path in args.checkpoint]
    task_names = sorted({_task_name(loaded) for loaded in checkpoints})
    if len(task_names) > 1:
        raise UsageError(f"the checkpoints are of different tasks ({', '.join(task_names)}); evaluate them apart")
    task = _task(task_names[0])
    for p_times in args.p_times or [None]:
        for p_one in args.p_one or [None]:
            _check_sampling(task, p_one, balanced=False, p_times=p_times)
    if args.power_offsets:
        _check_power_offsets(task, "--power-offsets", ["--p-one", "--p-times"], bool(args.p_one or args.p_times))
    if args.lengths or explicit_bands:
        ranges = args.bands if explicit_bands else split_lengths(args.lengths, args.bands)
        bands = [
            Band(lengths, p_one, p_times=p_times)
            for p_times in (args.p_times or [None])
            for p_one in (args.p_one or [None])
            for lengths in ranges
        ]
        protocol: Protocol = "custom"
    else:
        named: NamedProtocol = args.protocol or "papers"
        protocol = named
        bands = protocol_bands(task, named, args.bands, args.samples)
    _check_lengths(task, [band.lengths for band in bands])
    band_sets = draw_bands(task, bands, args.samples, args.seed, args.power_offsets)
    reports = [
        evaluate_checkpoint(
            loaded,
            protocol,
            bands,
            band_sets,
            args.seed,
            args.batch_size,
            args.chunk_symbols,
            args.power_offsets,
            progress=args.progress,
        )
        for loaded in checkpoints
    ]
    output = reports[0] if len(reports) == 1 else combine_reports(reports)
    print(json.dumps(output, indent=2) if args.json else format_table(reports))
    if args.plot:
        from training.evaluation.plots import plot_accuracy  # matplotlib only when asked for

        plot_accuracy(reports, args.plot)
    return 0


def _task_name(loaded: LoadedCheckpoint) -> str:
    assert loaded.config.task is not None  # _load_transducer refuses a checkpoint that names no task
    return loaded.config.task


def _load_transducer(path: Path, device: str) -> LoadedCheckpoint:
    try:
        loaded = load_checkpoint(path, device=device)
    except (CheckpointError, ValueError) as error:  # ValueError: a device that is not there
        raise UsageError(str(error)) from None
    if loaded.config.kind != "transduce":
        raise UsageError(
            f"{path} is a text model (kind {loaded.config.kind!r}); evaluate text models apart from transducers"
        )
    if loaded.config.task is None:
        raise UsageError(f"{path} names no task (a compiled automaton?), so there is no generator to sample from")
    return loaded
