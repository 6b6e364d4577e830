"""The optimizer of a run (Adam or AdamW, weight decay on the matrices of linear maps only) and what follows the
step alone: the learning rate's schedule and RegularGPT's extra levels.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from model.base import SequenceModel

if TYPE_CHECKING:
    from training.objectives.run import TrainSettings

EXTRA_LEVELS_STREAM = 1  # key of the per-step draw of extra_levels (with the seed and the step)


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


def build_optimizer(model: SequenceModel, settings: TrainSettings) -> torch.optim.Optimizer:
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


def extra_levels(settings: TrainSettings, step: int) -> int:
    """The thick layers RegularGPT adds above each position's depth at ``step``: uniform in 0..extra_levels, a
    function of the seed and the step alone (the same in every process and after a resume)."""
    return int(np.random.default_rng([settings.seed, step, EXTRA_LEVELS_STREAM]).integers(settings.extra_levels + 1))
