"""The training loop of ``python -m training train``: a transducer on a task of SPEC section 1.

Per-position cross-entropy on right-padded batches (padding masked), lengths from a :class:`LengthCurriculum`,
Adam or AdamW with gradient clipping, bfloat16 autocast when asked. Every ``eval_every`` steps (and at the
last) the final-label accuracy on a fixed set of longer inputs (the extrapolation set) is measured; the best
model by that accuracy is the checkpoint, and training stops early after ``patience`` evaluations without
improvement or once ``target_accuracy`` is reached. Under torchrun each process draws its own batches (its
random stream is keyed by its rank), evaluates its share of the extrapolation set, and every figure that
decides anything is summed over the processes, so all of them stop at the same step; rank 0 alone writes.

The output folder holds the checkpoint (``config.json``, ``model.safetensors``; loading reads nothing else)
and the log ``train.jsonl``: one JSON object per line, each with an ``event``:

- ``"start"``: ``command``, ``task``, ``architecture``, ``model`` (hyper-parameters), ``parameters`` (count),
  ``world_size``, ``device``, ``dtype``;
- ``"train"``, every ``log_every`` steps and at the last: ``step``, ``loss`` and ``accuracy`` (mean
  per-position cross-entropy and accuracy over the real positions of the steps since the previous record,
  all processes), ``max_length`` (the curriculum's longest length at this step), ``lr``, ``grad_norm``
  (before clipping, last step), ``elapsed_s``;
- ``"eval"``: ``step``, ``accuracy``, ``lengths`` ([shortest, longest]), ``samples``, ``best_accuracy``,
  ``best_step``;
- ``"end"``: ``step`` (steps run), ``stopped`` ("steps", "patience" or "target"), ``best_accuracy`` and
  ``best_step`` (null without evaluation), ``wall_time_s``, ``param_sha256`` (a digest of the trained
  weights from each process, in rank order: all equal when the processes agree).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from model.base import SequenceModel
from model.checkpoint import save_checkpoint
from model.config import BaseModelConfig, CheckpointConfig
from model.device import resolve_dtype
from model.registry import build_model
from training.data import IGNORE_INDEX, Batch, Curriculum, FinalLabelSet, LengthCurriculum, TrainingData
from training.data import count_correct_final
from training.distributed import Distributed
from training.tasks import Task, get_task

LOG_FILE = "train.jsonl"
TRAIN_STREAM, EVAL_STREAM = 0, 1  # keys of the random streams derived from the seed


@dataclass(frozen=True)
class TrainSettings:
    """Everything ``train`` needs besides the model's hyper-parameters. Lengths are inclusive ranges."""

    task: str
    architecture: str
    steps: int
    out: Path
    train_lengths: tuple[int, int]
    eval_lengths: tuple[int, int]
    batch_size: int = 128
    lr: float = 3e-4
    optimizer: Literal["adam", "adamw"] = "adam"
    weight_decay: float = 0.0
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    grad_clip: float = 1.0
    seed: int = 0
    curriculum: Curriculum = "uniform"
    curriculum_start: int = 10
    curriculum_fraction: float = 0.5
    p_one: float | tuple[float, float] | None = None  # one P(second symbol), or a per-string range
    balanced: bool = False
    eval_every: int = 500
    eval_samples: int = 200
    eval_batch_size: int = 64
    patience: int | None = None
    target_accuracy: float | None = None
    log_every: int = 10
    dtype: str = "float32"
    progress: bool = True


@dataclass
class BestModel:
    """The best extrapolation accuracy so far, its step and a copy of its weights (on every process)."""

    accuracy: float | None = None
    step: int | None = None
    state: dict[str, torch.Tensor] | None = None
    evaluations_since: int = 0


@dataclass
class Window:
    """Per-position loss and accuracy sums over the steps since the last log record (this process)."""

    loss_sum: float = 0.0
    correct: float = 0.0
    positions: float = 0.0

    def add(self, loss: torch.Tensor, correct: int, positions: int) -> None:
        self.loss_sum += float(loss.detach()) * positions
        self.correct += correct
        self.positions += positions

    def reduce(self, dist: Distributed) -> tuple[float, float]:
        """Mean loss and accuracy over every process's window; empties the window."""
        loss_sum, correct, positions = dist.sum([self.loss_sum, self.correct, self.positions])
        self.loss_sum = self.correct = self.positions = 0.0
        return loss_sum / positions, correct / positions


