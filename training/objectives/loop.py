"""The one training loop of ``python -m training train`` (transducers) and ``text-train`` (language models); what
differs between them is an :class:`Objective` (transduction.py, language_model.py).

A resumed run ends bitwise-equal to one never stopped (same device and threads); SIGTERM or SIGINT finishes the
step, saves and returns. The output folder and ``train.jsonl``: docs/training.md, "Run folder".
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO, cast

import numpy as np
import torch
from tqdm import tqdm

from model.base import SequenceModel
from model.cache import InferenceCache
from model.config import BaseModelConfig
from model.registry import build_model
from training.data.batches import IGNORE_INDEX, Batch
from training.objectives.carried import new_carried_state, reset_rows
from training.objectives.checkpointing import (
    load_resume,
    open_log,
    remove_stale_temporaries,
    run_metadata,
    save_resume,
    save_run_checkpoint,
    weights_digest,
    write_record,
)
from training.objectives.distributed import Distributed
from training.objectives.losses import (
    determinism_weight,
    impurity,
    masked_loss,
    set_softness,
    softness,
    target_loss,
    track_writes,
    writes,
)
from training.objectives.optim import build_optimizer, extra_levels, lr_factor
from training.objectives.run import Objective, RunState, TrainSettings

if TYPE_CHECKING:
    from training.objectives.distill import Teacher

TRAIN_STREAM = 0  # key of the training data's random stream (with the seed and the rank)


@dataclass(frozen=True)
class RunOptions:
    """What may differ between the parts of a resumed run without changing its result."""

    time_budget_s: float | None = None  # of this invocation: then save and stop
    progress: bool = True
    threads: int | None = None  # recorded in the log only


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
    """Run training, or continue the run in ``out`` (``resume``: the continuing command line); rank 0 writes the
    folder. Returns the checkpoint's metadata. ``stop_requested`` is polled after every step."""
    started = time.perf_counter()
    torch.manual_seed(settings.seed)  # the same initial weights on every process
    model = build_model(settings.architecture, model_config).to(dist.device).train()
    if initial is not None and resume is None:
        model.load_state_dict(initial)
    if settings.freeze_embedding:
        model.get_parameter("embedding.embed.weight").requires_grad_(False)
    if settings.write_weight:
        track_writes(model, settings.write_layers)
    optimizer = build_optimizer(model, settings)
    rng = np.random.default_rng([settings.seed, TRAIN_STREAM, dist.rank])
    run, best_state = RunState(), None
    carried = new_carried_state(model, settings.batch_size) if objective.carries_state else None
    out = Path(out)
    if resume is not None:
        run, best_state = load_resume(out, model, optimizer, rng, objective, dist, carried)
        run.stopped = None
    if dist.is_main and (removed := remove_stale_temporaries(out)):
        print(
            f"removed {len(removed)} temporary file(s) of saves killed before their rename from {out}: "
            f"{', '.join(path.name for path in removed)}",
            file=sys.stderr,
        )
    # dynamic: lengths vary; torch.compile returns a module (OptimizedModule) for one, typed a plain callable
    trained = dist.wrap(cast(torch.nn.Module, torch.compile(model, dynamic=True)) if settings.compile else model)
    use_bfloat16 = settings.dtype == "bfloat16" or (settings.dtype == "auto" and dist.device.type == "cuda")

    log = open_log(out, dist, run.log_bytes if resume is not None else None)
    if dist.is_main and resume is None:  # what a resume reads besides resume.safetensors, before a run can be killed
        objective.write_files(out)
    if resume is not None:
        write_record(log, event="resume", command=resume, step=run.step, threads=options.threads)
    else:
        write_record(
            log,
            event="start",
            command=command,
            architecture=settings.architecture,
            model=dataclasses.asdict(model_config),
            parameters=sum(p.numel() for p in model.parameters()),
            world_size=dist.world_size,
            device=str(dist.device),
            dtype="bfloat16" if use_bfloat16 else "float32",
            threads=options.threads,
            **objective.start_figures(),
        )

    def save_point() -> None:
        """The resumable state as it is now (``best_state`` and ``carried`` as last bound)."""
        save_resume(
            out, model, optimizer, rng, objective, run, best_state, settings, model_config, command, log, dist, carried
        )

    elapsed_before = run.elapsed_s
    window_started, window_tokens = time.perf_counter(), 0
    bar = tqdm(
        total=settings.steps if options.time_budget_s is None else None,  # under a budget: after a step
        initial=run.step,
        desc=f"{objective.name} {settings.architecture}",
        unit="step",
        dynamic_ncols=True,
        disable=not (dist.is_main and options.progress),
    )
    first_step, loop_started = run.step, time.perf_counter()
    with _stop_signals() as signalled:
        while (run.step < settings.steps or run.evaluation_pending) and run.stopped is None:
            cut = out_of_time = False
            if not run.evaluation_pending:  # else resumed from the save before this step's evaluation
                run.step += 1
                for group in optimizer.param_groups:
                    group["lr"] = settings.lr * lr_factor(settings, run.step)
                if settings.soft_transition_steps or settings.harden_steps:
                    set_softness(
                        model,
                        softness(settings, run.step),
                        track_impurity=determinism_weight(settings, run.step) > 0,
                    )
                if settings.extra_levels:
                    setattr(model, "extra_levels", extra_levels(settings, run.step))  # RegularGPT's own attribute
                batch = objective.batch(rng, run.step)
                grad_norm, step_tokens, carried = _train_step(
                    trained, optimizer, batch, settings, run, dist, use_bfloat16, carried, objective.teacher
                )
                window_tokens += step_tokens
                if options.time_budget_s is not None:
                    now = time.perf_counter()
                    bar.total = progress_total(
                        settings.steps,
                        run.step,
                        (now - loop_started) / (run.step - first_step),
                        options.time_budget_s - (now - started),
                    )
                bar.update(1)
                run.elapsed_s = elapsed_before + time.perf_counter() - started
                out_of_time = (
                    options.time_budget_s is not None and time.perf_counter() - started >= options.time_budget_s
                )
                cut = signalled() or bool(stop_requested and stop_requested())
                # every process stops at the same step; a cut run logs and evaluates as if it went on (bitwise resume)
                cut, out_of_time = (value > 0 for value in dist.sum([float(cut), float(out_of_time)]))
                if run.step % settings.log_every == 0 or run.step == settings.steps:
                    loss_sum, correct, positions = dist.sum(run.window)
                    run.window = [0.0, 0.0, 0.0]
                    now = time.perf_counter()
                    speed = dist.sum([float(window_tokens)])[0] / max(now - window_started, 1e-9)
                    write_record(
                        log,
                        event="train",
                        step=run.step,
                        loss=loss_sum / positions,
                        accuracy=correct / positions,
                        tokens=run.tokens,
                        tokens_per_s=speed,
                        lr=optimizer.param_groups[0]["lr"],
                        grad_norm=grad_norm,
                        elapsed_s=run.elapsed_s,
                        **objective.train_figures(run.step),
                    )
                    bar.set_postfix(
                        {
                            "loss": f"{loss_sum / positions:.4f}",
                            "acc": f"{correct / positions:.3f}",
                            "tokens/s": f"{speed:,.0f}",
                        }
                    )
                    window_started, window_tokens = now, 0
                if settings.eval_every and (run.step % settings.eval_every == 0 or run.step == settings.steps):
                    # saved first, so that an evaluation that dies (out of memory) loses none of the steps
                    run.evaluation_pending = True
                    save_point()
            last, evaluated = run.step == settings.steps, run.evaluation_pending
            if evaluated:
                best_state = _evaluate(model, objective, settings, run, dist, log, best_state)
                run.evaluation_pending = False
                if dist.is_main:  # kept on disk as it goes, so a cut run leaves a loadable model
                    save_run_checkpoint(model, best_state, objective, settings, model_config, out, command, dist, run)
            if run.stopped is None:
                run.stopped = "steps" if last else "signal" if cut else "time" if out_of_time else None
            # a step that evaluated was saved just before (a resume repeats the evaluation): not a second time
            if run.stopped is not None or (run.step % settings.save_every == 0 and not evaluated):
                save_point()
    bar.close()

    metadata = run_metadata(settings, objective, command, dist, run)
    digests = dist.gather(weights_digest(model))
    if dist.is_main:
        save_run_checkpoint(model, best_state, objective, settings, model_config, out, command, dist, run)
        write_record(
            log,
            event="end",
            step=run.step,
            stopped=run.stopped,
            best_score=run.best_score,
            best_step=run.best_step,
            wall_time_s=run.elapsed_s,
            tokens=run.tokens,
            param_sha256=digests,
        )
        assert log is not None  # open_log opens it on rank 0
        log.close()
    return metadata


