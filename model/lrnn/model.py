"""Block-diagonal input-dependent linear RNN (block-diagonal-lrnn.txt sections 3.3-3.4).

Token embedding -> ``n_layers`` recurrent blocks -> LayerNorm -> head. A block is pre-norm and residual:

    u_k = LN(x_k)
    h_k = A(u_k) h_{k-1} + B u_k        A(u) = column_norm_constraint(g(u)) (then spectral_norm_constraint
                                        for transition_norm "spectral"), block-diagonal, H blocks of b x b;
                                        g linear (the paper), or V (s U u) + c of rank transition_rank;
                                        "stochastic": A(u) = column sparsemax of g(u), no B u, h_0 learned
    x_k = x_k + out_proj(h_k)           y_k = h(x_k) of the paper
    x_k = x_k + MLP(LN(x_k))

The parallel pass runs the recurrence with ``model.ops.linear_scan`` (``config.scan_impl``); ``step`` runs one
recurrence step per layer (:meth:`BlockDiagonalRecurrence.step`, one ``scan_step`` with the column constraint
folded into the state), so decoding holds O(1) memory in the context length: the cache is one (B, H, b) state
per layer.

The stack (:class:`RecurrentBlock`, :class:`LinearRNN`, :class:`LRNNCache`) is shared with
``model/lrnn/diagonal.py``: an architecture only supplies its recurrence, a :class:`Recurrence`.

To read first: model/lrnn/minimal.py, the column-constrained model (full or low-rank g) in plain PyTorch
as a sequential scan, tested to give this one's logits on its weights (tests/model/test_minimal.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from model.base import (
    CallPath,
    Cost,
    InferenceCache,
    SequenceModel,
    TokenEmbedding,
    gather_last,
    long_tensor,
    parameter_count,
)
from model.config import DiagonalLRNNConfig, LRNNConfig
from model.layers import MLP
from model.ops import cpu_decode
from model.ops.cpu_decode import linear
from model.ops.linear_scan import (
    choose_scan_impl,
    column_divisors,
    column_norm_constraint,
    column_sparsemax,
    linear_scan,
    scan_step,
    spectral_norm_constraint,
)

GENERATED_SPREAD = 0.02  # how far g(u)'s entries vary with the input at initialisation (BlockDiagonalRecurrence)
GROWN_SPREAD = 0.3  # the same for a stochastic block added by BlockDiagonalLRNN.grown_from


@dataclass
class LRNNCache(InferenceCache):
    """The recurrent state of every layer: ``states[i]`` is (B, H, b); its size never grows with the lengths,
    and no step reads them, so rows of any lengths stack."""

    states: list[torch.Tensor]

    @classmethod
    def stack(cls, caches: Sequence[InferenceCache]) -> LRNNCache:
        states = [torch.cat(layer) for layer in zip(*(cache.states for cache in caches))]  # each (B, H, b)
        return LRNNCache(torch.cat([cache.lengths for cache in caches]), states)

    def select(self, rows: Sequence[int]) -> LRNNCache:
        index = long_tensor(rows)  # (rows,)
        return LRNNCache(self.lengths[index], [state[index.to(state.device)] for state in self.states])

    @property
    def nbytes(self) -> int:
        return sum(state.numel() * state.element_size() for state in self.states)

    def step_state(self) -> list[torch.Tensor]:
        return self.states


class Recurrence(nn.Module):
    """What a :class:`RecurrentBlock` runs: h_k = A_k h_{k-1} + b_k over a state of ``state_shape`` (H, b), read
    out by ``readout(states, u)``. A recurrence supplies ``transitions(u)`` and ``inputs(u)``, or overrides
    ``coefficients(u)``, which makes both at once (e.g. from one matrix product); it may override ``step`` with
    an equal one-token update that does less work."""

    state_shape: tuple[int, int]

    def transitions(self, u: torch.Tensor) -> torch.Tensor:
        """u: (..., d_model) -> A: (..., H, b, b)."""
        raise NotImplementedError

    def inputs(self, u: torch.Tensor) -> torch.Tensor:
        """u: (..., d_model) -> b: (..., H, b)."""
        raise NotImplementedError

    def coefficients(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u: (..., d_model) -> the scan's transitions (..., H, b, b) and inputs (..., H, b)."""
        return self.transitions(u), self.inputs(u)

    def step(self, u: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """u: (B, d_model), state: (B, H, b) -> the next state A(u) state + b(u): (B, H, b)."""
        return scan_step(*self.coefficients(u), state)

    def initial_state(self, rows: int) -> torch.Tensor:
        """h_0 of ``rows`` rows: (rows, H, b); zeros unless a recurrence learns it."""
        weight = next(self.parameters())
        return weight.new_zeros(rows, *self.state_shape)

    def for_serving(self, streaming: bool) -> bool:
        """Rearrange the weights in memory for :meth:`step` (values unchanged); returns whether anything moved.
        ``streaming``: whether one-token products will run through :func:`model.ops.cpu_decode.linear`'s kernel, which
        wants weights (out, in) in memory, rather than MKL's, which streams wide ones faster (in, out). The default
        moves nothing."""
        return False

    def readout(self, states: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """states: (..., H, b), u: (..., d_model) -> (..., d_model)."""
        raise NotImplementedError

    def fused_step_weights(self) -> list[torch.Tensor] | None:
        """The tensors :func:`model.ops.cpu_decode.lrnn_layer_step` takes from the recurrence, where it can run this
        recurrence's step; None (the default) where it cannot."""
        return None

    def joint_weight(self) -> torch.Tensor | None:
        """The matrix that :meth:`for_serving` stacked the recurrence's input-side weights into, while they still
        view it; None (the default) where there is none."""
        return None


class BlockDiagonalRecurrence(Recurrence):
    """h_k = A(u_k) h_{k-1} + B u_k with input-dependent block-diagonal A, read out by a linear map.

    Parameters, with ``transition_rank`` None: ``transition`` (g: d_model -> H b^2) and ``input_proj`` (B), as in
    the paper. With a rank r: ``in_proj`` (d_model -> r + H b, [U; B]: the code U u and B u from one product) and
    ``transition`` (V: r -> H b^2, g(u) = V (code_scale U u) + c, code_scale = d_model / r fixed).

    ``transition_norm`` "stochastic" (ours) makes every layer a probabilistic automaton: each column of A(u) is
    the sparsemax of g(u)'s column (``column_sparsemax``: non-negative, summing to 1, with exact zeros: the
    boundary of the paper's p = 1 constraint, where every deterministic automaton's 0/1 transition matrices lie),
    there is no input term B u (no ``input_proj``; no B rows in ``in_proj`` with a rank), and h_0 is a learned
    distribution per block (``initial``, softmax of its logits). Every state is then a distribution per block at
    any length: it cannot grow, and once training has moved a column's off-support entries more than 1 below its
    top, nothing leaks out of a remembered state at all, where under the other norms a remembered value drifts by
    the residue of B u at every step.

    Training runs in two phases (``soft_transitions``, set by the trainer: ``--soft-transition-steps``): first with
    each column a softmax instead, whose gradient reaches every entry, then with the sparsemax. A sparsemax from
    the start got stuck (an entry that leaves a column's support gets no gradient); a softmax alone finds the
    automaton but leaks e^-gap per step, and lost the first symbol of even_pairs by ~1,000 symbols. Evaluation and
    serving always use the sparsemax (docs/results.md). With ``track_impurity`` the soft phase keeps the mean Gini
    impurity of its columns (``impurity``), which the trainer can add to the loss (``--determinism-weight``): a
    softmax model may fit short strings with mixtures that are not an automaton, which then neither extrapolate
    nor survive the switch to sparsemax.
    """

    def __init__(self, config: LRNNConfig) -> None:
        super().__init__()
        self.num_blocks, self.block_size, self.p_norm = config.num_blocks, config.block_size, config.p_norm
        self.transition_norm, self.rank = config.transition_norm, config.transition_rank
        self.stochastic = config.transition_norm == "stochastic"
        self.state_shape = (config.num_blocks, config.block_size)
        self.input_size = 0 if self.stochastic else config.state_size  # B's outputs
        generated = config.num_blocks * config.block_size**2  # H b^2: g's outputs
        if self.rank is None:
            self.transition = nn.Linear(config.d_model, generated)  # g
            if not self.stochastic:
                self.input_proj = nn.Linear(config.d_model, config.state_size)  # B
        else:
            self.in_proj = nn.Linear(config.d_model, self.rank + self.input_size)  # [U; B]
            self.transition = nn.Linear(self.rank, generated)  # V, and c as its bias
        if self.stochastic:
            self.initial = nn.Parameter(torch.zeros(self.state_shape))  # logits of h_0, uniform per block
        self.soft_transitions = False  # "stochastic", training mode only: softmax columns (set by the trainer)
        self.track_impurity = False  # with soft_transitions: keep the columns' impurity (set by the trainer)
        self.impurity: torch.Tensor | None = None  # () mean of 1 - sum_i A_ij^2 over the last soft call's columns
        self.out_proj = nn.Linear(config.state_size, config.d_model)  # h
        # A(u) starts near 0.9 I for every input: bias 0.9 I, weights so small that each entry of g(u) varies
        # by ~0.02 (u = LN(x) has unit-variance entries). 0.9 I is a leaky running sum: states stay bounded
        # (~10x the input scale) and gradients fade smoothly over ~10 steps instead of exploding or dying at
        # once. A column's 1.2-norm (0.9 on the diagonal, ~0.02 elsewhere) starts near 0.94 (b = 8), so the
        # norm constraint is all but inactive and learning, not the clamp, moves A towards what a task needs.
        # With a rank r, g(u) = V (code_scale U u) + c: U ~ N(0, 1 / d_model) (U u of unit spread; no bias, c is
        # V's), the fixed code_scale = d_model / r, V ~ N(0, (0.02 / code_scale)^2 / r), so g(u) starts with the
        # same ~0.02 spread. Adam moves every weight by about the learning rate lr per step: a step on V then moves
        # g(u) by ~lr sum |code|, as a step on the full generator's weights moves it by ~lr sum |u|, and a step on
        # U moves the code as far, relative to its spread, as with codes of unit spread. Both matter (single runs,
        # docs/results.md): with code_scale 1, sum_mod5 at rank 4 fitted its training lengths but was at chance
        # past them after 1,500 steps; with the scale in U's initial spread instead of a multiplier, parity_check
        # at rank 1 stayed at chance for 2,250 steps; with the multiplier both were at 100% by step 500.
        # "stochastic" starts the same through the softmax it trains with first (``soft_transitions``): 0.9 on the
        # diagonal of every column, from logits ln(9 (b - 1)) there and 0 elsewhere.
        identity = torch.eye(config.block_size).expand(config.num_blocks, -1, -1)  # (H, b, b)
        diagonal = math.log(9 * max(config.block_size - 1, 1)) if self.stochastic else 0.9
        with torch.no_grad():
            self.transition.bias.copy_(diagonal * identity.flatten())
        self.code_scale = 1.0 if self.rank is None else config.d_model / self.rank
        spread = GENERATED_SPREAD / self.code_scale / self.transition.in_features**0.5
        nn.init.normal_(self.transition.weight, std=spread)
        if self.rank is not None:
            nn.init.normal_(self.in_proj.weight[: self.rank], std=config.d_model**-0.5)
            nn.init.zeros_(self.in_proj.bias[: self.rank])

    def coefficients(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u: (..., d_model) -> A(u): (..., H, b, b), every column's p-norm <= 1, and B u: (..., H, b) (zeros for
        "stochastic", whose columns are distributions)."""
        generated, inputs = self._generate(u)  # (..., H, b, b), (..., H, b)
        if self.stochastic:
            if not (self.training and self.soft_transitions):
                return column_sparsemax(generated), inputs
            columns = generated.softmax(dim=-2)  # (..., H, b, b)
            if self.track_impurity:  # 0 exactly when every column is one-hot: a deterministic automaton
                self.impurity = 1 - columns.square().sum(dim=-2).mean()
            return columns, inputs
        blocks = column_norm_constraint(generated, self.p_norm)  # (..., H, b, b)
        if self.transition_norm == "spectral":
            blocks = spectral_norm_constraint(blocks)  # then every block's largest singular value <= 1 too
        return blocks, inputs

    def step(self, u: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """u: (B, d_model), state: (B, H, b) -> A(u) state + B u: (B, H, b). Under the column constraint alone,
        each column's divisor d_j scales the state entry it multiplies instead of the column (A diag(1/d) h =
        A (h / d)): one pass less over the (B, H, b, b) blocks than ``scan_step(*coefficients(u), state)``, which
        it equals up to float rounding."""
        if self.transition_norm != "column":
            return super().step(u, state)
        generated, inputs = self._generate(u)  # (B, H, b, b), (B, H, b)
        divisors = column_divisors(generated, self.p_norm).squeeze(-2)  # (B, H, b)
        scaled = (state / divisors).to(generated.dtype)  # (B, H, b)
        return torch.matmul(generated, scaled.unsqueeze(-1)).squeeze(-1) + inputs  # (B, H, b)

    def for_serving(self, streaming: bool) -> bool:
        """With the full generator: stack g's and B's weights in one (H b^2 + H b, d_model) matrix that
        ``transition.weight`` and ``input_proj.weight`` then view (shapes, values and checkpoints unchanged), so
        that without gradients (the step and the parallel pass) g(u) and B u come from one product: (out, in) in
        memory for the ``streaming`` kernel, (in, out) for MKL's. A later ``.to()`` gives each weight its own
        storage again, and they go back to two products."""
        if self.rank is not None or self.stochastic or self.joint_weight() is not None:
            return False
        joint = torch.cat([self.transition.weight, self.input_proj.weight])  # (H b^2 + H b, d)
        if not streaming:
            joint = joint.t().contiguous().t()  # (in, out) in memory
        size = self.transition.out_features
        self.transition.weight.data = joint[:size]  # (H b^2, d) viewing the joint matrix
        self.input_proj.weight.data = joint[size:]  # (H b, d)
        return True

    def fused_step_weights(self) -> list[torch.Tensor] | None:
        """With the full generator, float32 and (out, in) in memory: the generator's weight, g's and B's biases, the
        readout's weight and bias. "column": after :meth:`for_serving` stacked g and B (the stacked matrix);
        "stochastic": g's own weight, and B's bias empty (there is no B u). None under the other norms."""
        if self.rank is not None or self.transition_norm not in ("column", "stochastic"):
            return None
        if self.stochastic:
            weight, inputs_bias = self.transition.weight, self.transition.bias.new_empty(0)  # (H b^2, d), (0,)
        else:
            weight, inputs_bias = self.joint_weight(), self.input_proj.bias  # (H b^2 + H b, d) or None, (H b,)
        if weight is None or not weight.is_contiguous() or weight.dtype != torch.float32:
            return None
        return [weight, self.transition.bias, inputs_bias, self.out_proj.weight, self.out_proj.bias]

    def joint_weight(self) -> torch.Tensor | None:
        """The (H b^2 + H b, d_model) matrix that :meth:`for_serving` made g's and B's weights views of, in its
        layout, while they still are; None otherwise (a low rank, not served, or moved since)."""
        if self.rank is not None or self.stochastic:
            return None
        first, second = self.transition.weight, self.input_proj.weight  # (H b^2, d), (H b, d)
        rows, (out_stride, in_stride) = first.shape[0] + second.shape[0], first.stride()
        stacked = (
            (out_stride, in_stride) in ((first.shape[1], 1), (1, rows))
            and second.stride() == first.stride()
            and second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and second.data_ptr() == first.data_ptr() + first.shape[0] * out_stride * first.element_size()
            and (first.dtype, first.device) == (second.dtype, second.device)
        )
        if not stacked:
            return None
        shape, strides = (rows, first.shape[1]), (out_stride, in_stride)
        view = vars(self).get("_joint_view")  # the same tensor each step: what is cached on it (cpu_decode's panels)
        if view is None or view.data_ptr() != first.data_ptr() or view.shape != shape or view.stride() != strides:
            view = first.detach().as_strided(shape, strides)
            vars(self)["_joint_view"] = view
        return view

    def _generate(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u: (..., d_model) -> g(u) as blocks (..., H, b, b), before any constraint, and B u (..., H, b)."""
        joint = None if torch.is_grad_enabled() else self.joint_weight()  # (H b^2 + H b, d_model)
        if joint is not None:  # after for_serving: g(u) and B u from one product
            products = linear(u, joint)  # (..., H b^2 + H b)
            size = self.transition.out_features
            generated = products[..., :size].add_(self.transition.bias)  # (..., H b^2)
            inputs = products[..., size:].add_(self.input_proj.bias)  # (..., H b)
        elif self.rank is None:
            generated = linear(u, self.transition.weight, self.transition.bias)  # (..., H b^2)
            inputs = None if self.stochastic else linear(u, self.input_proj.weight, self.input_proj.bias)  # (..., H b)
        else:
            code, inputs = linear(u, self.in_proj.weight, self.in_proj.bias).split(
                [self.rank, self.input_size], dim=-1
            )  # (..., r), (..., H b or 0)
            generated = linear(code * self.code_scale, self.transition.weight, self.transition.bias)  # (..., H b^2)
        generated = generated.unflatten(-1, (*self.state_shape, self.block_size))  # (..., H, b, b)
        if self.stochastic:
            return generated, generated.new_zeros(generated.shape[:-1])  # no input term: (..., H, b)
        return generated, inputs.unflatten(-1, self.state_shape)

    def initial_state(self, rows: int) -> torch.Tensor:
        """h_0: a learned distribution per block for "stochastic", else zeros: (rows, H, b)."""
        if not self.stochastic:
            return super().initial_state(rows)
        return self.initial.softmax(dim=-1).expand(rows, -1, -1)  # (rows, H, b)

    def transitions(self, u: torch.Tensor) -> torch.Tensor:
        """u: (..., d_model) -> A(u): (..., H, b, b) (:meth:`coefficients`' first half)."""
        return self.coefficients(u)[0]

    def readout(self, states: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """states: (..., H, b), u: (..., d_model) -> (..., d_model)."""
        return linear(states.flatten(-2), self.out_proj.weight, self.out_proj.bias)  # (..., d_model)


class RecurrentBlock(nn.Module):
    """Pre-norm residual block: ``x + readout(scan(LN(x)))`` then ``x + MLP(LN(x))``."""

    def __init__(self, recurrence: Recurrence, config: LRNNConfig | DiagonalLRNNConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.recurrence = recurrence
        self.dropout = nn.Dropout(config.dropout)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.mlp = MLP(config.d_model, config.d_ff, config.dropout)
        self.scan_impl, self.scan_chunk_size = config.scan_impl, config.scan_chunk_size

    def forward(self, x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, T, d_model), state: (B, H, b) or None (the recurrence's h_0) -> (B, T, d_model), final state
        (B, H, b)."""
        u, states, final_state = self._scan(x, state)
        x = x + self.dropout(self.recurrence.readout(states, u))  # (B, T, d_model)
        return x + self.mlp(self.ln_2(x)), final_state

    def forward_last(self, x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        """x: (B, T, d_model) right-padded -> (B, d_model): ``forward``'s output at position lengths - 1 of each
        row, with the readout and MLP run there only (the scan still covers every position)."""
        u, states, _ = self._scan(x, None)
        x, u, states = (gather_last(values, lengths) for values in (x, u, states))  # (B, d), (B, d), (B, H, b)
        x = x + self.dropout(self.recurrence.readout(states, u))  # (B, d_model)
        return x + self.mlp(self.ln_2(x))

    def _scan(self, x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: (B, T, d_model) -> LN(x) (B, T, d_model), every state (B, T, H, b), the last state (B, H, b)."""
        u = self.ln_1(x)  # (B, T, d_model)
        transitions, inputs = self.recurrence.coefficients(u)  # (B, T, H, b, b), (B, T, H, b)
        if state is None:
            state = self.recurrence.initial_state(x.shape[0]).to(inputs.dtype)  # (B, H, b)
        states, final_state = linear_scan(
            transitions, inputs, state, impl=self.scan_impl, chunk_size=self.scan_chunk_size
        )  # (B, T, H, b), (B, H, b)
        return u, states, final_state

    def _step_arrays(self) -> list[np.ndarray] | None:
        """What :func:`model.ops.cpu_decode.lrnn_layer_step` takes from this layer (``layer_step_arrays``), or None
        where the recurrence cannot step so. Kept between steps and made again when a parameter of the layer changes
        (``cpu_decode.stamp``: its storage, or its version in place) or row invariance turns on or off: gathering and
        converting them every step took ~40 us, a fifth of a tiny model's one-row step (docs/benchmarks.md). As for
        ``SequenceModel._reference_parameter``, replacing a parameter object itself would go unseen: nothing does."""
        invariant = cpu_decode.row_invariant()
        held = self.__dict__.get("_held_step_arrays")  # (parameters, their stamps and the invariance, arrays)
        if held is not None and held[1] == (invariant, *map(cpu_decode.stamp, held[0])):
            return held[2]
        weights = self.recurrence.fused_step_weights()
        arrays = None
        if weights is not None:
            ln_1, ln_2, mlp = self.ln_1, self.ln_2, self.mlp
            arrays = cpu_decode.layer_step_arrays([ln_1.weight, ln_1.bias, *weights, ln_2.weight, ln_2.bias,
                                                   mlp.c_fc.weight, mlp.c_fc.bias, mlp.c_proj.weight, mlp.c_proj.bias])
        parameters = list(self.parameters())
        self.__dict__["_held_step_arrays"] = (parameters, (invariant, *map(cpu_decode.stamp, parameters)), arrays)
        return arrays

    def step(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, d_model), state: (B, H, b) -> (B, d_model), next state (B, H, b). Served on the CPU with few rows,
        a recurrence that supports it runs the whole layer as one compiled call
        (:func:`model.ops.cpu_decode.lrnn_layer_step`, equal up to float rounding)."""
        if not self.training and cpu_decode.compiles_step(x):
            arrays = self._step_arrays()
            if arrays is not None and state.dtype == torch.float32:
                recurrence = self.recurrence
                return cpu_decode.lrnn_layer_step(
                    x, state, arrays, self.ln_1.eps, recurrence.transition_norm, recurrence.p_norm
                )
        u = self.ln_1(x)  # (B, d_model)
        state = self.recurrence.step(u, state)  # (B, H, b)
        x = x + self.dropout(self.recurrence.readout(state, u))  # (B, d_model)
        return x + self.mlp(self.ln_2(x)), state


class LinearRNN(SequenceModel):
    """Embedding -> one :class:`RecurrentBlock` per recurrence -> LayerNorm -> head."""

    selects_positions = True

    def __init__(self, config: LRNNConfig | DiagonalLRNNConfig, recurrences: list[Recurrence]) -> None:
        super().__init__()
        self.config = config
        self.embedding = TokenEmbedding(config)
        self.blocks = nn.ModuleList(RecurrentBlock(recurrence, config) for recurrence in recurrences)
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)

    def forward(
        self, tokens: torch.Tensor, cache: InferenceCache | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens: (B, T) -> logits (B, T, output_size); with ``cache``, continue from it and advance it. With
        ``positions`` ((B, T) bool), the logits at those positions only, (N, output_size) in row-major order: the
        head, the largest product of a language model, runs on them alone (a trainer scoring a few positions)."""
        hidden = self._hidden(tokens, cache)  # (B, T, d_model)
        if positions is not None:
            hidden = hidden[positions]  # (N, d_model)
        return self.embedding.logits(self.ln_f(hidden))  # (B, T, V) or (N, V)

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """tokens: (B, T) right-padded, lengths: (B,) -> (B, output_size); the last block's readout and MLP and the
        head run on the last positions only."""
        x = self.embedding(tokens)  # (B, T, d_model)
        for block in self.blocks[:-1]:
            x, _ = block(x, None)  # (B, T, d_model)
        return self.embedding.logits(self.ln_f(self.blocks[-1].forward_last(x, lengths)))  # (B, V)

    def for_serving(self) -> list[str]:
        """On the CPU, lay the weights out in memory for :meth:`step`'s one-token products (shapes, values and
        checkpoints unchanged). Where they run through the streaming kernel (:func:`model.ops.cpu_decode.streams`: one
        intra-op thread), every weight stays (out, in), the layout it reads fastest, and each recurrence stacks
        its generator and input weights into one matrix (:meth:`BlockDiagonalRecurrence.for_serving`). Otherwise
        (MKL's products, with several threads) the stacked matrix and every weight wider than tall (out_features
        > in_features: the MLPs' first layers, a low-rank V, the tied head) are stored (in, out): on this project's
        CPU MKL's one-thread product read a 4096 x 512 weight twice as fast that way, and a square or tall one as
        fast or faster as stored (docs/benchmarks.md, "One-token products" and "Low-rank transition generator"). The
        parallel pass multiplies by the same matrices (equal up to float rounding); training never calls this. Last,
        the products' weights are packed for oneDNN (:meth:`SequenceModel.for_serving`). On CUDA nothing changes."""
        if self.device.type != "cpu":
            return []
        streaming = cpu_decode.streams(dtype=self.dtype)
        joined = sum(block.recurrence.for_serving(streaming) for block in self.blocks)
        notes = [f"{joined} layers make g(u) and B u with one product (CPU)"] if joined else []
        if streaming:
            fused = sum(block.recurrence.fused_step_weights() is not None for block in self.blocks)
            if fused:
                notes.append(f"{fused} layers step as one compiled call each at {cpu_decode.rows_note()} (CPU)")
            notes.append("one-token products through the streaming matrix-vector kernel (CPU, one thread)")
            return [*notes, *super().for_serving()]
        wide = [
            module.weight
            for module in self.blocks.modules()
            if isinstance(module, nn.Linear) and module.out_features > module.in_features
        ]
        head = self.embedding.embed.weight  # (V, d): the tied head multiplies by its transpose
        if self.config.is_language_model and head.shape[0] > head.shape[1]:
            wide.append(head)
        moved = [weight for weight in wide if weight.stride(0) != 1]  # not (in, out) in memory yet
        for weight in moved:
            weight.data = weight.data.t().contiguous().t()  # (out, in) with (in, out) in memory
        if moved:
            notes.append(f"{len(moved)} weight matrices wider than tall stored transposed for one-token products (CPU)")
        return [*notes, *super().for_serving()]

    def product_weights(self) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """As the default, except that a recurrence whose g and B weights :meth:`for_serving` stacked multiplies by
        the stacked matrix (a view made anew for each product) instead of by either."""
        joints = []
        for block in self.blocks:
            recurrence = block.recurrence
            joint = recurrence.joint_weight()
            if joint is not None:
                joints.append((joint, (recurrence.transition.weight, recurrence.input_proj.weight)))
        stacked = {id(owner) for _, owners in joints for owner in owners}
        return [*(pair for pair in super().product_weights() if id(pair[0]) not in stacked), *joints]

    def new_cache(self, batch_size: int) -> LRNNCache:
        states = [
            block.recurrence.initial_state(batch_size).to(device=self.device, dtype=self.dtype).contiguous()
            for block in self.blocks
        ]  # each (B, H, b)
        return LRNNCache(long_tensor(0, batch_size), states)

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """tokens: (B,) -> logits (B, output_size); advances ``cache`` by one token."""
        return self.embedding.logits(self.ln_f(self._blocks_step(tokens, cache)))  # (B, V)

    def step_greedy(self, tokens: torch.Tensor, cache: InferenceCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The picks of ``step``'s logits, taken by the head without them where it can (``TokenEmbedding.greedy``)."""
        return self.embedding.greedy(self.ln_f(self._blocks_step(tokens, cache)))  # (B,), (B,)

    def advance(self, tokens: torch.Tensor, cache: InferenceCache) -> None:
        """``step`` without the final layer norm and the head."""
        self._blocks_step(tokens, cache)

    def _blocks_step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """tokens: (B,) -> the last block's output, (B, d_model); advances ``cache`` by one token."""
        assert isinstance(cache, LRNNCache)
        x = self.embedding(tokens)  # (B, d_model)
        for i, block in enumerate(self.blocks):
            x, cache.states[i] = block.step(x, cache.states[i])  # (B, d_model), (B, H, b)
        cache.lengths = cache.lengths + 1
        return x

    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost:
        """flops: per position the blocks' weights (projections, readout, MLP: one multiply-add each; "final" runs
        the last block's readout and MLP on the last positions only), per layer the scan (:meth:`_scan_flops`),
        and the head's d x output_size per logit position ("final": one per row). The context never matters: a
        cached chunk costs what the same chunk costs from an empty cache. nbytes: per position the transitions
        (:meth:`_transition_bytes`), ~6 d + 3 H b + 2 d_ff activations and the logits' output_size."""
        config = self.config
        weights, tail = self._weight_counts
        flops = rows * (length * weights + len(self.blocks) * self._scan_flops(rows, length))
        if path == "final":
            flops -= rows * (length - 1) * tail
        head = self.head_cost(rows if path == "final" else rows * length)
        activations = (6 * config.d_model + 3 * self._state_size + 2 * config.d_ff) * self.dtype.itemsize
        return Cost(
            flops=float(flops + head.flops),
            nbytes=rows * length * (self._transition_bytes(rows, length) + activations) + head.nbytes,
        )

    def head_cost(self, positions: int) -> Cost:
        """d x output_size multiply-adds and output_size logits a position."""
        config = self.config
        return Cost(flops=float(positions * config.d_model * config.output_size),
                    nbytes=positions * config.output_size * self.dtype.itemsize)

    def cache_nbytes(self, length: int) -> int:
        """One (H, b) state per layer, whatever the length."""
        return len(self.blocks) * self._state_size * self.dtype.itemsize

    @functools.cached_property
    def _weight_counts(self) -> tuple[int, int]:
        """The blocks' parameters, and those of the last block's readout and MLP (counted once: costs are asked
        for on every scheduling decision)."""
        last = self.blocks[-1]
        return parameter_count(self.blocks), parameter_count(last.recurrence.out_proj, last.mlp)

    @property
    def _state_size(self) -> int:
        """H b, the state's size."""
        return math.prod(self.blocks[0].recurrence.state_shape)

    def _scan_impl(self, rows: int, length: int) -> str:
        """The scan that runs on ``rows`` x ``length``: the configured one, or the "auto" policy's choice (the Triton
        scan where no gradient is asked for and the dtype allows it, the compiled loop for float32 on the CPU)."""
        heads, block = self.blocks[0].recurrence.state_shape
        impl = self.config.scan_impl
        if impl == "auto":
            triton = not torch.is_grad_enabled() and self.dtype != torch.float64
            compiled = self.dtype == torch.float32
            impl = choose_scan_impl(rows, length, heads, block, self.device, triton, compiled)
        return impl

    def _scan_flops(self, rows: int, length: int) -> int:
        """Multiply-adds of one layer's scan over ``length`` positions of one row, H heads of b x b blocks: the loop
        does H b^2 per position; the parallel scan H (b^3 + 2 b^2) per position (it multiplies transitions
        together); the chunked scan (and the Triton scan, the same algorithm) the loop's work plus, on all chunks but
        the last of n = length // chunk_size, the products of the transitions inside each chunk and the scan across
        chunks, ~H (b^3 + 2 b^2) per position there; the compiled loop the loop's."""
        heads, block = self.blocks[0].recurrence.state_shape
        impl = self._scan_impl(rows, length)
        if impl == "parallel":
            return length * heads * (block**3 + 2 * block**2)
        chunks = length // self.config.scan_chunk_size if impl in ("chunked", "triton") else 0
        products = max(chunks - 1, 0) * self.config.scan_chunk_size
        return heads * (length * block**2 + products * (block**3 + 2 * block**2))

    def _transition_bytes(self, rows: int, length: int) -> int:
        """Bytes per position of one layer's transitions while it runs: (H, b, b) a few times over (the linear map's
        output, the norm constraint's copies, the scan's float32 copy), 2.5 times more in the parallel scan."""
        heads, block = self.blocks[0].recurrence.state_shape
        copies = 4 + (3 if self._scan_impl(rows, length) == "parallel" else 0)
        return copies * heads * block * block * max(self.dtype.itemsize, 4)

    def _hidden(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        """tokens: (B, T) -> hidden states before the final LayerNorm (B, T, d_model)."""
        assert cache is None or isinstance(cache, LRNNCache)
        x = self.embedding(tokens)  # (B, T, d_model)
        for i, block in enumerate(self.blocks):
            x, final_state = block(x, None if cache is None else cache.states[i])  # (B, T, d_model), (B, H, b)
            if cache is not None:
                cache.states[i] = final_state
        if cache is not None:
            cache.lengths = cache.lengths + tokens.shape[1]
        return x


class BlockDiagonalLRNN(LinearRNN):
    """The block-diagonal input-dependent LRNN: :class:`LinearRNN` with :class:`BlockDiagonalRecurrence` layers."""

    def __init__(self, config: LRNNConfig) -> None:
        super().__init__(config, [BlockDiagonalRecurrence(config) for _ in range(config.n_layers)])

    def grown_from(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict for this model from ``weights``, those of the same LRNN with fewer blocks per layer: a wider
        state for a trained model to go on training with. Each layer's first blocks are the smaller model's (every
        tensor that grew, g's and B's rows, h_0's blocks, the readout's columns, holds the old one as its leading
        part); the new blocks keep this model's own initial weights, but the readout's columns from them are zero,
        so the grown model computes what the smaller one did (tests/model/test_lrnn.py: the same logits). Under
        "stochastic", a new block's transitions start with logits 0.5 on the diagonal (not ln(9 (b - 1))) and
        g(u)'s entries spread by ~0.3 (not 0.02): every entry of each column is then inside its sparsemax's
        support, whose gradient is zero outside it (and, with the support the diagonal alone, everywhere), and the
        new states depend on their input from the start. A ValueError names what is not this LRNN with fewer
        blocks."""
        size, readout = self.config.block_size, weights.get("blocks.0.recurrence.out_proj.weight")
        old_blocks = 0 if readout is None else readout.shape[-1] // size
        if not 0 < old_blocks < self.config.num_blocks:
            raise ValueError(f"not an LRNN of blocks of {size} with fewer than {self.config.num_blocks} blocks per "
                             f"layer (its first layer's readout: {None if readout is None else tuple(readout.shape)})")
        with torch.device("meta"):  # the smaller model's shapes, no weights drawn
            expected = type(self)(dataclasses.replace(self.config, num_blocks=old_blocks)).state_dict()
        wrong = [f"{name}: {None if name not in weights else tuple(weights[name].shape)} there, "
                 f"{tuple(shape.shape)} expected" for name, shape in expected.items()
                 if name not in weights or weights[name].shape != shape.shape]  # fmt: skip
        if wrong or len(weights) != len(expected):
            raise ValueError(f"not this LRNN with {old_blocks} blocks per layer: {'; '.join(wrong) or 'other tensors'}")
        grown = {}
        for name, fresh in self.state_dict().items():
            grown[name] = tensor = fresh.clone()
            tensor[tuple(slice(0, length) for length in weights[name].shape)] = weights[name]
        old_state = old_blocks * size  # H b there
        diagonal = (0.5 * torch.eye(size)).repeat(self.config.num_blocks - old_blocks, 1, 1)  # (new H, b, b)
        for index, block in enumerate(self.blocks):
            prefix = f"blocks.{index}.recurrence."
            grown[prefix + "out_proj.weight"][:, old_state:] = 0
            if block.recurrence.stochastic:
                grown[prefix + "transition.bias"][old_state * size :] = diagonal.flatten()
                grown[prefix + "transition.weight"][old_state * size :] *= GROWN_SPREAD / GENERATED_SPREAD
        return grown