def train(settings: TrainSettings, model_config: BaseModelConfig, command: str, dist: Distributed) -> dict[str, Any]:
    """Train, write the checkpoint folder and log (rank 0), and return the checkpoint's metadata."""
    started = time.perf_counter()
    task = get_task(settings.task)
    torch.manual_seed(settings.seed)  # the same initial weights on every process
    model = build_model(settings.architecture, model_config).to(dist.device).train()
    trained = dist.wrap(model)
    optimizer = _optimizer(model, settings)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(settings))
    data = _training_data(settings, task)
    rng = np.random.default_rng([settings.seed, TRAIN_STREAM, dist.rank])
    eval_set = FinalLabelSet.draw(
        task, np.random.default_rng([settings.seed, EVAL_STREAM]), settings.eval_samples, settings.eval_lengths
    ).shard(dist.rank, dist.world_size)

    out = Path(settings.out)
    log = _open_log(out, dist)
    _write(log, event="start", command=command, task=task.name, architecture=settings.architecture,
           model=dataclasses.asdict(model_config), parameters=sum(p.numel() for p in model.parameters()),
           world_size=dist.world_size, device=str(dist.device), dtype=settings.dtype)
    best, window = BestModel(), Window()
    stopped, step = "steps", 0
    bar = tqdm(total=settings.steps, desc=f"{task.name} {settings.architecture}", dynamic_ncols=True,
               disable=not (dist.is_main and settings.progress))
    for step in range(1, settings.steps + 1):
        batch = data.batch(rng, step).to(dist.device)
        grad_norm = _train_step(trained, optimizer, batch, settings, window)
        scheduler.step()
        bar.update(1)
        if step % settings.log_every == 0 or step == settings.steps:
            loss, accuracy = window.reduce(dist)
            _write(log, event="train", step=step, loss=loss, accuracy=accuracy,
                   max_length=data.curriculum.length_range(step)[1], lr=scheduler.get_last_lr()[0],
                   grad_norm=grad_norm, elapsed_s=time.perf_counter() - started)
            bar.set_postfix(loss=f"{loss:.4f}", acc=f"{accuracy:.3f}",
                            best_eval="-" if best.accuracy is None else f"{best.accuracy:.3f}")
        if settings.eval_every and (step % settings.eval_every == 0 or step == settings.steps):
            stopped = _evaluate(model, eval_set, task.alphabet, settings, dist, step, best, log)
            if best.step == step and dist.is_main:  # kept on disk as it comes, in case the run is cut short
                metadata = _metadata(settings, command, dist, step, None, best, time.perf_counter() - started)
                save_checkpoint(model, _checkpoint_config(settings, model_config, task, metadata), out)
            if stopped != "steps":
                break
    bar.close()

    if best.state is not None:
        model.load_state_dict(best.state)
    wall_time = time.perf_counter() - started
    metadata = _metadata(settings, command, dist, step, stopped, best, wall_time)
    digests = dist.gather(weights_digest(model))
    if dist.is_main:
        save_checkpoint(model, _checkpoint_config(settings, model_config, task, metadata), out)
        _write(log, event="end", step=step, stopped=stopped, best_accuracy=best.accuracy, best_step=best.step,
               wall_time_s=wall_time, param_sha256=digests)
        log.close()
    return metadata


def _training_data(settings: TrainSettings, task: Task) -> TrainingData:
    ramp_steps = max(1, round(settings.curriculum_fraction * settings.steps))
    curriculum = LengthCurriculum(*settings.train_lengths, kind=settings.curriculum, start=settings.curriculum_start,
                                  ramp_steps=ramp_steps)
    return TrainingData(task, settings.batch_size, curriculum, settings.p_one, settings.balanced)


