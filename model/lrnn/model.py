"""Block-diagonal input-dependent linear RNN (Fan, Chi, Rudnicky 2024). A block computes, with u_k = LN(x_k), h_k =
A(u_k) h_{k-1} + B u_k (A block-diagonal, norm-constrained), x_k += out_proj(h_k), then x_k += MLP(LN(x_k)), as a scan
(``linear_scan``) or one step per token with a (B, H, b) state per layer."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.nn import functional as F

from model.base import SequenceModel, gather_last, parameter_count
from model.cache import InferenceCache, long_tensor
from model.config import DiagonalLRNNConfig, LRNNConfig
from model.layers import MLP, TokenEmbedding
from model.lrnn import cost as lrnn_cost
from model.lrnn import growth
from model.lrnn import serving as lrnn_serving
from model.lrnn.delta import DeltaRecurrence
from model.lrnn.recurrence import Recurrence
from model.ops.cpu import cpu_decode
from model.ops.cpu.cpu_decode import linear
from model.ops.scan.constraints import (
    column_divisors,
    column_norm_constraint,
    column_sparsemax,
    orthogonal_constraint,
    spectral_norm_constraint,
)
from model.ops.scan.dispatch import linear_scan
from model.serving import CallPath, Cost

GENERATED_SPREAD = 0.02  # how far g(u)'s entries vary with the input at initialisation (BlockDiagonalRecurrence)


@dataclass
class LRNNCache(InferenceCache):
    """Every layer's recurrent state, ``states[i]`` (B, H, b); its size does not grow with the lengths."""

    states: list[torch.Tensor]

    @classmethod
    def stack(cls, caches: Sequence[LRNNCache]) -> LRNNCache:
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


