"""The flags every training subcommand shares (``train`` and ``text-train``, each with its own defaults), and
running or resuming a run. ``--resume --out DIR`` continues the run in DIR: flags outside :data:`RESUME_FLAGS` must
have the values it started with; a folder with no save starts anew (said on stderr). Bad input exits with status 2
and one line on stderr; docs/training.md describes resuming.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from model.checkpoint import CONFIG_FILE, load_checkpoint
from model.config import ARCHITECTURE_CONFIGS, BaseModelConfig, ConfigError, dataclass_from_dict, with_added_keys
from model.registry import build_model
from model.threads import set_threads
from model.tokenizer import load_tokenizer
from training.cli.arguments import (
    UsageError,
    add_threads,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
)
from training.cli.model_flags import add_model_flags
from training.objectives.checkpointing import RESUME_FILE, ResumeError, read_resume_state
from training.objectives.distributed import Distributed, setup_distributed
from training.objectives.language_model import LanguageModelObjective, TextData
from training.objectives.loop import RunOptions, train
from training.objectives.run import Objective, TrainSettings
from training.objectives.transduction import TaskData, TransductionObjective

# Flags that may come with --resume: they do not change what the run computes (--steps only extends it).
RESUME_FLAGS = {"--resume", "--out", "--threads", "--time-budget", "--device", "--progress", "--no-progress", "--steps"}

# a new run: its settings, its model's config, and how to build its objective once the process group is up
NewRun = tuple[TrainSettings, BaseModelConfig, Callable[[TrainSettings, Distributed], Objective]]


def add_training_flags(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """The flags of every training subcommand; ``defaults`` are the objective's own (batch size, rate, ...)."""
    what = parser.add_argument_group("run folder")
    what.add_argument("--out", required=True, type=Path, help="checkpoint folder to write (train.jsonl beside)")
    what.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")
    what.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its resume.safetensors, with the settings it started with",
    )
    what.add_argument("--steps", type=positive_int, help="optimizer steps (at most)")
    what.add_argument(
        "--init-from",
        type=Path,
        metavar="DIR",
        help="start from the weights of the checkpoint in DIR (same architecture and model flags, but an "
        "LRNN's --num-blocks may be larger: the new blocks start out of the output), e.g. a "
        "curriculum's next stage; the optimizer and data start afresh",
    )
    optim = parser.add_argument_group("optimisation")
    optim.add_argument("--batch-size", type=positive_int, help="sequences per step and process")
    optim.add_argument(
        "--grad-accumulation",
        type=positive_int,
        default=1,
        help="split each step's batch into this many micro-batches (same gradient, less memory)",
    )
    optim.add_argument("--lr", type=positive_float, help="peak learning rate")
    optim.add_argument("--optimizer", choices=("adam", "adamw"))
    optim.add_argument("--beta2", type=probability, help="Adam's second-moment decay")
    optim.add_argument("--weight-decay", type=float, help="on the matrices of linear maps only")
    optim.add_argument("--schedule", choices=("constant", "cosine"), help="learning rate after the warm-up")
    optim.add_argument("--warmup-steps", type=non_negative_int, help="linear learning-rate warm-up")
    optim.add_argument("--min-lr-fraction", type=probability, help="where the cosine ends, over the peak")
    optim.add_argument("--grad-clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    optim.add_argument("--seed", type=int, default=0, help="weights, data (keyed by rank too) and evaluation set")
    optim.add_argument(
        "--soft-transition-steps",
        type=non_negative_int,
        help="LRNN with --transition-norm stochastic or delta: train this many first steps with softmax columns "
        "(delta: sigmoid write gates), then with the sparsemax (hard gates) it is served with (default: half of "
        "--steps for stochastic, 0 for delta)",
    )
    optim.add_argument(
        "--harden-steps",
        type=non_negative_int,
        help="LRNN with --transition-norm stochastic or delta: after the soft steps, blend the columns from "
        "softmax into sparsemax (delta: the gates from sigmoid into hard) over this many steps (default: half of "
        "the steps after the soft ones, 0 if no soft steps; 0 switches at once)",
    )
    optim.add_argument(
        "--determinism-weight",
        type=non_negative_float,
        help="LRNN with --transition-norm stochastic: over the soft steps, add this (rising from 0) "
        "times the mean impurity 1 - sum_i A_ij^2 of the softmax columns to the loss (default 0)",
    )
    optim.add_argument(
        "--write-weight",
        type=non_negative_float,
        help="LRNN with --transition-norm delta: add this times the layers' mean write gate (beta / 2) to the loss "
        "per scored position, so that the tokens no answer needs write exactly nothing and what was written "
        "outlives them (default 0)",
    )
    optim.add_argument(
        "--write-layers",
        type=non_negative_int,
        nargs="+",
        metavar="LAYER",
        help="with --write-weight: count only these layers' write gates (0-based; default all), e.g. 1 to leave "
        "the first layer, which must write on every token, free",
    )
    optim.add_argument(
        "--extra-levels",
        type=non_negative_int,
        help="RegularGPT: read each training position after up to this many thick layers above its "
        "depth, drawn per step (default 0); trains the state a long input's early positions carry",
    )
    optim.add_argument(
        "--freeze-embeddings",
        action="store_true",
        help="keep the token embedding (and a language model's output head, tied to it) at its initial values: "
        "--init-from's, else the random init (on the MQAR task, a frozen random embedding of 8,192 ids let "
        "the model copy ids it never saw as values: docs/text_results.md)",
    )
    checks = parser.add_argument_group("evaluation, early stopping, saving")
    checks.add_argument("--eval-every", type=non_negative_int, help="steps between evaluations (0: none)")
    checks.add_argument("--patience", type=positive_int, help="stop after this many evaluations without a new best")
    checks.add_argument(
        "--save-every",
        type=positive_int,
        help="steps between resumable saves (default: --eval-every, else 500); also at every stop",
    )
    checks.add_argument("--log-every", type=positive_int, default=10, help="steps between train.jsonl records")
    run = parser.add_argument_group("run")
    run.add_argument(
        "--time-budget",
        type=positive_float,
        help="seconds for this invocation: then save a resumable checkpoint and stop (--resume goes on)",
    )
    run.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (torchrun: the local rank's)")
    run.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        help="bfloat16: autocast for the forward pass (weights stay float32); auto: bfloat16 on CUDA",
    )
    run.add_argument("--compile", action="store_true", help="torch.compile the model for training")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="tqdm progress bar")
    add_threads(run)
    add_model_flags(parser)
    parser.set_defaults(**defaults)


