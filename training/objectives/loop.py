"""The one training loop of ``python -m training train`` (transducers) and ``text-train`` (language models).

What is trained on differs only in its :class:`Objective` (training/objectives/transduction.py, training/objectives/language_model.py):
where batches come from, how the model is evaluated, what the checkpoint says. Everything else is here, the
same for both: per-position cross-entropy over the real positions of a batch (padding is ``IGNORE_INDEX``),
gradient accumulation, Adam or AdamW with weight decay on the matrices of linear maps only, a linear warm-up
then a constant or cosine learning rate (a function of the step alone), gradient clipping, bfloat16 autocast,
optional ``torch.compile``, evaluation every ``eval_every`` steps with early stopping, and resumable runs.

Resuming: before every evaluation (one that dies, out of memory, loses no steps; a resume repeats it), at each
``save_every``-th step that did not evaluate, and whenever the run stops (steps done, early stop, ``time_budget_s``
spent, SIGTERM or SIGINT), ``resume.safetensors`` in the output folder is replaced (atomically) by everything the
run needs to go on as if it had not stopped: the weights, the optimizer's state, the best weights so far, every
process's random streams and data position, the step (and whether its evaluation is still to run), the log figures
since the last record, the elapsed time and the log's length. ``train(..., resume=True)`` continues from it; the log
is cut back to that length (records written after the save are written again, none twice) and continues. A resumed
run ends bitwise-equal to one never stopped (same device and thread count; tested on the CPU in float32).
Every save (this one, and the checkpoint's) writes a temporary file ``.NAME.tmp`` beside ``NAME`` and renames it
into place; a save killed before its rename leaves that file, and the next run on the folder (new or resumed)
starts by deleting those exact names (:func:`remove_stale_temporaries`, said on stderr) and nothing else.
Signals: the first SIGTERM or SIGINT finishes the current step, saves and returns (the command exits 0 within
a step and a save); under torchrun every process stops at the same step.

Threads: the command line sets torch's intra-op threads by model/threads.py's rule unless ``--threads``.

Progress (``--progress``, rank 0): a tqdm bar of steps with the loss, accuracy and tokens/s of the last logged
window; under ``time_budget_s`` it counts to the step the budget ends at, at this invocation's pace so far, when
that comes before the last step (so its ETA is the budget's, not that of ``--steps 100000``).

The output folder: the checkpoint (``config.json``, ``model.safetensors``: the best weights by the evaluation
score for a transducer, the latest for a language model; saved at every evaluation too, so a cut run leaves a
loadable model), ``resume.safetensors`` and the log ``train.jsonl``, one JSON object per line with an ``event``:

- ``"start"``: ``command``, ``architecture``, ``model``, ``parameters``, ``world_size``, ``device``, ``dtype``,
  ``threads``, and the objective's (``task`` or ``corpus``, ``tokenizer``, ``train_tokens``);
- ``"resume"``: ``command``, ``step`` (the step the run goes on after), ``threads``;
- ``"train"`` every ``log_every`` steps and at the last: ``step``, ``loss`` and ``accuracy`` (per position, over
  the real positions of the steps since the previous record, all processes), ``tokens`` (positions trained on so
  far, all processes), ``tokens_per_s`` (since the previous record), ``lr``, ``grad_norm`` (before clipping, the
  last step), ``elapsed_s`` (over every part of a resumed run), and the objective's (``max_length``);
- ``"eval"``: ``step``, the objective's figures (``accuracy`` ... or ``validation_loss`` ...), ``best_score``,
  ``best_step``;
- ``"end"``: ``step``, ``stopped`` ("steps", "target", "patience", "time" or "signal"), ``best_score``,
  ``best_step``, ``wall_time_s``, ``tokens``, ``param_sha256`` (each process's weights, in rank order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from model.base import InferenceCache, SequenceModel
from model.checkpoint import CONFIG_FILE, FILE_MODE, WEIGHTS_FILE, read_config, save_checkpoint
from model.config import BaseModelConfig, CheckpointConfig
from model.registry import build_model
from model.tokenizer import FILE_PREFIX, ranks_file
from training.data.batches import IGNORE_INDEX, Batch
from training.objectives.carried import carried_values, new_carried_state, reset_rows, restore_carried
from training.objectives.distributed import Distributed

if TYPE_CHECKING:
    from training.objectives.distill import Teacher

LOG_FILE = "train.jsonl"
RESUME_FILE = "resume.safetensors"
RESUME_FORMAT = 1
TRAIN_STREAM = 0  # key of the training data's random stream (with the seed and the rank)
EXTRA_LEVELS_STREAM = 1  # key of the per-step draw of extra_levels (with the seed and the step)


class ResumeError(ValueError):
    """A run that cannot be resumed; the message says why."""


@dataclass(frozen=True)
class TrainSettings:
    """Everything that decides a run's result besides the model's hyper-parameters and the objective's data.

    ``batch_size`` counts sequences per optimizer step and process; ``grad_accumulation`` splits them into that
    many micro-batches (the same gradient, less memory). ``lr`` is the peak rate: ``warmup_steps`` rise linearly
    to it, then "constant", or "cosine" down to ``min_lr_fraction`` of it at ``steps``. ``patience``: stop after
    that many evaluations without a better score; ``target``: stop once the best score reaches it.
    ``soft_transition_steps``: a stochastic LRNN trains its first that many steps with softmax columns, then with
    the sparsemax columns it is evaluated and served with (model/lrnn/model.py says why); 0 for every other model.
    ``determinism_weight``: over those steps the loss also counts the mean impurity 1 - sum_i A_ij^2 of the
    softmax columns (0 when each is one-hot), weighted from 0 at the first step up to this at the last soft one.
    ``extra_levels``: RegularGPT reads each position of a training step that many thick layers above its depth,
    the number drawn per step from 0 to this (:func:`extra_levels`; model/regulargpt/model.py says why); 0 otherwise.
    """

    architecture: str
    steps: int
    batch_size: int
    lr: float
    optimizer: Literal["adam", "adamw"] = "adam"
    beta2: float = 0.999
    weight_decay: float = 0.0
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_fraction: float = 0.0
    grad_clip: float = 1.0
    grad_accumulation: int = 1
    seed: int = 0
    eval_every: int = 500
    save_every: int = 500
    patience: int | None = None
    target: float | None = None
    log_every: int = 10
    dtype: Literal["auto", "float32", "bfloat16"] = "float32"
    compile: bool = False
    soft_transition_steps: int = 0
    determinism_weight: float = 0.0
    extra_levels: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class RunOptions:
    """What may differ between the parts of a resumed run without changing its result."""

    time_budget_s: float | None = None  # of this invocation: then save and stop
    progress: bool = True
    threads: int | None = None  # recorded in the log only


@dataclass
class Evaluation:
    """An objective's evaluation: its log figures and the score (higher is better) that picks the best model."""

    figures: dict[str, Any]
    score: float


