"""The objective of ``python -m training train``: a transducer on a task (docs/api.md, Tasks), trained on its
strings labelled at every position (lengths from a :class:`LengthCurriculum`) and scored by final-label accuracy
on a fixed set of longer strings; the checkpoint holds the best-scoring weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model.base import SequenceModel
from model.config import BaseModelConfig, CheckpointConfig
from training.data.batches import Batch, Curriculum, FinalLabelSet, LengthCurriculum, TrainingData, count_correct_final
from training.data.tasks import get_task
from training.objectives.distributed import Distributed
from training.objectives.run import Evaluation, Objective, RunState

EVAL_STREAM = 1  # key of the extrapolation set's random stream (with the seed)


@dataclass(frozen=True)
class TaskData:
    """What a transducer trains and is evaluated on. Lengths are inclusive ranges."""

    task: str
    train_lengths: tuple[int, int]
    eval_lengths: tuple[int, int]
    curriculum: Curriculum = "uniform"
    curriculum_start: int = 10
    curriculum_fraction: float = 0.5
    p_one: float | tuple[float, float] | None = None  # one P(second symbol), or a per-string range
    balanced: bool = False
    power_offset_fraction: float = (
        0.0  # training strings drawn by the task's draw_power_offset (training/data/tasks.py)
    )
    final_only: bool = False  # the loss on each training string's last position only (the authors' code's)
    p_times: float | tuple[float, float] | None = None  # modular_arithmetic: P("*" among operators), or a range
    eval_samples: int = 200
    eval_batch_size: int = 64


class TransductionObjective(Objective):
    name = "transduction"
    keep_best = True

    def __init__(self, data: TaskData, steps: int, batch_size: int, seed: int, dist: Distributed) -> None:
        self.data = data
        self.task = get_task(data.task)
        ramp_steps = max(1, round(data.curriculum_fraction * steps))
        curriculum = LengthCurriculum(
            *data.train_lengths, kind=data.curriculum, start=data.curriculum_start, ramp_steps=ramp_steps
        )
        self.training = TrainingData(
            self.task,
            batch_size,
            curriculum,
            data.p_one,
            data.balanced,
            data.power_offset_fraction,
            data.final_only,
            data.p_times,
        )
        eval_rng = np.random.default_rng([seed, EVAL_STREAM])
        self.eval_set = FinalLabelSet.draw(self.task, eval_rng, data.eval_samples, data.eval_lengths).shard(
            dist.rank, dist.world_size
        )

    def batch(self, rng: np.random.Generator, step: int) -> Batch:
        return self.training.batch(rng, step)

    def evaluate(self, model: SequenceModel, dist: Distributed) -> Evaluation:
        correct = count_correct_final(model, self.eval_set, self.task.alphabet, self.data.eval_batch_size)
        correct_sum, total = dist.sum([float(correct), float(len(self.eval_set))])
        accuracy = correct_sum / total
        figures = {"accuracy": accuracy, "lengths": list(self.data.eval_lengths), "samples": self.data.eval_samples}
        return Evaluation(figures, score=accuracy)

    def checkpoint_config(
        self, architecture: str, model_config: BaseModelConfig, metadata: dict[str, Any]
    ) -> CheckpointConfig:
        return CheckpointConfig(
            architecture=architecture,
            model=model_config,
            kind="transduce",
            task=self.task.name,
            alphabet=self.task.alphabet,
            labels=self.task.labels,
            metadata=metadata,
        )

    def start_figures(self) -> dict[str, Any]:
        return {"task": self.task.name}

    def train_figures(self, step: int) -> dict[str, Any]:
        return {"max_length": self.training.curriculum.length_range(step)[1]}

    def metadata(self, run: RunState) -> dict[str, Any]:
        best_eval = None
        if run.best_score is not None:
            best_eval = {
                "step": run.best_step,
                "accuracy": run.best_score,
                "lengths": list(self.data.eval_lengths),
                "samples": self.data.eval_samples,
            }
        return {"best_eval": best_eval}

    def settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self.data)

    def write_files(self, out: Path) -> None:
        """Nothing besides the checkpoint."""