def check_resume_flags(
    args: argparse.Namespace, argv: list[str], parse: Callable[[list[str]], argparse.Namespace]
) -> None:
    """With --resume, a flag outside :data:`RESUME_FLAGS` must have the value it had in the command that started
    the run (``parse``: that command's arguments, as ``argv`` is parsed); one that differs is a UsageError naming
    the flag, the run's value and the value given."""
    given = sorted({arg.split("=", 1)[0] for arg in argv if arg.startswith("--")} - RESUME_FLAGS)
    if not given or not holds_save(args.out):  # nothing to resume: the flags start the run anew
        return
    try:
        command = read_resume_state(args.out, with_tensors=False)[0]["command"]
    except ResumeError as error:
        raise UsageError(str(error)) from None
    try:
        started = parse(_training_arguments(command))
    except UsageError as error:
        raise UsageError(
            f"the command that started the run in {args.out} ({command}) does not parse here ({error}); "
            f"give only {', '.join(sorted(RESUME_FLAGS))} with --resume"
        ) from None
    if started.command != args.command:
        raise UsageError(f"the run in {args.out} was started by {started.command!r}, not {args.command!r} ({command})")
    differing = []
    for flag in given:
        dest = flag[2:].replace("-", "_")
        ran, asked = getattr(started, dest), getattr(args, dest)
        if ran != asked:
            differing.append(f"{flag} is {_shown(asked)} here but was {_shown(ran)} when the run started")
    if differing:
        raise UsageError(
            f"{'; '.join(differing)}: a resumed run goes on with the settings it started with (give "
            f"the same values or leave them out; {', '.join(sorted(RESUME_FLAGS))} may differ)"
        )