class BlockDiagonalRecurrence(Recurrence):
    """h_k = A(u_k) h_{k-1} + B u_k. Full rank: g = ``transition``, B = ``input_proj``; rank r: ``in_proj`` = [U; B],
    g(u) = V (code_scale U u) + c. "stochastic": sparsemax columns (while training, softmax blended in by ``softness``:
    1 all softmax, 0 all sparsemax; Gini ``impurity`` kept with ``track_impurity``), no B u, h_0 learned.
    "orthogonal": each block's polar factor, no B u, h_0 learned (a point that the transitions move on a sphere)."""

    def __init__(self, config: LRNNConfig) -> None:
        super().__init__()
        self.num_blocks, self.block_size, self.p_norm = config.num_blocks, config.block_size, config.p_norm
        self.transition_norm, self.rank = config.transition_norm, config.transition_rank
        self.stochastic = config.transition_norm == "stochastic"
        self.inputless = config.transition_norm in ("stochastic", "orthogonal")  # no B u; h_0 learned
        self.state_shape = (config.num_blocks, config.block_size)
        self.input_size = 0 if self.inputless else config.state_size  # B's outputs
        generated = config.num_blocks * config.block_size**2  # H b^2: g's outputs
        if self.rank is None:
            self.transition = nn.Linear(config.d_model, generated)  # g
            if not self.inputless:
                self.input_proj = nn.Linear(config.d_model, config.state_size)  # B
        else:
            self.in_proj = nn.Linear(config.d_model, self.rank + self.input_size)  # [U; B]
            self.transition = nn.Linear(self.rank, generated)  # V, and c as its bias
        if self.stochastic:
            self.initial = nn.Parameter(torch.zeros(self.state_shape))  # logits of h_0, uniform per block
        elif self.inputless:  # h_0 itself, unit length per block, in no special direction
            self.initial = nn.Parameter(F.normalize(torch.randn(self.state_shape), dim=-1))
        self.softness = 0.0  # "stochastic", training mode only: the softmax's share of the columns (set by the trainer)
        self.track_impurity = False  # with softness: keep the columns' impurity (set by the trainer)
        self.impurity: torch.Tensor | None = None  # () mean of 1 - sum_i A_ij^2 over the last soft call's columns
        self.out_proj = nn.Linear(config.state_size, config.d_model)  # h
        if config.state_codes:  # (H, K, b): set by ``python -m training snap``
            self.register_buffer("state_codes", torch.zeros(config.num_blocks, config.state_codes, config.block_size))
            self.snap_every = config.snap_every
        # A(u) starts near 0.9 I for every input (a leaky running sum: bounded states, gradients that fade
        # smoothly), g(u) varying by ~GENERATED_SPREAD, so the norm constraint starts all but inactive. With a rank
        # r: U ~ N(0, 1 / d_model), V's spread divided by code_scale, so g(u) starts with the same spread while an
        # Adam step on V moves g(u) as one on the full generator would (docs/models.md). "stochastic" starts at 0.9
        # on each column's diagonal through its softmax: logits ln(9 (b - 1)) there, 0 elsewhere.
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
        """A(u) (..., H, b, b) constrained, and B u (..., H, b) (zeros if stochastic)."""
        generated, inputs = self._generate(u)  # (..., H, b, b), (..., H, b)
        if self.stochastic:
            softness = self.softness if self.training else 0.0
            if not softness:
                return column_sparsemax(generated), inputs
            columns = generated.softmax(dim=-2)  # (..., H, b, b)
            if softness < 1:  # hardening: every step a little nearer the sparsemax served
                columns = torch.lerp(column_sparsemax(generated), columns, softness)
            if self.track_impurity:  # 0 exactly when every column is one-hot: a deterministic automaton
                self.impurity = 1 - columns.square().sum(dim=-2).mean()
            return columns, inputs
        if self.transition_norm == "orthogonal":
            return orthogonal_constraint(generated), inputs
        blocks = column_norm_constraint(generated, self.p_norm)  # (..., H, b, b)
        if self.transition_norm == "spectral":
            blocks = spectral_norm_constraint(blocks)  # then every block's largest singular value <= 1 too
        return blocks, inputs

    def step(self, u: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Under "column", scales the state by the column divisors instead (A diag(1/d) h = A (h / d)); equal up to
        rounding."""
        if self.transition_norm != "column":
            return super().step(u, state)
        generated, inputs = self._generate(u)  # (B, H, b, b), (B, H, b)
        divisors = column_divisors(generated, self.p_norm).squeeze(-2)  # (B, H, b)
        scaled = (state / divisors).to(generated.dtype)  # (B, H, b)
        return torch.matmul(generated, scaled.unsqueeze(-1)).squeeze(-1) + inputs  # (B, H, b)

    def for_serving(self, streaming: bool) -> bool:
        """See :func:`model.lrnn.serving.stack_generator_weights`."""
        return lrnn_serving.stack_generator_weights(self, streaming)

    def fused_step_weights(self) -> list[torch.Tensor] | None:
        return lrnn_serving.fused_step_weights(self)

    def joint_weight(self) -> torch.Tensor | None:
        return lrnn_serving.joint_weight(self)

    def _generate(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """u -> g(u) as blocks (..., H, b, b), unconstrained, and B u (..., H, b)."""
        joint = None if torch.is_grad_enabled() else self.joint_weight()  # (H b^2 + H b, d_model)
        inputs: torch.Tensor | None
        if joint is not None:  # after for_serving: g(u) and B u from one product
            products = linear(u, joint)  # (..., H b^2 + H b)
            size = self.transition.out_features
            generated = products[..., :size].add_(self.transition.bias)  # (..., H b^2)
            inputs = products[..., size:].add_(self.input_proj.bias)  # (..., H b)
        elif self.rank is None:
            generated = linear(u, self.transition.weight, self.transition.bias)  # (..., H b^2)
            inputs = None if self.inputless else linear(u, self.input_proj.weight, self.input_proj.bias)  # (..., H b)
        else:
            code, inputs = linear(u, self.in_proj.weight, self.in_proj.bias).split(
                [self.rank, self.input_size], dim=-1
            )  # (..., r), (..., H b or 0)
            generated = linear(code * self.code_scale, self.transition.weight, self.transition.bias)  # (..., H b^2)
        generated = generated.unflatten(-1, (*self.state_shape, self.block_size))  # (..., H, b, b)
        if self.inputless:
            return generated, generated.new_zeros(generated.shape[:-1])  # no input term: (..., H, b)
        assert inputs is not None
        return generated, inputs.unflatten(-1, self.state_shape)

    def initial_state(self, rows: int) -> torch.Tensor:
        """h_0 (rows, H, b): learned distributions for "stochastic", learned points for "orthogonal", else zeros."""
        if self.stochastic:
            return self.initial.softmax(dim=-1).expand(rows, -1, -1)  # (rows, H, b)
        if self.inputless:
            return self.initial.expand(rows, -1, -1)  # (rows, H, b)
        return super().initial_state(rows)

    def transitions(self, u: torch.Tensor) -> torch.Tensor:
        return self.coefficients(u)[0]

    def readout(self, states: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return self.project_out(states.flatten(-2))  # (..., d_model)

    def snap(self, state: torch.Tensor) -> torch.Tensor:
        return nearest_codes(state, self.state_codes)


def nearest_codes(state: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """state (B, H, b), codes (H, K, b) -> each block's nearest code (B, H, b): Euclidean, computed exactly (the same
    choice for any batch), the first of equals."""
    queries = state.transpose(0, 1).float()  # (H, B, b)
    distances = torch.cdist(queries, codes.float(), compute_mode="donot_use_mm_for_euclid_dist")  # (H, B, K)
    nearest = distances.argmin(dim=-1)  # (H, B)
    chosen = torch.gather(codes, 1, nearest.unsqueeze(-1).expand(-1, -1, codes.shape[-1]))  # (H, B, b)
    return chosen.transpose(0, 1).to(state.dtype)


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

    def forward(
        self, x: torch.Tensor, state: torch.Tensor | None, offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, d_model), state (B, H, b) or None after ``offset`` symbols -> (B, T, d_model), final state."""
        if not self.recurrence.mixes:
            out, _, final_state = self.forward_states(x, state, offset)
            return out, final_state
        read, final_state = self.mix(x, state)  # (B, T, H b), (B, H, b)
        return self.finish(x, self.recurrence.project_out(read)), final_state

    def forward_states(
        self, x: torch.Tensor, state: torch.Tensor | None, offset: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`forward`, with every state (B, T, H, b) between the output and the final state."""
        u, states, final_state = self.scan(x, state, offset)
        return self.finish(x, self.recurrence.readout(states, u)), states, final_state

    def forward_last(self, x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
        """``forward``'s output (B, d_model) at lengths - 1, readout and MLP there only."""
        if self.recurrence.mixes:
            last = gather_last(self.mix(x, None)[0], lengths)  # (B, H b)
            read = self.recurrence.project_out(last)  # (B, d_model)
            x = gather_last(x, lengths)  # (B, d_model)
        else:
            u, states, _ = self.scan(x, None, 0)
            x, u, states = (gather_last(values, lengths) for values in (x, u, states))  # (B, d), (B, d), (B, H, b)
            read = self.recurrence.readout(states, u)  # (B, d_model)
        return self.finish(x, read)

    def finish(self, x: torch.Tensor, read: torch.Tensor) -> torch.Tensor:
        """The block's tail: x + read (the recurrence's readout, d_model wide), then + MLP(LN(that))."""
        x = x + self.dropout(read)
        out: torch.Tensor = x + self.mlp(self.ln_2(x))
        return out

    def mix(self, x: torch.Tensor, state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`Recurrence.mix` of LN(x) from ``state`` (the initial one if None)."""
        u = self.ln_1(x)  # (B, T, d_model)
        if state is None:
            state = self.recurrence.initial_state(x.shape[0]).to(u.dtype)  # (B, H, b)
        return self.recurrence.mix(u, state, self.scan_impl, self.scan_chunk_size)

    def scan(
        self, x: torch.Tensor, state: torch.Tensor | None, offset: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, d_model) after ``offset`` symbols -> LN(x), every state (B, T, H, b), the last state. With codes:
        on the CPU in float32 one compiled loop that snaps (``scan_impl`` "auto"), else a scan per stretch between
        snaps, each stretch's last state replaced by its code."""
        u = self.ln_1(x)  # (B, T, d_model)
        transitions, inputs = self.recurrence.coefficients(u)  # (B, T, H, b, b), (B, T, H, b)
        if state is None:
            state = self.recurrence.initial_state(x.shape[0]).to(inputs.dtype)  # (B, H, b)
        every, length = self.recurrence.snap_every, x.shape[1]
        if not every:
            states, state = linear_scan(
                transitions, inputs, state, impl=self.scan_impl, chunk_size=self.scan_chunk_size
            )
            return u, states, state  # (B, T, H, b), (B, H, b)
        compiled = None
        if self.scan_impl == "auto":
            compiled = cpu_decode.snapped_scan(transitions, inputs, state, self.recurrence.state_codes, every, offset)
        if compiled is not None:
            return u, *compiled
        stretches, start = [], 0
        while start < length:
            end = min(length, start + every - (offset + start) % every)  # the next snap, or the input's end
            states, state = linear_scan(
                transitions[:, start:end],
                inputs[:, start:end],
                state,
                impl=self.scan_impl,
                chunk_size=self.scan_chunk_size,
            )  # (B, end - start, H, b), (B, H, b)
            if (offset + end) % every == 0:
                state = self.recurrence.snap(state)
                states = torch.cat([states[:, :-1], state.unsqueeze(1)], dim=1)
            stretches.append(states)
            start = end
        return u, torch.cat(stretches, dim=1), state

    def step(
        self, x: torch.Tensor, state: torch.Tensor, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, d_model), state (B, H, b) after ``lengths`` (B,) symbols (needed with codes) -> (B, d_model), next
        state."""
        if self.recurrence.mixes:
            read, state = self.mix(x.unsqueeze(1), state)  # (B, 1, H b), (B, H, b)
            return self.finish(x, self.recurrence.project_out(read[:, 0])), state
        every = self.recurrence.snap_every
        compiled = None if every else lrnn_serving.compiled_step(self, x, state)
        if compiled is not None:
            return compiled
        u = self.ln_1(x)  # (B, d_model)
        state = self.recurrence.step(u, state)  # (B, H, b)
        if every:
            assert lengths is not None, "a recurrence with codes needs each row's length to step"
            due = ((lengths.to(state.device) + 1) % every == 0).view(-1, 1, 1)  # (B, 1, 1)
            state = torch.where(due, self.recurrence.snap(state), state)
        return self.finish(x, self.recurrence.readout(state, u)), state


class LinearRNN(SequenceModel):
    """Embedding -> one :class:`RecurrentBlock` per recurrence -> LayerNorm -> head."""

    config: LRNNConfig | DiagonalLRNNConfig
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
        """As :meth:`SequenceModel.forward`; with ``positions`` (B, T) bool, only those logits, (N, output_size)."""
        hidden = self._hidden(tokens, cache)  # (B, T, d_model)
        if positions is not None:
            hidden = hidden[positions]  # (N, d_model)
        return self.embedding.logits(self.ln_f(hidden))  # (B, T, V) or (N, V)

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The last block's tail and the head run on the last positions only."""
        x = self.embedding(tokens)  # (B, T, d_model)
        for block in self.blocks[:-1]:
            x, _ = block(x, None)  # (B, T, d_model)
        last = self.blocks[-1]
        assert isinstance(last, RecurrentBlock)
        return self.embedding.logits(self.ln_f(last.forward_last(x, lengths)))  # (B, V)

    def for_serving(self) -> list[str]:
        """On the CPU, lay out and pack the weights; on CUDA nothing changes."""
        if self.device.type != "cpu":
            return []
        return [*lrnn_serving.lay_out_weights(self), *super().for_serving()]

    def product_weights(self) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        return lrnn_serving.product_weights(self.blocks, super().product_weights())

    def new_cache(self, batch_size: int) -> LRNNCache:
        states = [
            block.recurrence.initial_state(batch_size).to(device=self.device, dtype=self.dtype).contiguous()
            for block in cast("Iterable[RecurrentBlock]", self.blocks)
        ]  # each (B, H, b)
        return LRNNCache(long_tensor(0, batch_size), states)

    def step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        return self.embedding.logits(self.ln_f(self._blocks_step(tokens, cache)))  # (B, V)

    def step_greedy(self, tokens: torch.Tensor, cache: InferenceCache) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embedding.greedy(self.ln_f(self._blocks_step(tokens, cache)))  # (B,), (B,)

    def advance(self, tokens: torch.Tensor, cache: InferenceCache) -> None:
        """``step`` without the final norm and head."""
        self._blocks_step(tokens, cache)

    def _blocks_step(self, tokens: torch.Tensor, cache: InferenceCache) -> torch.Tensor:
        """tokens (B,) -> the last block's output (B, d_model); advances ``cache``."""
        assert isinstance(cache, LRNNCache)
        x: torch.Tensor = self.embedding(tokens)  # (B, d_model)
        for i, block in enumerate(cast("Iterable[RecurrentBlock]", self.blocks)):
            x, cache.states[i] = block.step(x, cache.states[i], cache.lengths)  # (B, d_model), (B, H, b)
        cache.lengths = cache.lengths + 1
        return x

    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost:
        return lrnn_cost.cost(self.config, self._sizes, self.dtype, self.device, path, rows, length, context)

    def head_cost(self, positions: int) -> Cost:
        return lrnn_cost.head_cost(self.config, self.dtype.itemsize, positions)

    def cache_nbytes(self, length: int) -> int:
        return lrnn_cost.cache_nbytes(self._sizes, self.dtype.itemsize)

    @functools.cached_property
    def _sizes(self) -> lrnn_cost.Sizes:
        """What the cost formulas read off the layers."""
        first, last = self.blocks[0], self.blocks[-1]
        assert isinstance(first, RecurrentBlock) and isinstance(last, RecurrentBlock)
        return lrnn_cost.Sizes(
            layers=len(self.blocks),
            state_shape=first.recurrence.state_shape,
            weights=parameter_count(self.blocks),
            tail=parameter_count(last.recurrence.out_proj, last.mlp),
            codes=self._codes,
            snap_every=first.recurrence.snap_every,
        )

    @property
    def _codes(self) -> int:
        """Each block's state codes (``LRNNConfig.state_codes``; 0: none)."""
        return self.config.state_codes if isinstance(self.config, LRNNConfig) else 0

    def _hidden(self, tokens: torch.Tensor, cache: InferenceCache | None = None) -> torch.Tensor:
        """tokens (B, T) -> hidden states before the final LayerNorm."""
        assert cache is None or isinstance(cache, LRNNCache)
        offset = 0
        if cache is not None and self._codes:  # the rows snap at the same symbols
            offset = int(cache.lengths[0])
            if bool((cache.lengths != offset).any()):
                raise ValueError("a model with state codes runs a cache's rows together only at one length")
        x: torch.Tensor = self.embedding(tokens)  # (B, T, d_model)
        for i, block in enumerate(self.blocks):
            state = None if cache is None else cache.states[i]
            x, final_state = block(x, state, offset)  # (B, T, d_model), (B, H, b)
            if cache is not None:
                cache.states[i] = final_state
        if cache is not None:
            cache.lengths = cache.lengths + tokens.shape[1]
        return x


class BlockDiagonalLRNN(LinearRNN):
    """:class:`LinearRNN` with :class:`BlockDiagonalRecurrence` layers."""

    config: LRNNConfig

    def __init__(self, config: LRNNConfig) -> None:
        kind = DeltaRecurrence if config.transition_norm == "delta" else BlockDiagonalRecurrence
        super().__init__(config, [kind(config) for _ in range(config.n_layers)])

    def grown_from(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict computing what ``weights`` (fewer blocks per layer) did."""
        return growth.grown_from(self, weights, GENERATED_SPREAD)
