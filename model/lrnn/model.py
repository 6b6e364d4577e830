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

What each call costs is model/lrnn/cost.py's; the weights' layouts as served and the compiled decode step are
model/lrnn/serving.py's; growing a trained model to more blocks per layer is model/lrnn/growth.py's.

To read first: model/lrnn/minimal.py, the column-constrained model (full or low-rank g) in plain PyTorch
as a sequential scan, tested to give this one's logits on its weights (tests/model/test_minimal.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

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
from model.lrnn import cost as lrnn_cost
from model.lrnn import growth
from model.lrnn import serving as lrnn_serving
from model.ops.cpu_decode import linear
from model.ops.linear_scan import (
    column_divisors,
    column_norm_constraint,
    column_sparsemax,
    linear_scan,
    scan_step,
    spectral_norm_constraint,
)

GENERATED_SPREAD = 0.02  # how far g(u)'s entries vary with the input at initialisation (BlockDiagonalRecurrence)


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
        """With the full generator: g's and B's weights as views of one matrix, so that without gradients g(u) and
        B u come from one product (:func:`model.lrnn.serving.stack_generator_weights`)."""
        return lrnn_serving.stack_generator_weights(self, streaming)

    def fused_step_weights(self) -> list[torch.Tensor] | None:
        """With the full generator, float32 and (out, in) in memory, under "column" (once stacked) or "stochastic":
        :func:`model.lrnn.serving.fused_step_weights`."""
        return lrnn_serving.fused_step_weights(self)

    def joint_weight(self) -> torch.Tensor | None:
        """The matrix :meth:`for_serving` stacked g's and B's weights into, while they still view it
        (:func:`model.lrnn.serving.joint_weight`)."""
        return lrnn_serving.joint_weight(self)

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

    def step(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, d_model), state: (B, H, b) -> (B, d_model), next state (B, H, b). Served on the CPU with few rows,
        a recurrence that supports it runs the whole layer as one compiled call
        (:func:`model.lrnn.serving.compiled_step`, equal up to float rounding)."""
        compiled = lrnn_serving.compiled_step(self, x, state)
        if compiled is not None:
            return compiled
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
        checkpoints unchanged: :func:`model.lrnn.serving.lay_out_weights`), then pack the products' weights for
        oneDNN (:meth:`SequenceModel.for_serving`). On CUDA nothing changes."""
        if self.device.type != "cpu":
            return []
        return [*lrnn_serving.lay_out_weights(self), *super().for_serving()]

    def product_weights(self) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """As the default, except that a recurrence whose g and B weights :meth:`for_serving` stacked multiplies by
        the stacked matrix instead of by either (:func:`model.lrnn.serving.product_weights`)."""
        return lrnn_serving.product_weights(self.blocks, super().product_weights())

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
        """What one call costs, for the scan it runs at that size: :func:`model.lrnn.cost.cost` gives the formulas
        (the context never matters)."""
        return lrnn_cost.cost(self.config, self._sizes, self.dtype, self.device, path, rows, length, context)

    def head_cost(self, positions: int) -> Cost:
        """d x output_size multiply-adds and output_size logits a position (:func:`model.lrnn.cost.head_cost`)."""
        return lrnn_cost.head_cost(self.config, self.dtype.itemsize, positions)

    def cache_nbytes(self, length: int) -> int:
        """One (H, b) state per layer, whatever the length (:func:`model.lrnn.cost.cache_nbytes`)."""
        return lrnn_cost.cache_nbytes(self._sizes, self.dtype.itemsize)

    @functools.cached_property
    def _sizes(self) -> lrnn_cost.Sizes:
        """What the costs read off the layers: their number, the state's shape, the blocks' parameters and those of
        the last block's readout and MLP (counted once: costs are asked for on every scheduling decision)."""
        last = self.blocks[-1]
        return lrnn_cost.Sizes(
            layers=len(self.blocks),
            state_shape=self.blocks[0].recurrence.state_shape,
            weights=parameter_count(self.blocks),
            tail=parameter_count(last.recurrence.out_proj, last.mlp),
        )

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
        """A state dict for this model from ``weights``, those of the same LRNN with fewer blocks per layer, under
        which it computes what the smaller one did (:func:`model.lrnn.growth.grown_from`); a ValueError names what is
        not this LRNN with fewer blocks."""
        return growth.grown_from(self, weights, GENERATED_SPREAD)
