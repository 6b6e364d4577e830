"""The loss of a training step: cross-entropy summed over a batch's real positions (:func:`masked_loss`, with a
teacher's distributions too), and the stochastic LRNN's soft phase with its impurity term.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from training.data.batches import IGNORE_INDEX

if TYPE_CHECKING:
    from training.objectives.run import TrainSettings


def masked_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    soft: torch.Tensor | None = None,
    soft_weights: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int]:
    """logits (B, T, V), targets (B, T) (or (N, V), (N,)) -> summed cross-entropy over the real positions, correct
    argmaxes. With a gradient to take, ``soft`` and ``soft_weights`` w make each position's loss (1 - w) times its
    target's cross-entropy plus w times the teacher's, and ``scale`` (shaped as targets) multiplies each position's
    loss; :func:`target_loss` stays the targets' plain sum."""
    flat_logits, flat_targets = logits.flatten(0, -2), targets.flatten()
    if torch.is_grad_enabled() and logits.requires_grad:
        flat_soft = None if soft is None else soft.flatten(0, -2)
        flat_weights = None if soft_weights is None else soft_weights.flatten()
        flat_scale = None if scale is None else scale.flatten()
        # torch's Function.apply is unannotated upstream
        loss_sum: torch.Tensor = SummedCrossEntropy.apply(  # type: ignore[no-untyped-call]
            flat_logits, flat_targets, flat_soft, flat_weights, flat_scale
        )
    else:
        loss_sum = F.cross_entropy(flat_logits, flat_targets, ignore_index=IGNORE_INDEX, reduction="sum")
    correct = int(((logits.argmax(dim=-1) == targets) & (targets != IGNORE_INDEX)).sum())
    return loss_sum, correct


def target_loss(loss_sum: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of the targets alone, detached, from :func:`masked_loss`'s loss."""
    return getattr(loss_sum, "target_loss", loss_sum).detach()


class SummedCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")``, its gradient made in the
    forward pass in one (N, V) buffer. With ``soft`` (N, V) and ``weights`` (N,): the teacher mixture of
    :func:`masked_loss`; with ``scale`` (N,): each position's loss times it; either way the targets' own sum is kept
    as ``target_loss``. logits (N, V), targets (N,) -> () sum."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        soft: torch.Tensor | None = None,
        weights: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
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
        if scale is not None:
            gradient.mul_(scale.unsqueeze(1))
            losses = losses * scale
        gradient[~real] = 0.0
        ctx.save_for_backward(gradient)
        total = losses.masked_fill(~real, 0.0).sum()
        if soft is not None or scale is not None:
            setattr(total, "target_loss", target_sum)  # read by target_loss(): a tensor has no such attribute
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        (gradient,) = ctx.saved_tensors  # scaled in place, no second (N, V) buffer: a second
        return gradient.mul_(grad_output), None, None, None, None  # backward through the graph meets autograd's check


def set_softness(model: torch.nn.Module, softness: float, track_impurity: bool = False) -> None:
    """Set the softmax's share of the columns in every layer that has one (``softness``: the stochastic LRNN's
    recurrences; the delta rule's, the sigmoid's share of its write gates), and whether they keep their columns'
    impurity for :func:`impurity`."""
    for module in model.modules():
        if hasattr(module, "softness"):  # a stochastic LRNN's recurrence: attributes of its own
            setattr(module, "softness", softness)
            setattr(module, "track_impurity", bool(softness) and track_impurity)


def softness(settings: TrainSettings, step: int) -> float:
    """The softmax's share of a stochastic LRNN's columns at ``step``: 1 over the first ``soft_transition_steps``,
    then falling linearly to 0 over ``harden_steps`` (at once when 0), 0 after; the sparsemax is what is served."""
    past = step - settings.soft_transition_steps
    if past <= 0:
        return 1.0
    return max(0.0, 1 - past / settings.harden_steps) if settings.harden_steps else 0.0


def determinism_weight(settings: TrainSettings, step: int) -> float:
    """The weight of the columns' impurity in the loss at ``step``: rising linearly to ``determinism_weight`` over
    the soft phase, 0 after it."""
    if step > settings.soft_transition_steps:
        return 0.0
    return settings.determinism_weight * step / settings.soft_transition_steps


def impurity(model: torch.nn.Module) -> torch.Tensor | float:
    """The sum over layers of the impurity their last forward pass kept, taken from them (0 when none kept one)."""
    return _taken(model, "impurity")


def track_writes(model: torch.nn.Module, layers: tuple[int, ...] | None = None) -> None:
    """Make the delta-rule layers numbered in ``layers`` (0-based, in the model's order; None: every one) keep their
    write gates' mean for :func:`writes` in training mode."""
    recurrences = [module for module in model.modules() if hasattr(module, "track_writes")]  # delta's own attribute
    for index, module in enumerate(recurrences):
        setattr(module, "track_writes", layers is None or index in layers)


def writes(model: torch.nn.Module) -> torch.Tensor | float:
    """The sum over delta-rule layers of the mean write gate (beta / 2, in [0, 1]) their last forward pass kept,
    taken from them (0 when none kept one)."""
    return _taken(model, "writes")


def _taken(model: torch.nn.Module, name: str) -> torch.Tensor | float:
    """The sum over modules of the tensor attribute ``name`` their last forward pass kept, each set back to None."""
    kept: list[torch.Tensor] = []
    for module in model.modules():
        kept_by_module: torch.Tensor | None = getattr(module, name, None)
        if kept_by_module is not None:
            kept.append(kept_by_module.float())
            setattr(module, name, None)
    return sum(kept, 0.0)