def _training_arguments(command: str) -> list[str]:
    """The arguments after ``-m training`` in a run's recorded command (``python -m training ...`` or torchrun's)."""
    words = shlex.split(command)
    starts = [index + 2 for index in range(len(words) - 1) if words[index : index + 2] == ["-m", "training"]]
    return words[starts[0] :] if starts else []


def _shown(value: Any) -> str:
    if value is None or value is False:
        return "not given"
    if value is True:
        return "given"
    return "-".join(map(str, value)) if isinstance(value, tuple) else str(value)


def holds_save(out: Path) -> bool:
    """Whether ``out`` holds a save of a run (``resume.safetensors`` or a checkpoint's ``config.json``): what
    --resume continues, or refuses with the reason; without either, --resume starts anew."""
    return any((Path(out) / name).exists() for name in (CONFIG_FILE, RESUME_FILE))


def resuming(args: argparse.Namespace) -> bool:
    """Whether the command continues a saved run: --resume, and a save in --out (:func:`holds_save`)."""
    return bool(args.resume) and holds_save(args.out)


def require_new_run_flags(args: argparse.Namespace, *flags: str) -> None:
    """A UsageError naming ``flags`` unless all were given (a new run needs them; a resumed one reads them from
    its save). With --resume it says that there is nothing to resume, so the run would start anew."""
    if all(getattr(args, flag[2:].replace("-", "_")) is not None for flag in flags):
        return
    named = " and ".join(flags)
    if args.resume:
        raise UsageError(f"nothing to resume in {args.out} (no {RESUME_FILE}), and a new run needs {named}")
    raise UsageError(f"{named} {'is' if len(flags) == 1 else 'are'} required (except with --resume)")


def check_new_run(args: argparse.Namespace) -> None:
    """A new run's --out must not hold another run, unless --overwrite."""
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out} exists and is not a folder")
    if holds_save(args.out) and not args.overwrite:
        raise UsageError(
            f"{args.out} already holds a checkpoint; pass --overwrite to replace it, or --resume to continue its run"
        )
    require_new_run_flags(args, "--steps")
    if args.eval_every == 0 and (args.patience or getattr(args, "target_accuracy", None) is not None):
        raise UsageError("--patience and --target-accuracy need evaluations: set --eval-every above 0")
    if args.grad_accumulation > args.batch_size:
        raise UsageError(f"--grad-accumulation {args.grad_accumulation} exceeds --batch-size {args.batch_size}")


def settings_from_args(args: argparse.Namespace, architecture: str, target: float | None = None) -> TrainSettings:
    save_every = args.save_every or args.eval_every or 500
    transitions = getattr(args, "transition_norm", None) if architecture == "lrnn" else None
    stochastic, softened = transitions == "stochastic", transitions in ("stochastic", "delta")
    if args.soft_transition_steps is not None and not softened:
        raise UsageError("--soft-transition-steps applies to --arch lrnn --transition-norm stochastic or delta only")
    if args.harden_steps is not None and not softened:
        raise UsageError("--harden-steps applies to --arch lrnn --transition-norm stochastic or delta only")
    soft_steps = args.soft_transition_steps
    if soft_steps is None:  # the delta rule's hard gates bind as fast and reach further (docs/text_results.md)
        soft_steps = args.steps // 2 if stochastic else 0
    harden_steps = args.harden_steps
    if harden_steps is None:  # half of the steps after the soft ones; none after none (a run that starts hard)
        harden_steps = max(0, args.steps - soft_steps) // 2 if soft_steps else 0
    if args.determinism_weight is not None and not (stochastic and soft_steps):
        raise UsageError(
            "--determinism-weight applies to the soft steps of --arch lrnn --transition-norm stochastic only"
        )
    if args.write_weight is not None and transitions != "delta":
        raise UsageError("--write-weight applies to --arch lrnn --transition-norm delta only")
    if args.write_layers is not None and not args.write_weight:
        raise UsageError("--write-layers needs --write-weight")
    if args.extra_levels and architecture != "regulargpt":
        raise UsageError("--extra-levels applies to --arch regulargpt only")
    return TrainSettings(
        architecture=architecture,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        optimizer=args.optimizer,
        beta2=args.beta2,
        weight_decay=args.weight_decay,
        schedule=args.schedule,
        warmup_steps=args.warmup_steps,
        min_lr_fraction=args.min_lr_fraction,
        grad_clip=args.grad_clip,
        grad_accumulation=args.grad_accumulation,
        seed=args.seed,
        eval_every=args.eval_every,
        save_every=save_every,
        patience=args.patience,
        target=target,
        log_every=args.log_every,
        dtype=args.dtype,
        compile=args.compile,
        soft_transition_steps=soft_steps if softened else 0,
        harden_steps=harden_steps if softened else 0,
        determinism_weight=args.determinism_weight or 0.0,
        write_weight=args.write_weight or 0.0,
        write_layers=tuple(sorted(set(args.write_layers))) if args.write_layers is not None else None,
        extra_levels=args.extra_levels or 0,
        freeze_embedding=args.freeze_embeddings,
    )