def _train_step(
    trained: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, settings: TrainSettings, window: Window
) -> float:
    """One optimizer step on ``batch`` (its figures go into ``window``); returns the gradient norm before clipping."""
    use_bfloat16 = resolve_dtype(settings.dtype) == torch.bfloat16
    with torch.autocast(batch.tokens.device.type, dtype=torch.bfloat16, enabled=use_bfloat16):
        logits = trained(batch.tokens)  # (B, T, num_labels)
    loss, correct, positions = _masked_loss(logits.float(), batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(trained.parameters(), settings.grad_clip or math.inf)
    optimizer.step()
    window.add(loss, correct, positions)
    return float(grad_norm)


def _masked_loss(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, int, int]:
    """logits: (B, T, V) -> mean cross-entropy over the real positions, correct argmaxes, real positions."""
    targets = batch.targets  # (B, T)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)
    real = targets != IGNORE_INDEX  # (B, T)
    correct = int(((logits.argmax(dim=-1) == targets) & real).sum())
    return loss, correct, int(real.sum())


def _evaluate(
    model: SequenceModel,
    eval_set: FinalLabelSet,
    alphabet: str,
    settings: TrainSettings,
    dist: Distributed,
    step: int,
    best: BestModel,
    log: TextIO | None,
) -> str:
    """Measure the extrapolation accuracy, update ``best``; returns why to stop ("steps" = go on)."""
    model.eval()
    correct = count_correct_final(model, eval_set, alphabet, settings.eval_batch_size)
    model.train()
    correct_sum, total = dist.sum([float(correct), float(len(eval_set))])
    accuracy = correct_sum / total
    # A tie keeps the later weights (trained longer, so usually a sharper solution of the same accuracy) but, not
    # being an improvement, still counts towards the patience.
    improved = best.accuracy is None or accuracy > best.accuracy
    if improved or accuracy == best.accuracy:
        best.accuracy, best.step = accuracy, step
        best.state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    best.evaluations_since = 0 if improved else best.evaluations_since + 1
    _write(log, event="eval", step=step, accuracy=accuracy, lengths=list(settings.eval_lengths),
           samples=settings.eval_samples, best_accuracy=best.accuracy, best_step=best.step)
    if settings.target_accuracy is not None and best.accuracy >= settings.target_accuracy:
        return "target"
    if settings.patience is not None and best.evaluations_since >= settings.patience:
        return "patience"
    return "steps"


def _optimizer(model: SequenceModel, settings: TrainSettings) -> torch.optim.Optimizer:
    optimizer_class = torch.optim.AdamW if settings.optimizer == "adamw" else torch.optim.Adam
    return optimizer_class(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)


def _lr_factor(settings: TrainSettings):
    """Multiplier of the learning rate after ``step`` optimizer steps: linear warm-up, then constant or cosine."""

    def factor(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        if settings.schedule == "constant":
            return 1.0
        progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _checkpoint_config(
    settings: TrainSettings, model_config: BaseModelConfig, task: Task, metadata: dict[str, Any]
) -> CheckpointConfig:
    return CheckpointConfig(architecture=settings.architecture, model=model_config, kind="transduce",
                            task=task.name, alphabet=task.alphabet, labels=task.labels, metadata=metadata)


def _metadata(
    settings: TrainSettings, command: str, dist: Distributed, steps: int, stopped: str | None, best: BestModel,
    wall: float,
) -> dict[str, Any]:
    """The checkpoint's provenance; ``stopped`` is None in the copies saved while training goes on."""
    best_eval = None
    if best.accuracy is not None:
        best_eval = {"step": best.step, "accuracy": best.accuracy, "lengths": list(settings.eval_lengths),
                     "samples": settings.eval_samples}
    return {
        "command": command,
        "steps": steps,
        "stopped": stopped,
        "wall_time_s": round(wall, 3),
        "best_eval": best_eval,
        "world_size": dist.world_size,
        "device": dist.device.type,
        "torch": torch.__version__,
        "settings": {key: list(value) if isinstance(value, tuple) else value
                     for key, value in dataclasses.asdict(settings).items() if key != "out"},
    }


def weights_digest(model: SequenceModel) -> str:
    """SHA-256 over every parameter and buffer (names and raw bytes, sorted by name): equal iff the weights are."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _open_log(out: Path, dist: Distributed) -> TextIO | None:
    if not dist.is_main:
        return None
    out.mkdir(parents=True, exist_ok=True)
    return (out / LOG_FILE).open("w")


def _write(log: TextIO | None, **record: Any) -> None:
    if log is not None:
        log.write(json.dumps(record) + "\n")
        log.flush()