def progress_total(steps: int, step: int, seconds_per_step: float, seconds_left: float) -> int:
    """The step the progress bar counts to, after ``step``: ``steps``, or the step at which the time left ends at
    the pace so far if that comes first."""
    return min(steps, step + max(0, math.ceil(seconds_left / max(seconds_per_step, 1e-9))))


def _train_step(
    trained: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Batch,
    settings: TrainSettings,
    run: RunState,
    dist: Distributed,
    use_bfloat16: bool,
    carried: InferenceCache | None = None,
    teacher: Teacher | None = None,
) -> tuple[float, int, InferenceCache | None]:
    """One optimizer step over ``batch`` in ``grad_accumulation`` micro-batches (the loss the mean over all real
    positions), rows starting from ``carried``. Returns the gradient norm before clipping, this process's real
    positions and the states carried on, detached."""
    positions = int((batch.targets != IGNORE_INDEX).sum())
    selects_positions = _unwrapped(trained).selects_positions  # under DDP: the model's
    weight = determinism_weight(settings, run.step)
    optimizer.zero_grad(set_to_none=True)
    parts = batch.split(settings.grad_accumulation)
    row_groups = torch.arange(len(batch.lengths)).tensor_split(settings.grad_accumulation)
    if carried is not None and batch.fresh is not None and bool(batch.fresh.any()):
        carried = reset_rows(_unwrapped(trained), carried, batch.fresh)
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
        scale = None
        if batch.weights is not None:
            scale = batch.weights[rows].to(dist.device, torch.float32)[:, None].expand_as(targets)  # (b, T)
        with torch.autocast(dist.device.type, dtype=torch.bfloat16, enabled=use_bfloat16):
            if selects_positions and not bool(scored.all()):  # the head on the scored positions only
                logits, targets = trained(part.tokens, cache, positions=scored), part.targets[scored]  # (N, V), (N,)
                if soft is not None:
                    assert soft_weights is not None  # set with soft
                    soft, soft_weights = soft[scored], soft_weights[scored]  # (N, V), (N,)
                if scale is not None:
                    scale = scale[scored]  # (N,)
            else:
                logits = trained(part.tokens, cache)  # (b, T, V)
        if cache is not None:
            ended.append(cache)
        loss_sum, correct = masked_loss(logits.float(), targets, soft, soft_weights, scale)
        del soft
        penalised = loss_sum
        counted = int((part.targets != IGNORE_INDEX).sum())  # penalties count once per real position, as the loss
        if weight:
            penalised = penalised + weight * counted * impurity(trained)
        if settings.write_weight:
            penalised = penalised + settings.write_weight * counted * writes(trained)
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


def _unwrapped(trained: torch.nn.Module) -> SequenceModel:
    """The model ``trained`` runs: DDP's ``module``, else ``trained`` itself (the model, or torch.compile's wrapper,
    which forwards the model's attributes)."""
    return cast(SequenceModel, getattr(trained, "module", trained))


def _evaluate(
    model: SequenceModel,
    objective: Objective,
    settings: TrainSettings,
    run: RunState,
    dist: Distributed,
    log: TextIO | None,
    best_state: dict[str, torch.Tensor] | None,
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
    write_record(
        log, event="eval", step=run.step, **evaluation.figures, best_score=run.best_score, best_step=run.best_step
    )
    assert run.best_score is not None  # set above at the first evaluation
    if settings.target is not None and run.best_score >= settings.target:
        run.stopped = "target"
    elif settings.patience is not None and run.evaluations_since_best >= settings.patience:
        run.stopped = "patience"
    return best_state


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