class Objective(ABC):
    """What a run trains on: batches, evaluation, and what the checkpoint folder says about the model."""

    name: str
    keep_best: bool  # the checkpoint holds the best-scoring weights (else the latest)
    # Row i of each batch continues row i of the last: the loop starts it from the state the model ended that row
    # in (a recurrent model's cache, the gradient cut), and saves the states with a resumable run.
    carries_state: bool = False
    # A language model whose distributions the rows of ``Batch.distilled`` learn beside their targets
    # (training/objectives/distill.py); its carried states are saved with a resumable run.
    teacher: Teacher | None = None

    @abstractmethod
    def batch(self, rng: np.random.Generator, step: int) -> Batch:
        """The training batch of ``step`` (1-based) for this process, on the CPU."""

    @abstractmethod
    def evaluate(self, model: SequenceModel, dist: Distributed) -> Evaluation | None:
        """Evaluate ``model`` (every process takes part; figures summed over them); None: nothing to evaluate."""

    @abstractmethod
    def checkpoint_config(self, architecture: str, model_config: BaseModelConfig,
                          metadata: dict[str, Any]) -> CheckpointConfig:
        """The config.json of a checkpoint of this run."""

    def start_figures(self) -> dict[str, Any]:
        """Extra fields of the log's start record."""
        return {}

    def train_figures(self, step: int) -> dict[str, Any]:
        """Extra fields of a train record."""
        return {}

    def metadata(self, run: RunState) -> dict[str, Any]:
        """Extra fields of the checkpoint's metadata."""
        return {}

    def write_files(self, out: Path) -> None:
        """Files the checkpoint needs besides config.json and model.safetensors (e.g. the tokenizer's ranks)."""

    def settings(self) -> dict[str, Any]:
        """The objective's settings, as saved with the run (JSON values)."""
        return {}

    def data_state(self) -> Any:
        """This process's data position beyond its random stream (JSON values), for resuming."""
        return None

    def load_data_state(self, state: Any) -> None:
        """Restore :meth:`data_state`."""


@dataclass
class RunState:
    """Where a run is: the part of the state that is not tensors (saved as JSON in the resume file)."""

    step: int = 0
    stopped: str | None = None
    best_score: float | None = None
    best_step: int | None = None
    evaluations_since_best: int = 0
    last_evaluation: dict[str, Any] | None = None
    window: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # this process's loss sum, correct, positions
    tokens: int = 0  # positions trained on, all processes
    elapsed_s: float = 0.0  # over every part of the run
    log_bytes: int = 0
    evaluation_pending: bool = False  # saved between a step and its evaluation: a resumed run evaluates first


# ---------------------------------------------------------------- the loop


