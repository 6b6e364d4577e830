"""What every part of the trainer shares about a run: its settings (:class:`TrainSettings`), what it trains on
(the :class:`Objective` interface, its :class:`Evaluation`) and where it is (:class:`RunState`).
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from model.base import SequenceModel
from model.config import BaseModelConfig, CheckpointConfig
from training.data.batches import Batch
from training.objectives.distributed import Distributed

if TYPE_CHECKING:
    from training.objectives.distill import Teacher


@dataclass(frozen=True)
class TrainSettings:
    """Everything that decides a run's result besides the model's hyper-parameters and the objective's data.
    ``batch_size`` is per optimizer step and process; ``lr`` the peak rate (:func:`optim.lr_factor`);
    ``patience`` counts evaluations without a better score; ``soft_transition_steps``: a stochastic LRNN's first
    steps with softmax columns (a delta-rule LRNN's: with sigmoid write gates), ``harden_steps`` the steps after them
    that blend them into the sparsemax (the hard gates); ``write_weight``: a delta-rule LRNN's penalty per scored
    position on its layers' mean write gate, ``write_layers`` the layers it counts (0-based; None: all);
    ``freeze_embedding``: the token embedding (a language model's output head too, tied to it) keeps its initial
    values."""

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
    harden_steps: int = 0
    determinism_weight: float = 0.0
    write_weight: float = 0.0
    write_layers: tuple[int, ...] | None = None
    extra_levels: int = 0
    freeze_embedding: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    def checkpoint_config(
        self, architecture: str, model_config: BaseModelConfig, metadata: dict[str, Any]
    ) -> CheckpointConfig:
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