def launch(args: argparse.Namespace, argv: list[str], new_run: NewRun | None) -> dict[str, Any]:
    """Start the run ``new_run`` describes, or (None) continue the one in ``args.out``; returns its metadata. A new
    run under --resume (nothing to resume: :func:`resuming`) says on stderr that it starts from step 0."""
    try:
        dist = setup_distributed(args.device)
    except ValueError as error:
        raise UsageError(str(error)) from None
    try:
        threads = set_threads(args.threads, processes=dist.local_world_size)
        command = command_line(argv, dist.world_size, dist.local_world_size)
        options = RunOptions(time_budget_s=args.time_budget, progress=args.progress, threads=threads)
        if new_run is not None:
            settings, model_config, make_objective = new_run
            layers = getattr(model_config, "n_layers", 0)
            if settings.write_layers is not None and max(settings.write_layers) >= layers:
                raise UsageError(
                    f"--write-layers: the model's layers are 0-{layers - 1}, not {max(settings.write_layers)}"
                )
            initial = None if args.init_from is None else initial_weights(args.init_from, settings, model_config)
            objective = _built(lambda: make_objective(settings, dist))
            if args.resume and dist.is_main:
                print(
                    f"nothing to resume in {args.out} (no {RESUME_FILE}): starting the run from step 0", file=sys.stderr
                )
            return train(settings, objective, model_config, args.out, command, dist, options, initial=initial)
        state, _ = read_resume_state(args.out, with_tensors=False)
        later_options = (
            "soft_transition_steps",
            "harden_steps",
            "determinism_weight",
            "extra_levels",
            "freeze_embedding",
            "write_weight",
            "write_layers",
        )
        defaults = {field.name: field.default for field in dataclasses.fields(TrainSettings)}
        for option in later_options:  # runs saved before these options existed ran without them: the defaults
            state["settings"].setdefault(option, defaults[option])
        saved = dataclass_from_dict(TrainSettings, state["settings"], where="resume settings")
        steps = args.steps or saved.steps
        evaluation_left = state["run"].get("evaluation_pending", False) and state["run"]["step"] == steps
        if state["run"]["step"] >= steps and not evaluation_left:
            raise UsageError(
                f"the run in {args.out} is at step {state['run']['step']} of {saved.steps} "
                f"(stopped: {state['run']['stopped']}); give --steps above {state['run']['step']} "
                "to go on"
            )
        settings = dataclasses.replace(saved, steps=steps)
        architecture = state["architecture"]  # a run saved before a model key existed ran as older files mean it
        model = with_added_keys(architecture, state["model"])
        model_config = dataclass_from_dict(ARCHITECTURE_CONFIGS[architecture], model, where="resume model")
        objective = _built(lambda: _resumed_objective(state["objective"], settings, args.out, dist))
        return train(settings, objective, model_config, args.out, state["command"], dist, options, resume=command)
    except (ResumeError, ConfigError) as error:
        raise UsageError(str(error)) from None
    finally:
        dist.close()