def train(
    settings: TrainSettings,
    objective: Objective,
    model_config: BaseModelConfig,
    out: Path,
    command: str,
    dist: Distributed,
    options: RunOptions = RunOptions(),
    resume: str | None = None,
    stop_requested: Callable[[], bool] | None = None,
    initial: dict[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Run training, or continue the run in ``out`` (``resume``: the command line that continues it; ``command``
    stays the one that started it); rank 0 writes the folder. Returns the checkpoint's metadata.

    ``stop_requested``: a callable polled after every step, like the signals and the time budget (tests use it to
    cut a run at a given step). ``initial``: a new run's first weights (``--init-from``) instead of the seed's.
    """
    started = time.perf_counter()
    torch.manual_seed(settings.seed)  # the same initial weights on every process
    model = build_model(settings.architecture, model_config).to(dist.device).train()
    if initial is not None and resume is None:
        model.load_state_dict(initial)
    optimizer = _optimizer(model, settings)
    rng = np.random.default_rng([settings.seed, TRAIN_STREAM, dist.rank])
    run, best_state = RunState(), None
    carried = new_carried_state(model, settings.batch_size) if objective.carries_state else None
    out = Path(out)
    if resume is not None:
        run, best_state = _load_resume(out, model, optimizer, rng, objective, dist, carried)
        run.stopped = None
    if dist.is_main and (removed := remove_stale_temporaries(out)):
        print(f"removed {len(removed)} temporary file(s) of saves killed before their rename from {out}: "
              f"{', '.join(path.name for path in removed)}", file=sys.stderr)
    trained = dist.wrap(torch.compile(model, dynamic=True) if settings.compile else model)  # lengths vary
    use_bfloat16 = settings.dtype == "bfloat16" or (settings.dtype == "auto" and dist.device.type == "cuda")

    log = _open_log(out, dist, run.log_bytes if resume is not None else None)
    if dist.is_main and resume is None:  # what a resume reads besides resume.safetensors, before a run can be killed
        objective.write_files(out)
    if resume is not None:
        _write(log, event="resume", command=resume, step=run.step, threads=options.threads)
    else:
        _write(log, event="start", command=command, architecture=settings.architecture,
               model=dataclasses.asdict(model_config), parameters=sum(p.numel() for p in model.parameters()),
               world_size=dist.world_size, device=str(dist.device), dtype="bfloat16" if use_bfloat16 else "float32",
               threads=options.threads, **objective.start_figures())
    elapsed_before = run.elapsed_s
    window_started, window_tokens = time.perf_counter(), 0
    bar = tqdm(total=settings.steps if options.time_budget_s is None else None,  # under a budget: after a step
               initial=run.step, desc=f"{objective.name} {settings.architecture}", unit="step", dynamic_ncols=True,
               disable=not (dist.is_main and options.progress))
    first_step, loop_started = run.step, time.perf_counter()
    with _stop_signals() as signalled:
        while (run.step < settings.steps or run.evaluation_pending) and run.stopped is None:
            cut = out_of_time = False
            if not run.evaluation_pending:  # else resumed from the save before this step's evaluation
                run.step += 1
                for group in optimizer.param_groups:
                    group["lr"] = settings.lr * lr_factor(settings, run.step)
                if settings.soft_transition_steps:
                    _set_soft_transitions(model, run.step <= settings.soft_transition_steps,
                                          track_impurity=settings.determinism_weight > 0)
                if settings.extra_levels:
                    model.extra_levels = extra_levels(settings, run.step)
                batch = objective.batch(rng, run.step)
                grad_norm, step_tokens, carried = _train_step(trained, optimizer, batch, settings, run, dist,
                                                              use_bfloat16, carried, objective.teacher)
                window_tokens += step_tokens
                if options.time_budget_s is not None:
                    now = time.perf_counter()
                    bar.total = progress_total(settings.steps, run.step,
                                               (now - loop_started) / (run.step - first_step),
                                               options.time_budget_s - (now - started))
                bar.update(1)
                run.elapsed_s = elapsed_before + time.perf_counter() - started
                out_of_time = (options.time_budget_s is not None
                               and time.perf_counter() - started >= options.time_budget_s)
                cut = signalled() or bool(stop_requested and stop_requested())
                # every process stops at the same step; a cut run logs and evaluates as if it went on (bitwise resume)
                cut, out_of_time = (value > 0 for value in dist.sum([float(cut), float(out_of_time)]))
                if run.step % settings.log_every == 0 or run.step == settings.steps:
                    loss_sum, correct, positions = dist.sum(run.window)
                    run.window = [0.0, 0.0, 0.0]
                    now = time.perf_counter()
                    speed = dist.sum([float(window_tokens)])[0] / max(now - window_started, 1e-9)
                    _write(log, event="train", step=run.step, loss=loss_sum / positions,
                           accuracy=correct / positions, tokens=run.tokens, tokens_per_s=speed,
                           lr=optimizer.param_groups[0]["lr"], grad_norm=grad_norm, elapsed_s=run.elapsed_s,
                           **objective.train_figures(run.step))
                    bar.set_postfix({"loss": f"{loss_sum / positions:.4f}", "acc": f"{correct / positions:.3f}",
                                     "tokens/s": f"{speed:,.0f}"})
                    window_started, window_tokens = now, 0
                if settings.eval_every and (run.step % settings.eval_every == 0 or run.step == settings.steps):
                    # saved first, so that an evaluation that dies (out of memory) loses none of the steps
                    run.evaluation_pending = True
                    _save_resume(out, model, optimizer, rng, objective, run, best_state, settings, model_config,
                                 command, log, dist, carried)
            last, evaluated = run.step == settings.steps, run.evaluation_pending
            if evaluated:
                best_state = _evaluate(model, objective, settings, run, dist, log, best_state)
                run.evaluation_pending = False
                if dist.is_main:  # kept on disk as it goes, so a cut run leaves a loadable model
                    _save_checkpoint(model, best_state, objective, settings, model_config, out, command, dist, run)
            if run.stopped is None:
                run.stopped = "steps" if last else "signal" if cut else "time" if out_of_time else None
            # a step that evaluated was saved just before (a resume repeats the evaluation): not a second time
            if run.stopped is not None or (run.step % settings.save_every == 0 and not evaluated):
                _save_resume(out, model, optimizer, rng, objective, run, best_state, settings, model_config,
                             command, log, dist, carried)
    bar.close()

    metadata = _metadata(settings, objective, command, dist, run)
    digests = dist.gather(weights_digest(model))
    if dist.is_main:
        _save_checkpoint(model, best_state, objective, settings, model_config, out, command, dist, run)
        _write(log, event="end", step=run.step, stopped=run.stopped, best_score=run.best_score,
               best_step=run.best_step, wall_time_s=run.elapsed_s, tokens=run.tokens, param_sha256=digests)
        log.close()
    return metadata


def progress_total(steps: int, step: int, seconds_per_step: float, seconds_left: float) -> int:
    """The step the progress bar counts to, after ``step``: ``steps``, or the step at which the time left ends at
    the pace so far if that comes first."""
    return min(steps, step + max(0, math.ceil(seconds_left / max(seconds_per_step, 1e-9))))


def _train_step(
    trained: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, settings: TrainSettings,
    run: RunState, dist: Distributed, use_bfloat16: bool, carried: InferenceCache | None = None,
    teacher: Teacher | None = None,
) -> tuple[float, int, InferenceCache | None]:
    """One optimizer step over ``batch`` in ``grad_accumulation`` micro-batches: the loss is the mean over the
    whole batch's real positions, whatever the split. With ``carried`` (the rows' states, state passing) each row
    starts from its state and the states it ends in are returned, detached. With ``teacher``, the rows of
    ``batch.distilled`` learn its distributions too (training/objectives/distill.py). Returns the gradient norm before
    clipping, the number of real positions (this process) and the states carried on."""
    positions = int((batch.targets != IGNORE_INDEX).sum())
    selects_positions = getattr(trained, "module", trained).selects_positions  # under DDP: the model's
    weight = determinism_weight(settings, run.step)
    optimizer.zero_grad(set_to_none=True)
    parts = batch.split(settings.grad_accumulation)
    row_groups = torch.arange(len(batch.lengths)).tensor_split(settings.grad_accumulation)
    if carried is not None and batch.fresh is not None and bool(batch.fresh.any()):
        carried = reset_rows(getattr(trained, "module", trained), carried, batch.fresh)
    if teacher is not None:
        teacher.begin(batch.fresh)
    ended = []
    for part, rows in zip(parts, row_groups):
        part = part.to(dist.device)
        cache = None if carried is None else carried.select(rows.tolist())
        scored = part.targets != IGNORE_INDEX  # (b, T)
        targets = part.targets
        soft = soft_weights = None
        if teacher is not None and batch.distilled is not None:
            soft = teacher.probabilities(part.tokens, rows.tolist())  # (b, T, V)
            taught = batch.distilled[rows].to(dist.device, torch.float32) * teacher.weight  # (b,)
            soft_weights = taught[:, None].expand_as(targets)  # (b, T)
        with torch.autocast(dist.device.type, dtype=torch.bfloat16, enabled=use_bfloat16):
            if selects_positions and not bool(scored.all()):  # the head on the scored positions only
                logits, targets = trained(part.tokens, cache, positions=scored), part.targets[scored]  # (N, V), (N,)
                if soft is not None:
                    soft, soft_weights = soft[scored], soft_weights[scored]  # (N, V), (N,)
            else:
                logits = trained(part.tokens, cache)  # (b, T, V)
        if cache is not None:
            ended.append(cache)
        loss_sum, correct = masked_loss(logits.float(), targets, soft, soft_weights)
        del soft
        penalised = loss_sum
        if weight:  # the impurity counted once per real position, like the loss
            penalised = loss_sum + weight * int((part.targets != IGNORE_INDEX).sum()) * _impurity(trained)
        (penalised / positions).backward()
        run.window[0] += float(target_loss(loss_sum))
        run.window[1] += correct
    run.window[2] += positions
    grad_norm = torch.nn.utils.clip_grad_norm_(trained.parameters(), settings.grad_clip or math.inf)
    optimizer.step()
    run.tokens += positions * dist.world_size
    if carried is not None:
        with torch.no_grad():  # the gradient is cut between steps
            carried = type(carried).stack(ended)
    if teacher is not None:
        teacher.end()
    return float(grad_norm), positions, carried


def _set_soft_transitions(model: torch.nn.Module, soft: bool, track_impurity: bool = False) -> None:
    """Switch every layer that has two training phases (``soft_transitions``: the stochastic LRNN's), and whether
    its soft phase keeps its columns' impurity for :func:`_impurity`."""
    for module in model.modules():
        if hasattr(module, "soft_transitions"):
            module.soft_transitions = soft
            module.track_impurity = soft and track_impurity


def extra_levels(settings: TrainSettings, step: int) -> int:
    """The thick layers RegularGPT adds above each position's depth at ``step``: uniform in 0..extra_levels, a
    function of the seed and the step alone (the same in every process and after a resume)."""
    return int(np.random.default_rng([settings.seed, step, EXTRA_LEVELS_STREAM]).integers(settings.extra_levels + 1))


def determinism_weight(settings: TrainSettings, step: int) -> float:
    """The weight of the columns' impurity in the loss at ``step``: rising linearly to ``determinism_weight`` over
    the soft phase, 0 after it."""
    if step > settings.soft_transition_steps:
        return 0.0
    return settings.determinism_weight * step / settings.soft_transition_steps


def _impurity(model: torch.nn.Module) -> torch.Tensor | float:
    """The sum over layers of the impurity their last forward pass kept, taken from them (0 when none kept one)."""
    kept = []
    for module in model.modules():
        if getattr(module, "impurity", None) is not None:
            kept.append(module.impurity.float())
            module.impurity = None
    return sum(kept, 0.0)


def masked_loss(logits: torch.Tensor, targets: torch.Tensor, soft: torch.Tensor | None = None,
                soft_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """logits (B, T, V), targets (B, T) (or (N, V), (N,)) -> summed cross-entropy over the real positions, correct
    argmaxes. With a gradient to take, through :class:`SummedCrossEntropy`; there ``soft`` (B, T, V) (or (N, V)), a
    teacher's distributions, and ``soft_weights`` (B, T) (or (N,)) make each position's loss (1 - w) times its
    target's cross-entropy plus w times the teacher's (training/objectives/distill.py). The loss returned is then that mixture
    (the one to take the gradient of); :func:`target_loss` reads the targets' own from it."""
    flat_logits, flat_targets = logits.flatten(0, -2), targets.flatten()
    if torch.is_grad_enabled() and logits.requires_grad:
        flat_soft = None if soft is None else soft.flatten(0, -2)
        flat_weights = None if soft_weights is None else soft_weights.flatten()
        loss_sum = SummedCrossEntropy.apply(flat_logits, flat_targets, flat_soft, flat_weights)
    else:
        loss_sum = F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum")
    correct = int(((logits.argmax(dim=-1) == targets) & (targets != IGNORE_INDEX)).sum())
    return loss_sum, correct


def target_loss(loss_sum: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of the targets alone, detached, from :func:`masked_loss`'s loss (with soft targets,
    :class:`SummedCrossEntropy` keeps it beside the mixture it returns)."""
    return getattr(loss_sum, "target_loss", loss_sum).detach()


class SummedCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")`` with its gradient made in the
    forward pass: softmax(logits) less 1 at each target, 0 on ignored rows, kept in the one (N, V) buffer that
    autograd's log-softmax would keep, and scaled in the backward. torch's path writes a log-softmax, then in the
    backward a zeroed (N, V) gradient, a scatter and the log-softmax's backward (an exp per entry again): a step of
    4 windows of 2,048 tokens of a stochastic LRNN (vocabulary 8,192, blocks of 16), one CPU thread, went from
    2.75-2.92 s to 2.21-2.49 s (docs/training.md). The loss of a row is -log of its target's probability, or, where
    that probability is below 1e-30 (float32 would lose it), logsumexp less the target's logit on those rows.

    With ``soft`` (N, V) (a teacher's distributions, each summing to 1) and ``weights`` (N,): row n's loss is (1 -
    w_n) times its target's plus w_n times the teacher's cross-entropy, logsumexp(logits) - sum_v soft_v logits_v,
    and its gradient softmax(logits) - (1 - w_n) onehot(target) - w_n soft. The targets' own summed loss is kept
    on the result as ``target_loss`` (:func:`target_loss`).
    logits (N, V) float, targets (N,) -> () summed loss."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, soft: torch.Tensor | None = None,
                weights: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        real = targets != IGNORE_INDEX  # (N,)
        index = targets.clamp(min=0).unsqueeze(1)  # (N, 1)
        gradient = torch.softmax(logits, dim=-1)  # (N, V): becomes the gradient in place
        picked = gradient.gather(1, index).squeeze(1)  # (N,) the targets' probabilities
        losses = -picked.log()
        tiny = (real & (picked < 1e-30)).nonzero().squeeze(1)
        if len(tiny):
            rows = logits[tiny]
            losses[tiny] = torch.logsumexp(rows, dim=-1) - rows.gather(1, index[tiny]).squeeze(1)
        target_sum = losses.masked_fill(~real, 0.0).sum()
        hard = torch.ones_like(picked) if weights is None else 1.0 - weights  # (N,) the targets' share
        gradient.scatter_add_(1, index, -hard.unsqueeze(1))
        if soft is not None and weights is not None:
            gradient.addcmul_(soft, weights.unsqueeze(1), value=-1.0)
            # the teacher's cross-entropy, logsumexp(logits) - sum_v soft_v logits_v, with logsumexp read off the
            # targets' loss (logsumexp less the target's logit): no more passes or buffers over (N, V)
            log_total = losses + logits.gather(1, index).squeeze(1)  # (N,)
            taught = log_total - torch.linalg.vecdot(soft, logits)  # (N,)
            losses = hard * losses + weights * taught
        gradient[~real] = 0.0
        ctx.save_for_backward(gradient)
        total = losses.masked_fill(~real, 0.0).sum()
        if soft is not None:
            total.target_loss = target_sum
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (gradient,) = ctx.saved_tensors  # scaled in place (a new buffer took back most of the gain): a second
        return gradient.mul_(grad_output), None, None, None  # backward through the graph meets autograd's check


def _evaluate(
    model: SequenceModel, objective: Objective, settings: TrainSettings, run: RunState, dist: Distributed,
    log: TextIO | None, best_state: dict[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor] | None:
    """Evaluate, update the best score (a tie keeps the later weights, trained longer, but does not reset the
    patience) and decide early stopping. Returns the best weights (held only when the objective keeps them)."""
    model.eval()
    evaluation = objective.evaluate(model, dist)
    model.train()
    if evaluation is None:
        return best_state
    improved = run.best_score is None or evaluation.score > run.best_score
    if improved or evaluation.score == run.best_score:
        run.best_score, run.best_step = evaluation.score, run.step
        if objective.keep_best:
            best_state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    run.evaluations_since_best = 0 if improved else run.evaluations_since_best + 1
    run.last_evaluation = {"step": run.step, **evaluation.figures}
    _write(log, event="eval", step=run.step, **evaluation.figures, best_score=run.best_score,
           best_step=run.best_step)
    if settings.target is not None and run.best_score >= settings.target:
        run.stopped = "target"
    elif settings.patience is not None and run.evaluations_since_best >= settings.patience:
        run.stopped = "patience"
    return best_state


# ---------------------------------------------------------------- optimizer and schedule


def decayed_parameter_names(model: torch.nn.Module) -> set[str]:
    """The parameters weight decay applies to: the matrices of linear maps (Linear, Embedding, LSTM weights),
    not norms, biases, or other vectors and tables (the LRNN's transition bias, RegularGPT's relative biases
    and null keys)."""
    names = set()
    for prefix, module in model.named_modules():
        for name, parameter in module.named_parameters(recurse=False):
            matrix = isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and name == "weight"
            matrix = matrix or (isinstance(module, torch.nn.LSTM) and name.startswith("weight_"))
            if matrix and parameter.ndim == 2:
                names.add(f"{prefix}.{name}" if prefix else name)
    return names


def _optimizer(model: SequenceModel, settings: TrainSettings) -> torch.optim.Optimizer:
    decayed = decayed_parameter_names(model)
    named = list(model.named_parameters())
    groups = [
        {"params": [p for name, p in named if name in decayed], "weight_decay": settings.weight_decay},
        {"params": [p for name, p in named if name not in decayed], "weight_decay": 0.0},
    ]
    optimizer_class = torch.optim.AdamW if settings.optimizer == "adamw" else torch.optim.Adam
    return optimizer_class(groups, lr=settings.lr, betas=(0.9, settings.beta2))


def lr_factor(settings: TrainSettings, step: int) -> float:
    """The learning rate of optimizer step ``step`` (1-based) over the peak: linear warm-up over
    ``warmup_steps``, then constant, or a cosine from 1 down to ``min_lr_fraction`` at ``steps``."""
    if step <= settings.warmup_steps:
        return step / settings.warmup_steps
    if settings.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return settings.min_lr_fraction + (1.0 - settings.min_lr_fraction) * cosine


# ---------------------------------------------------------------- checkpoint and resume files


def _save_checkpoint(
    model: SequenceModel, best_state: dict[str, torch.Tensor] | None, objective: Objective,
    settings: TrainSettings, model_config: BaseModelConfig, out: Path, command: str, dist: Distributed,
    run: RunState,
) -> None:
    """The served checkpoint: the best weights when the objective keeps them, else the current ones."""
    metadata = _metadata(settings, objective, command, dist, run)
    config = objective.checkpoint_config(settings.architecture, model_config, metadata)
    if best_state is None:
        save_checkpoint(model, config, out)
    else:
        current = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        model.load_state_dict(best_state)
        save_checkpoint(model, config, out)
        model.load_state_dict(current)
    objective.write_files(out)


def _metadata(
    settings: TrainSettings, objective: Objective, command: str, dist: Distributed, run: RunState
) -> dict[str, Any]:
    """The checkpoint's provenance; ``stopped`` is None in the copies saved while training goes on."""
    return {
        "command": command,
        **_run_figures(run),
        "world_size": dist.world_size,
        "device": dist.device.type,
        "torch": torch.__version__,
        "settings": {**settings.to_dict(), **objective.settings()},
        **objective.metadata(run),
    }


def _run_figures(run: RunState) -> dict[str, Any]:
    """The checkpoint metadata's figures of where the run is."""
    return {"steps": run.step, "stopped": run.stopped, "wall_time_s": round(run.elapsed_s, 3), "tokens": run.tokens,
            "tokens_per_s": round(run.tokens / max(run.elapsed_s, 1e-9), 1)}


def _save_resume(
    out: Path, model: SequenceModel, optimizer: torch.optim.Optimizer, rng: np.random.Generator,
    objective: Objective, run: RunState, best_state: dict[str, torch.Tensor] | None, settings: TrainSettings,
    model_config: BaseModelConfig, command: str, log: TextIO | None, dist: Distributed,
    carried: InferenceCache | None = None,
) -> None:
    """Write ``resume.safetensors`` (rank 0; every process's random streams, data position, carried states and log
    figures since the last record gathered to it)."""
    own = {"window": run.window, "numpy": rng.bit_generator.state, "torch": torch.get_rng_state().tolist(),
           "cuda": [state.tolist() for state in torch.cuda.get_rng_state_all()] if dist.device.type == "cuda" else [],
           "data": objective.data_state(),
           "carried": carried_values(carried)}
    if objective.teacher is not None:
        own["teacher_carried"] = carried_values(objective.teacher.carried)
    processes = [json.loads(text) for text in dist.gather(json.dumps(own))]
    if not dist.is_main:
        return
    if log is not None:
        log.flush()
        run.log_bytes = log.tell()
    tensors = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    if best_state is not None:
        tensors.update({f"best.{name}": tensor for name, tensor in best_state.items()})
    optimizer_state = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in optimizer_state["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{name}"] = value
            else:
                scalars.setdefault(str(index), {})[name] = value
    state = {
        "format": RESUME_FORMAT,
        "command": command,
        "run": dataclasses.asdict(run),
        "settings": settings.to_dict(),
        "objective": {"name": objective.name, **objective.settings()},
        "architecture": settings.architecture,
        "model": dataclasses.asdict(model_config),
        "world_size": dist.world_size,
        "optimizer": {"param_groups": optimizer_state["param_groups"], "scalars": scalars},
        "processes": processes,
    }
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    temporary = temporary_file(out / RESUME_FILE)
    save_file(tensors, str(temporary), metadata={"state": json.dumps(state)})
    temporary.chmod(FILE_MODE)
    os.replace(temporary, out / RESUME_FILE)


def temporary_file(path: Path) -> Path:
    """Where a save writes ``path`` before renaming it into place: ``.NAME.tmp`` beside it (model/checkpoint.py
    names its files so too)."""
    return path.with_name(f".{path.name}.tmp")


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Delete the temporary files that saves killed before their rename left in ``out``: exactly
    ``.resume.safetensors.tmp``, ``.model.safetensors.tmp`` and ``.config.json.tmp`` (the names this module's and
    ``save_checkpoint``'s saves write to), no other file. Returns the paths removed (none for a missing folder)."""
    removed = []
    for name in (RESUME_FILE, WEIGHTS_FILE, CONFIG_FILE):
        path = temporary_file(Path(out) / name)
        if path.is_file() or path.is_symlink():
            path.unlink()
            removed.append(path)
    return removed


def read_resume_state(out: Path, with_tensors: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The JSON state and the tensors (none unless ``with_tensors``) of ``out/resume.safetensors``; ResumeError when it
    is missing or unreadable."""
    path = Path(out) / RESUME_FILE
    if not path.is_file():
        raise ResumeError(f"{path}: missing; there is no run to resume in {out}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            state = json.loads((handle.metadata() or {})["state"])
            names = handle.keys() if with_tensors else []
            tensors = {name: handle.get_tensor(name) for name in names}
    except (SafetensorError, OSError, ValueError, RuntimeError, KeyError) as error:
        raise ResumeError(f"{path}: not a readable resume file (truncated or corrupted?): {error}") from None
    if state.get("format") != RESUME_FORMAT:
        raise ResumeError(f"{path}: resume format {state.get('format')!r}; this build reads {RESUME_FORMAT}")
    return state, tensors


def export_weights(run: Path, out: Path, best: bool = False) -> dict[str, Any]:
    """Write the weights of the run in ``run`` as its last resume save holds them (the step's, or with ``best`` the
    best kept so far) as a checkpoint folder ``out``: the run's own checkpoint (written at its first evaluation, with
    the best or current weights of that time) with these weights, its metadata's steps, tokens and time those of the
    save (the objective's figures, e.g. the validation loss, stay the checkpoint's), and the tokenizer file its config
    names. So weights between two evaluations, or of a run killed since its last one, can be served and evaluated.
    Returns the metadata written; ResumeError, CheckpointError or TokenizerError says what is missing."""
    run, out = Path(run), Path(out)
    if out.resolve() == run.resolve():
        raise ResumeError(f"--out {out} is the run's own folder; export into another one")
    state, tensors = read_resume_state(run)
    if not (run / CONFIG_FILE).is_file():
        raise ResumeError(f"{run} has no {CONFIG_FILE} yet (a run writes it at its first evaluation): it says what the "
                          f"checkpoint serves (its tokenizer or task)")
    config = read_config(run)
    tokenizer = None
    if config.tokenizer is not None and config.tokenizer.startswith(FILE_PREFIX):
        tokenizer = ranks_file(config.tokenizer, run)  # checked before anything is written
    prefix = "best." if best else "model."
    weights = {name[len(prefix):]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
    if not weights:
        raise ResumeError(f"{run / RESUME_FILE} holds no best weights (the run keeps none, or has not evaluated)")
    model = build_model(state["architecture"], config.model)
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:  # a resume file of another run than the checkpoint's
        raise ResumeError(f"{run / RESUME_FILE}: its weights do not fit {run / CONFIG_FILE}: {error}") from None
    saved = RunState(**{**state["run"], "stopped": None})  # a copy saved while training goes on
    metadata = {**config.metadata, **_run_figures(saved), "exported": {"from": str(run), "best": best}}
    save_checkpoint(model, dataclasses.replace(config, metadata=metadata), out)
    if tokenizer is not None:
        copy = out / tokenizer.relative_to(run.resolve())
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer, copy)
    return metadata


def _load_resume(
    out: Path, model: SequenceModel, optimizer: torch.optim.Optimizer, rng: np.random.Generator,
    objective: Objective, dist: Distributed, carried: InferenceCache | None = None,
) -> tuple[RunState, dict[str, torch.Tensor] | None]:
    """Restore the run in ``out`` into the model, optimizer, random stream, objective and ``carried`` (in place)."""
    state, tensors = read_resume_state(out)
    if state["world_size"] != dist.world_size:
        raise ResumeError(f"{out} was trained by {state['world_size']} process(es); resume it with as many "
                          f"(each one's data stream is its own), not {dist.world_size}")
    device = dist.device
    model.load_state_dict({name[len("model."):]: tensor for name, tensor in tensors.items()
                           if name.startswith("model.")})
    best = {name[len("best."):]: tensor.to(device) for name, tensor in tensors.items() if name.startswith("best.")}
    optimizer_state: dict[str, Any] = {"state": {}, "param_groups": state["optimizer"]["param_groups"]}
    for name, tensor in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            optimizer_state["state"].setdefault(int(index), {})[key] = tensor.to(device)
    for index, values in state["optimizer"]["scalars"].items():
        optimizer_state["state"].setdefault(int(index), {}).update(values)
    optimizer.load_state_dict(optimizer_state)
    own = state["processes"][dist.rank]
    rng.bit_generator.state = own["numpy"]
    torch.set_rng_state(torch.tensor(own["torch"], dtype=torch.uint8))
    if own["cuda"]:
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in own["cuda"]])
    objective.load_data_state(own["data"])
    restore_carried(carried, own["carried"])
    if objective.teacher is not None:
        restore_carried(objective.teacher.carried, own.get("teacher_carried"))
    return RunState(**{**state["run"], "window": own["window"]}), best or None


@contextlib.contextmanager
def _stop_signals() -> Iterator[Callable[[], bool]]:
    """SIGTERM and SIGINT set a flag (read through the yielded callable) instead of killing the run; the
    previous handlers come back afterwards. Outside the main thread signals cannot be caught: never set."""
    received: list[int] = []
    previous = {}
    with contextlib.suppress(ValueError):  # not the main thread
        for number in (signal.SIGTERM, signal.SIGINT):
            previous[number] = signal.signal(number, lambda signum, frame: received.append(signum))
    try:
        yield lambda: bool(received)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


# ---------------------------------------------------------------- log and digests


def weights_digest(model: SequenceModel) -> str:
    """SHA-256 over every parameter and buffer (names and raw bytes, sorted by name): equal iff the weights are."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _open_log(out: Path, dist: Distributed, keep_bytes: int | None) -> TextIO | None:
    """Rank 0's log: a new one, or (``keep_bytes``) the old one cut back to the records of the saved state."""
    if not dist.is_main:
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOG_FILE
    if keep_bytes is None:
        return path.open("w")
    log = path.open("r+" if path.exists() else "w")
    log.truncate(keep_bytes)
    log.seek(keep_bytes)
    return log


def _write(log: TextIO | None, **record: Any) -> None:
    if log is not None:
        log.write(json.dumps(record) + "\n")
        log.flush()