def initial_weights(folder: Path, settings: TrainSettings, model_config: BaseModelConfig) -> dict[str, torch.Tensor]:
    """The weights of the checkpoint in ``folder`` for a new run of this architecture and config (an LRNN with
    fewer blocks grows: ``BlockDiagonalLRNN.grown_from``); a UsageError naming what differs otherwise."""
    try:
        loaded = load_checkpoint(folder, device="cpu")
    except ValueError as error:  # CheckpointError, ConfigError: missing, unreadable
        raise UsageError(f"--init-from {folder}: {error}") from None
    if loaded.config.architecture != settings.architecture:
        raise UsageError(
            f"--init-from {folder} is a {loaded.config.architecture} checkpoint, not {settings.architecture}"
        )
    theirs, ours = dataclasses.asdict(loaded.config.model), dataclasses.asdict(model_config)
    differing = [name for name in ours if theirs.get(name) != ours[name]]
    if differing == ["num_blocks"] and settings.architecture == "lrnn" and theirs["num_blocks"] < ours["num_blocks"]:
        torch.manual_seed(settings.seed)  # the new blocks' weights are those the run's own model starts with
        grown = build_model(settings.architecture, model_config)
        from model.lrnn.model import BlockDiagonalLRNN  # loaded by build_model just now

        assert isinstance(grown, BlockDiagonalLRNN)  # the "lrnn" architecture's model
        try:
            return grown.grown_from(loaded.model.state_dict())
        except ValueError as error:  # a delta-rule LRNN, or weights that are not this LRNN's
            raise UsageError(f"--init-from {folder}: {error}") from None
    if differing:
        named = "; ".join(f"{name} {theirs.get(name)} there, {ours[name]} here" for name in differing)
        raise UsageError(f"--init-from {folder} holds another model: {named}")
    return loaded.model.state_dict()


def _built(build: Callable[[], Objective]) -> Objective:
    try:
        return build()
    except ValueError as error:  # a corpus, tokenizer or task that does not fit
        raise UsageError(str(error)) from None


def _resumed_objective(saved: dict[str, Any], settings: TrainSettings, out: Path, dist: Distributed) -> Objective:
    """The objective of a run being resumed, from the settings its resume file holds."""
    fields = {key: value for key, value in saved.items() if key != "name"}
    if saved["name"] == TransductionObjective.name:
        fields = {"power_offset_fraction": 0.0, "final_only": False, **fields}  # runs saved before the options
        data = dataclass_from_dict(TaskData, fields, where="resume task data")
        return TransductionObjective(data, settings.steps, settings.batch_size, settings.seed, dist)
    fields = {
        "passkey_fraction": 0.0,
        "state_passing": False,
        "passkey_distractors": 0,
        "passkey_span": 1,
        "recall_span": 1,
        "state_reset": 0.0,
        "passkey_number_forms": False,
        "passkey_fresh": False,
        "teacher": None,
        "teacher_weight": 0.0,
        "mqar_value_tokens": 1,
        **fields,
    }  # runs saved before these options
    fields.pop("passkey_steps", None)  # in older saves; the schedule follows the run's --steps
    data = dataclass_from_dict(TextData, fields, where="resume text data")
    tokenizer = load_tokenizer(data.tokenizer, out)  # a ranks file was copied into the run folder
    return LanguageModelObjective(
        data,
        tokenizer,
        None,
        settings.steps,
        settings.batch_size,
        settings.seed,
        evaluate=settings.eval_every > 0,
        dist=dist,
    )


def command_line(argv: list[str], world_size: int, local_world_size: int) -> str:
    """The command as typed: ``python -m training ...`` or its torchrun form."""
    if world_size == 1:
        launcher = ["python", "-m", "training"]
    else:
        nodes = [f"--nnodes={world_size // local_world_size}"] if world_size != local_world_size else []
        launcher = ["torchrun", *nodes, f"--nproc_per_node={local_world_size}", "-m", "training"]
    return shlex.join(launcher + argv)
