"""RegularGPT (regulargpt.txt section 3): GPT-2 blocks with Sliding-Dilated-Attention, adaptive depth and
weight sharing.

Thick layer l (0-indexed) applies the ``thickness`` (K) distinct pre-norm GPT-2 blocks in order, all with
dilation C**l (C = chunk_size): position m attends to m - j * C**l for j in [C], plus a learnable scalar per
head and j (eq. 1). The same K blocks serve every thick layer, so the depth can grow past the training length.
There is no absolute position embedding; a final LayerNorm precedes the head.

Adaptive depth per prefix: the output at position m is read after D(m) = max(1, ceil(log_C(m + 1))) thick
layers, the fewest whose dilated receptive field reaches position 0. For the last position of a length-T
input this is the paper's ceil(log_C T). The parallel pass runs D(T - 1) thick layers over every position and
reads each position at its own depth, so the model is strictly causal: output i is the final output of the
prefix s[0..i], and decoding one token at a time gives the parallel pass's logits. At a layer l >= D(m) every
key of position m but its own is out of range (m - j * C**l < 0): masked, or the block's null key and value
(``config.out_of_range``). Either way position m is there a pointwise function of its own hidden state.

Three exact paths:

- ``forward``: every position, D(T - 1) thick layers over all T positions, O(T * C * K * log T);
- ``final_logits``: the shrinking path, O(T * C * K): thick layer l needs outputs only at the positions
  T-1, T-1-C**(l+1), ..., whose keys are the positions S_l = [..., T-1-C**l, T-1], layer l-1's outputs. In
  S_l the dilation is 1, and S_{l+1} is every C-th element of S_l counting from its end. Rows of a mixed-
  length batch are shifted to end at the same index (left padding masked through ``key_offset``), and each
  row is read after its own depth;
- ``forward(chunk, cache)`` and ``step`` (the chunk of one) through :class:`RegularGPTCache`
  (model/regulargpt_cache.py, with the plans below): each block keeps
  the keys and values of only the last (C-1) * C**l positions its dilated pattern can reach, in a ring buffer,
  plus each row's hidden states at its top thick layer, needed to grow its depth when it reaches C**L. A chunk
  of n new positions per row runs every thick layer over them at once, each layer's keys found as its plan
  says: a step (n = 1) gathers its J <= C keys from the ring (:class:`StepPlan`; every layer's indices from one
  computation); a short chunk gathers, for each new position t, the key t - j * C**l from the chunk itself if
  it is at or after the row's first new position, else from the ring, else it is out of range
  (:class:`ChunkPlan`, O(n * J * d) memory per block); a long one attends banded over the ring's last
  (J - 1) * C**l keys and the chunk (:class:`BandedPlan`, ``cached_attention_impl`` decides). Never T x T,
  never O(T) per position. Rows of one batch may hold different lengths and depths: every row runs through all
  of the batch's layers (above a row's own depth that is the pointwise continuation) and is read at its own
  D(t); a row first reaches the depth its chunk needs by running its consumed positions through the new layers.
  The cached path runs the blocks from their tensors (:class:`CachedBlock`): a decode step is ~15 small ops
  per block, and module calls would add a quarter to it. Served on the CPU (``for_serving``), a decode step of 1-4
  rows runs each thick layer as one compiled call (:meth:`RegularGPT._compiled_thick_layer`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from model.base import CallPath, Cost, SequenceModel, TokenEmbedding, check_lengths, lengths_tensor
from model.config import RegularGPTConfig
from model.layers import Block, HeadProjections, init_gpt2
from model.ops import cpu_decode
from model.ops.cpu_decode import linear
from model.ops.dilated_attention import (
    AUTO_REFERENCE_MAX_T,
    attend_banded,
    attend_gathered,
    attend_slots,
    banded_block,
    cached_attention_impl,
    dilated_attention,
    reachable_slots,
    resolve_impl,
)
from model.regulargpt_cache import (
    BandedPlan,
    KVWindow,
    Plan,
    RegularGPTCache,
    StepPlan,
    adaptive_depth,
    adaptive_depths,
    capacity,
    plan_chunk,
    resized,
    ring_columns,
)


class DilatedSelfAttention(nn.Module):
    """Multi-head Sliding-Dilated-Attention with per-head relative scalars r_j (eq. 1).

    With ``out_of_range="null"`` it also holds a learned null key and value per head (H, hd), which fill the
    slots whose key lies before position 0; with "mask" those slots are masked and there are no such parameters.
    """

    def __init__(self, config: RegularGPTConfig) -> None:
        super().__init__()
        self.heads = HeadProjections(config.d_model, config.n_heads, config.dropout)
        self.relative_bias = nn.Parameter(torch.zeros(config.n_heads, config.chunk_size))
        null_shape = (config.n_heads, config.d_model // config.n_heads)
        for name in ("null_key", "null_value"):  # N(0, 0.02) like the projections whose outputs they stand for
            null = nn.Parameter(torch.randn(null_shape) * 0.02) if config.out_of_range == "null" else None
            self.register_parameter(name, null)
        self.chunk_size = config.chunk_size
        self.impl = config.attention_impl

    def forward(self, x: torch.Tensor, dilation: int, key_offset: torch.Tensor | None = None) -> torch.Tensor:
        """The parallel pass: x (B, T, d_model) holds positions 0..T-1 -> (B, T, d_model), through ``self.impl``.
        (A cache's chunks go through :meth:`CachedBlock.attend`.)"""
        q, k, v = self.heads.qkv(x)  # (B, H, T, hd) each
        out = dilated_attention(
            q, k, v, self.relative_bias, self.chunk_size, dilation, key_offset,
            self.null_key, self.null_value, self.impl,
        )  # (B, H, T, hd)
        return self.heads.merge(out)


class CachedBlock(NamedTuple):
    """A Block as the cached path runs it, its parameters read from the modules once per call.

    The computation is the pre-norm Block's, x + attention(ln_1(x)) then x + mlp(ln_2(x)), written with those
    tensors: a decode step is a chain of small ops, and the modules' eleven __call__ and ~35 attribute lookups per
    block (an nn.Module attribute costs ~1 us here, six times a dict's) came to about a quarter of it. The
    tensors are read through the modules' own dicts (:func:`_children`), for the same reason.
    """

    ln_1: tuple[torch.Tensor, torch.Tensor]  # weight, bias
    c_attn: tuple[torch.Tensor, torch.Tensor]
    c_proj: tuple[torch.Tensor, torch.Tensor]
    ln_2: tuple[torch.Tensor, torch.Tensor]
    c_fc: tuple[torch.Tensor, torch.Tensor]
    mlp_proj: tuple[torch.Tensor, torch.Tensor]
    relative_bias: torch.Tensor  # (H, C)
    null_key: torch.Tensor | None  # (H, hd)
    null_value: torch.Tensor | None
    heads: int
    chunk_size: int
    eps: float
    dropout: float  # the residual branches' dropout probability when training, else 0

    @classmethod
    def of(cls, block: Block) -> CachedBlock:
        modules = _children(block)
        attention = _children(modules["attention"])
        heads, mlp = attention["heads"], _children(modules["mlp"])
        projections = _children(heads)
        ln_1, ln_2 = modules["ln_1"], modules["ln_2"]
        parameters = vars(modules["attention"])["_parameters"]
        return cls(
            _weight_bias(ln_1),
            _weight_bias(projections["c_attn"]),
            _weight_bias(projections["c_proj"]),
            _weight_bias(ln_2),
            _weight_bias(mlp["c_fc"]),
            _weight_bias(mlp["c_proj"]),
            parameters["relative_bias"],
            parameters["null_key"],
            parameters["null_value"],
            heads.n_heads,
            modules["attention"].chunk_size,
            ln_1.eps,
            mlp["dropout"].p if block.training else 0.0,
        )

    def tensors(self) -> list[torch.Tensor]:
        """The block's parameters in the order :func:`model.ops.cpu_decode.regulargpt_layer_step` packs them."""
        nulls = [] if self.null_key is None else [self.null_key, self.null_value]
        matrices = [*self.ln_1, *self.c_attn, *self.c_proj, *self.ln_2, *self.c_fc, *self.mlp_proj]
        return [*matrices, self.relative_bias, *nulls]

    def forward(self, x: torch.Tensor, dilation: int, window: KVWindow, plan: Plan) -> torch.Tensor:
        """x: (B, n, d) new positions -> (B, n, d), attending through ``window``, which then stores them."""
        shape = x.shape[-1:]
        qkv = linear(F.layer_norm(x, shape, *self.ln_1, self.eps), *self.c_attn)  # (B, n, 3 d)
        out = linear(self.attend(qkv, dilation, window, plan), *self.c_proj)  # (B, n, d)
        x = x + (F.dropout(out, self.dropout) if self.dropout else out)
        hidden = F.gelu(linear(F.layer_norm(x, shape, *self.ln_2, self.eps), *self.c_fc))  # (B, n, d_ff)
        out = linear(hidden, *self.mlp_proj)  # (B, n, d)
        return x + (F.dropout(out, self.dropout) if self.dropout else out)

    def attend(self, qkv: torch.Tensor, dilation: int, window: KVWindow, plan: Plan) -> torch.Tensor:
        """The chunk's attention through the window, heads merged: qkv (B, n, 3 d), q | k | v with heads in order
        (as HeadProjections.qkv splits it) -> (B, n, d); the window then stores the chunk's keys and values."""
        batch, length, width = qkv.shape
        heads, d_model = self.heads, width // 3
        if isinstance(plan, StepPlan):
            kv = qkv[:, 0, d_model:]  # (B, 2 d)
            keys, values = window.gather_step(plan, kv)  # (B, H, J, hd) each
            q = qkv[:, 0, :d_model].view(batch, heads, -1)  # (B, H, hd)
            out = attend_slots(q, keys, values, self.relative_bias, plan.valid, self.null_key, self.null_value)
            window.kv.view(-1, d_model // heads).index_copy_(0, plan.write_index, kv.reshape(-1, d_model // heads))
            return out.view(batch, 1, d_model)
        q = qkv[..., :d_model].view(batch, length, heads, -1).transpose(1, 2)  # (B, H, n, hd)
        kv = qkv[..., d_model:]  # (B, n, 2 d)
        if isinstance(plan, BandedPlan):
            keys, values = window.prefixed(plan, kv)  # (B, H, prefix + n, hd) each
            out = attend_banded(
                q, keys, values, self.relative_bias, self.chunk_size, dilation, plan.first_key,
                self.null_key, self.null_value,
            )
        else:
            keys, values = window.gather(plan, kv)  # (B, H, n, J, hd) each
            out = attend_gathered(q, keys, values, self.relative_bias, plan.valid, self.null_key, self.null_value)
        window.write(plan, kv)
        return out.transpose(1, 2).reshape(batch, length, d_model)


class PackedBlocks(NamedTuple):
    """The K blocks' parameters as views of one buffer, for the compiled decode step
    (:func:`model.ops.cpu_decode.regulargpt_layer_step` takes them as one array): made by ``for_serving``."""

    packed: np.ndarray  # the buffer, which every block parameter views (CachedBlock.tensors order, block by block)
    starts: np.ndarray  # (K, n + 1) int64: each block's tensors' starts in it, then the block's end
    pointers: tuple[int, ...]  # each parameter's data_ptr when packed: one that differs was replaced since
    has_null: bool

    def holds(self, blocks: list[CachedBlock]) -> bool:
        """Whether the blocks' parameters are still the packed views (``.to``, ``.half``, ``load_state_dict(...,
        assign=True)`` or an assignment to ``.data`` replace them; an in-place change keeps them)."""
        return self.pointers == tuple(tensor.data_ptr() for block in blocks for tensor in block.tensors())


def _children(module: nn.Module) -> dict[str, nn.Module]:
    """A module's submodules by name, read from its dict (no nn.Module.__getattr__)."""
    return vars(module)["_modules"]


def _weight_bias(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    parameters = vars(module)["_parameters"]
    return parameters["weight"], parameters["bias"]


class RegularGPT(SequenceModel):
    def __init__(self, config: RegularGPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = TokenEmbedding(config)
        self.blocks = nn.ModuleList(
            Block(config.d_model, config.d_ff, DilatedSelfAttention(config), config.layer_norm_eps, config.dropout)
            for _ in range(config.thickness)
        )
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        init_gpt2(self, n_residual_layers=config.thickness)  # scaled over the K distinct blocks
        self.packed: PackedBlocks | None = None  # set by for_serving where decode steps run compiled
        # Training only (set by the trainer, ``--extra-levels``): the parallel pass reads every position that many
        # thick layers above its depth D(m), i.e. after that many more pointwise continuations, as early positions'
        # states are when a long input uses them as keys many layers up. 0 everywhere else.
        self.extra_levels = 0

    def forward(self, tokens: torch.Tensor, cache: RegularGPTCache | None = None) -> torch.Tensor:
        """tokens: (B, T) -> (B, T, output_size).

        With ``cache``, the tokens continue each row's cached sequence, T new positions per row processed in
        parallel per layer (the chunk path, module docstring), and the cache advances by T.
        """
        if cache is not None:
            return self._forward_chunk(tokens, cache)
        chunk_size = self.config.chunk_size
        extra = self.extra_levels if self.training else 0
        x = self.embedding(tokens)  # (B, T, d)
        outputs = []
        for layer in range(adaptive_depth(tokens.shape[1] - 1, chunk_size) + extra):
            x = self._thick_layer(x, chunk_size**layer)  # (B, T, d)
            depth = layer - extra + 1  # read the positions with D(m) = depth
            if depth >= 1:
                first = 0 if depth == 1 else chunk_size ** (depth - 1)
                outputs.append(x[:, first : chunk_size**depth])
        return self._logits(torch.cat(outputs, dim=1))

    def final_logits(self, tokens: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """The shrinking path (module docstring). tokens: (B, T) right-padded; lengths: (B,) -> (B, output_size)."""
        batch, length = tokens.shape
        chunk_size = self.config.chunk_size
        if lengths is None:
            lengths = torch.full((batch,), length, dtype=torch.long)
        check_lengths(lengths, batch, length)
        key_offset = (length - lengths).to(tokens.device)  # (B,) left padding once each row ends at T - 1
        source = torch.arange(length, device=tokens.device) - key_offset[:, None]  # (B, T)
        x = self.embedding(tokens.gather(1, source.clamp(min=0)))  # (B, T, d) rows right-aligned
        depths = torch.tensor([adaptive_depth(n - 1, chunk_size) for n in lengths.tolist()], device=x.device)
        final = x[:, -1]  # (B, d) replaced at each row's depth
        for layer in range(int(depths.max())):
            x = self._thick_layer(x, dilation=1, key_offset=key_offset)  # (B, |S_l|, d)
            first = (x.shape[1] - 1) % chunk_size
            x = x[:, first::chunk_size]  # (B, |S_{l+1}|, d) the last element of each chunk
            key_offset = torch.div(key_offset - first + chunk_size - 1, chunk_size, rounding_mode="floor").clamp(min=0)
            final = torch.where((depths == layer + 1)[:, None], x[:, -1], final)  # (B, d)
        return self._logits(final)

    def new_cache(self, batch_size: int) -> RegularGPTCache:
        return RegularGPTCache(
            lengths=lengths_tensor(0, batch_size),
            chunk_size=self.config.chunk_size,
            top_hidden=self._zeros((batch_size, 0, self.config.d_model)),
        )

    def step(self, tokens: torch.Tensor, cache: RegularGPTCache) -> torch.Tensor:
        """tokens: (B,) -> (B, output_size): the chunk of one position per row, each read after its own D(t_b).

        Costs O(K * D * (J + d_model) * d_model) per row for the batch's depth D; a step that takes a row to
        t = C**L first runs the row's t consumed positions through the new thick layer, once.
        """
        return self.forward(tokens[:, None], cache)[:, 0]

    def for_serving(self) -> list[str]:
        """Switch to what scales and decodes fast; returns a note per change. The configuration and the checkpoint
        are left as they are.

        - The reference attention builds a T x T mask (18.7 GB at ~20k positions): it becomes "auto", which is the
          reference only up to AUTO_REFERENCE_MAX_T positions (where it is faster) and O(T) beyond. The cached path
          never uses either.
        - On the CPU, where one-token products run through MKL (not the streaming kernel of model/ops/cpu_decode.py,
          which reads weights as stored), a language model's tied head (vocab x d_model) is stored transposed in
          memory, shape and values unchanged, as the LRNN does (model/lrnn.py): a decode step's logits read it
          along its rows, 2x faster with MKL on one thread (0.094 against 0.177 ms for 8192 x 128 here); an
          embedding lookup reads one strided column instead of a row, which costs nothing measurable.
        - Where they run through that kernel instead (:func:`model.ops.cpu_decode.streams`: one intra-op thread),
          the head stays as stored and the K blocks' parameters become views of one buffer (:class:`PackedBlocks`),
          so that a decode step of 1-4 rows runs each thick layer as one compiled call (its ~15 small ops per block
          and the Python between them cost more than the arithmetic: docs/benchmarks.md, "CPU decode kernels").
        - Last, on the CPU, the products' weights are packed for oneDNN (:meth:`SequenceModel.for_serving`).
        """
        notes = []
        if any(block.attention.impl == "reference" for block in self.blocks):
            for block in self.blocks:
                block.attention.impl = "auto"
            notes.append(
                f"attention_impl reference -> auto (the T x T mask would not fit long inputs; the reference is kept "
                f"up to {AUTO_REFERENCE_MAX_T} positions)"
            )
        if self.device.type != "cpu":
            return notes
        if cpu_decode.streams(dtype=self.dtype):
            self._pack_blocks()
            notes.append(f"thick layers step as one compiled call each at {cpu_decode.rows_note()} (CPU)")
            return [*notes, *super().for_serving()]
        head = self.embedding.embed.weight  # (V, d): the tied head multiplies by its transpose
        wide = head.shape[0] > head.shape[1] and head.stride() != (1, head.shape[0])
        if self.config.is_language_model and wide:
            head.data = head.data.t().contiguous().t()  # (V, d) with (d, V) in memory
            notes.append("the tied head stored transposed for one-token products (CPU)")
        return [*notes, *super().for_serving()]

    def _pack_blocks(self) -> None:
        """Make the K blocks' parameters views of one buffer (:class:`PackedBlocks`): values, shapes and the
        checkpoint unchanged; the compiled decode step then takes one array for all of them."""
        blocks = [CachedBlock.of(block) for block in self.blocks]
        if self.packed is not None and self.packed.holds(blocks):
            return
        tensors = [tensor for block in blocks for tensor in block.tensors()]
        flat, starts = cpu_decode.pack(tensors)
        for tensor, start, end in zip(tensors, starts[:-1], starts[1:]):
            tensor.data = flat[start:end].view(tensor.shape)
        per_block = len(tensors) // len(blocks)
        self.packed = PackedBlocks(
            packed=flat.numpy(),
            starts=np.stack([starts[k * per_block : (k + 1) * per_block + 1] for k in range(len(blocks))]),
            pointers=tuple(tensor.data_ptr() for tensor in tensors),
            has_null=blocks[0].null_key is not None,
        )

    def cost(self, path: CallPath, rows: int, length: int, context: int = 0) -> Cost:
        """Multiply-adds and peak bytes (under no_grad, beyond the weights and the given cache) of one call.

        With d = d_model, f = d_ff, K blocks, C, V = output_size, e bytes per element, D(m) the adaptive depth,
        per position and block F = 4 d^2 + 2 d f (q, k, v and output projections, MLP) plus the attention: 2 J d
        over J gathered slots (+ d for the null scores), J_l = min(C, last_position // C**l + 1) at layer l; for
        the reference, 2 T d (the T x T scores and weighted sum); banded, 2 (J - 1 + P) d (a block's window). Per
        read position d V for the head.

        - "forward" (B, T): D(T - 1) layers over all T positions, attention by the impl chosen for T and J_l;
          bytes: activations B T ((12 + D) d + 2 f) e (the per-layer outputs stay alive until the final cat),
          logits B T (V + 2 d) e, and the attention's: reference 6 B H T^2 e + H T^2 e (mask, scores, softmax,
          null columns) + 4 B H T C e + 24 T C (the slots' null scores and indices), fast 3 B T J d e (gathered
          keys and values) + 6 B H T C e (scores), banded
          B e (2 T' d (padded copies of k and v) + 2 T' d (J - 1 + P) / P (their block windows) + 4 T' d (q and the
          output) + 3 H T' (J - 1 + P) (scores)) + 2 B T' (J - 1 + P) (masks), T' = T + P C**l.
        - "final" (B, T): the shrinking path, layer l over n_l positions (n_0 = T, n_{l+1} = (n_l - 1) // C + 1)
          at dilation 1, attention by the impl chosen for n_l; the bytes of its largest layer and the logits of
          the last positions.
        - "cached" (B, n, context c): D(c + n - 1) layers over the n new positions, attending gathered or banded
          (:func:`cached_attention_impl`) with J_l as above; plus, when the chunk needs a deeper layer than the rows
          hold (c >= 1 and D(c - 1) < D(c + n - 1)), each new layer over the c consumed positions with J = 1
          (every other key is out of range). Bytes: the cache's growth B (cache_nbytes(c + n) - cache_nbytes(c)),
          plus the largest of: the room's copy (one tensor at a time: 3 B capacity(c + n) d e, when the room or
          the depth changes), the depth growth's pass over c positions, the chunk's pass (activations, gathered:
          8 B n J d e keys, 6 B H n C e scores, 3 * 8 B n J index bytes; banded: as "forward" with the prefix
          of ring keys before the chunk copied twice more; logits B n (V + 2 d) e).
        """
        if path == "forward":
            layers = [length] * adaptive_depth(length - 1, self.config.chunk_size)
            dilations = [self.config.chunk_size**layer for layer in range(len(layers))]
            flops, nbytes = self._pass_cost(rows, layers, dilations, self._impl, kept=len(layers))
            return Cost(flops + rows * length * self._head_flops(), nbytes + self._logits_nbytes(rows, length))
        if path == "final":
            layers = [length]
            while len(layers) < adaptive_depth(length - 1, self.config.chunk_size):
                layers.append((layers[-1] - 1) // self.config.chunk_size + 1)
            flops, nbytes = self._pass_cost(rows, layers, [1] * len(layers), self._impl)
            return Cost(flops + rows * self._head_flops(), nbytes + self._logits_nbytes(rows, 1))
        if path != "cached":
            raise ValueError(f"unknown call path {path!r}")
        return self._cached_cost(rows, length, context)

    def cache_nbytes(self, length: int) -> int:
        """One row after ``length`` tokens: e d (P + 2 K sum_{l < D(length - 1)} C**l min(C - 1, ceil(P / C**l))),
        P = capacity(length): ``top_hidden``'s room and every block's keys and values at each layer, as allocated
        (``ring_columns``)."""
        if length == 0:
            return 0
        chunk_size, room = self.config.chunk_size, capacity(length)
        dilations = [chunk_size**layer for layer in range(adaptive_depth(length - 1, chunk_size))]
        slots = sum(dilation * ring_columns((chunk_size - 1) * dilation, dilation, room) for dilation in dilations)
        return (room + 2 * self.config.thickness * slots) * self.config.d_model * self.dtype.itemsize

    def _cached_cost(self, rows: int, length: int, context: int) -> Cost:
        """The "cached" path of :meth:`cost`."""
        chunk_size, d, item = self.config.chunk_size, self.config.d_model, self.dtype.itemsize
        last = context + length - 1
        depth = adaptive_depth(last, chunk_size)
        dilations = [chunk_size**layer for layer in range(depth)]
        flops, nbytes = self._pass_cost(rows, [length] * depth, dilations, "cached", last=last, context=context)
        flops += rows * length * self._head_flops()
        nbytes += self._logits_nbytes(rows, length)
        held = adaptive_depth(context - 1, chunk_size) if context else 0
        if context and held < depth:  # the consumed positions through each new layer, J = 1
            grow_flops, grow_nbytes = self._pass_cost(rows, [context] * (depth - held), dilations[held:], "cached")
            flops += grow_flops
            nbytes = max(nbytes, grow_nbytes + 2 * rows * context * d * item)
        if capacity(context + length) > capacity(context) or held < depth:  # one tensor's copy at a time
            nbytes = max(nbytes, 3 * rows * capacity(context + length) * d * item)
        growth = rows * (self.cache_nbytes(context + length) - self.cache_nbytes(context))
        return Cost(float(flops), int(nbytes + growth))

    def _pass_cost(
        self,
        rows: int,
        positions: list[int],
        dilations: list[int],
        impl: str,
        kept: int = 0,
        last: int | None = None,
        context: int = 0,
    ) -> tuple[float, int]:
        """Multiply-adds and peak bytes of thick layers l over ``positions[l]`` positions at ``dilations[l]``,
        with attention ``impl`` (an attention_impl, resolved per layer, or "cached": a cache's chunk after
        ``context`` positions, gathered or banded as :func:`cached_attention_impl` says), the last query at ``last``
        (default positions[l] - 1); ``kept`` layers' outputs stay alive. See :meth:`cost`."""
        config, item = self.config, self.dtype.itemsize
        d, heads, chunk_size = config.d_model, config.n_heads, config.chunk_size
        linear = 4 * d * d + 2 * d * config.d_ff + (d if config.out_of_range == "null" else 0)
        flops, peak = 0.0, 0
        for count, dilation in zip(positions, dilations):
            slots = reachable_slots(chunk_size, dilation, count - 1 if last is None else last)
            prefix = min(slots - 1, -(-context // dilation)) * dilation
            if impl == "cached":
                chosen = "gathered" if count == 1 else cached_attention_impl(count, slots, prefix)
            else:
                chosen, prefix = resolve_impl(impl, count, slots), 0
            if chosen == "reference":
                attention = 2 * count * d
                scratch = 6 * rows * heads * count * count * item + heads * count * count * item
                scratch += 4 * rows * heads * count * chunk_size * item + 3 * 8 * count * chunk_size  # the C slots
            elif chosen == "banded":
                class_rows = -(-count // dilation)  # queries per residue class
                block = banded_block(slots, class_rows)
                window, padded = slots - 1 + block, count + block * dilation  # W + P keys per query
                # the queries of each class padded to whole blocks also get scores (and null scores)
                padding = -(-class_rows // block) * block * dilation / count
                attention = 2 * window * d * padding + (padding - 1) * (d if config.out_of_range == "null" else 0)
                copies = (4 if impl == "cached" else 2) * (prefix + padded) * d + 2 * padded * d * window // block
                scratch = rows * item * (copies + 4 * padded * d + 3 * heads * padded * window)
                scratch += rows * padded * window * 2 + 8 * (padded // block + 2 * block + 4) * window  # masks, indices
                scratch += heads * block * window * item  # the band's bias
            else:  # gathered keys and values: the fast op's stacked pair (and a copy), or the cache's chunk,
                attention = 2 * slots * d
                gathered = 3 if chosen == "fast" else 8  # window and selected pairs (and the products' copies)
                scratch = gathered * rows * count * slots * d * item + 6 * rows * heads * count * chunk_size * item
                scratch += 3 * 8 * rows * count * slots
            flops += rows * count * config.thickness * (linear + attention)
            activations = rows * count * ((12 + kept) * d + 2 * config.d_ff) * item
            peak = max(peak, activations + scratch)
        return flops, peak

    @property
    def _impl(self) -> str:
        """The parallel passes' attention implementation, as configured or switched by :meth:`for_serving`."""
        return self.blocks[0].attention.impl

    def _head_flops(self) -> int:
        return self.config.d_model * self.config.output_size

    def _logits_nbytes(self, rows: int, positions: int) -> int:
        return rows * positions * (self.config.output_size + 2 * self.config.d_model) * self.dtype.itemsize

    def _forward_chunk(self, tokens: torch.Tensor, cache: RegularGPTCache) -> torch.Tensor:
        """tokens: (B, n) continuing each row of ``cache`` -> (B, n, output_size); advances the cache by n.

        Every row first reaches the depth its last new position needs (:meth:`_reserve`), then all the batch's
        thick layers run over the n positions of every row; position t's output is read at its own D(t), and row
        b's hidden states after its own top layer go to ``top_hidden``.
        """
        if tokens.shape[1] == 0:
            return self._logits(self.embedding(tokens))
        chunk_size, length, start = self.config.chunk_size, tokens.shape[1], cache.lengths
        blocks = [CachedBlock.of(block) for block in self.blocks]
        first_depths = self._reserve(cache, length, blocks)  # each row's depth at its first new position
        mixed = min(first_depths) < cache.depth  # some outputs are read below the top layer
        positions = start.to(tokens.device)[:, None] + torch.arange(length, device=tokens.device)  # (B, n)
        if mixed:  # (B, n) nondecreasing along n, from the lengths on the CPU (no device sync)
            position_depths = adaptive_depths(start[:, None] + torch.arange(length), chunk_size).to(tokens.device)
        x = self.embedding(tokens)  # (B, n, d)
        out = top = x
        compiled = length == 1 and self._compiles_step(x, blocks)
        if compiled:  # each layer finds its ring entries itself (no plan)
            step_positions = start.numpy()
            latest = int(step_positions.max())
        else:
            allocated = [windows[0].kv.shape[2] for windows in cache.windows]
            plans = plan_chunk(start, length, chunk_size, self.config.n_heads, allocated, tokens.device)
        for layer, windows in enumerate(cache.windows):
            if compiled:
                x = self._compiled_thick_layer(x, layer, windows, step_positions, latest)  # (B, 1, d)
            else:
                x = self._cached_thick_layer(x, chunk_size**layer, windows, plans[layer], blocks)  # (B, n, d)
            if mixed:
                out = torch.where(position_depths[..., None] == layer + 1, x, out)  # (B, n, d)
                top = torch.where(position_depths[:, -1:, None] == layer + 1, x, top)  # each row's own top layer
        if not mixed:
            out = top = x
        room = cache.top_hidden.shape[1]
        flat = positions + room * torch.arange(cache.batch_size, device=tokens.device)[:, None]  # (B, n)
        cache.top_hidden.view(-1, top.shape[-1]).index_copy_(0, flat.flatten(), top.reshape(-1, top.shape[-1]))
        cache.lengths = start + length
        return self._logits(out)

    def _reserve(self, cache: RegularGPTCache, length: int, blocks: list[CachedBlock]) -> list[int]:
        """Make room for ``length`` more tokens per row, add the thick layers the batch will need and bring every
        row to the depth its last new position needs: row b at depth D_b < D(t_b + n - 1) runs its t_b consumed
        positions (``top_hidden``) through layers D_b, D_b + 1, ...; there every key but a position's own is out of
        range (t_b <= C**D_b), so this is the parallel pass's pointwise continuation, and it fills the row's
        windows at those layers. Rows that reach a layer together run it as one chunk of context 0. Returns each
        row's D(t_b), the depth of its first new position."""
        chunk_size, heads, lengths = self.config.chunk_size, self.config.n_heads, cache.lengths.tolist()
        old = [adaptive_depth(t - 1, chunk_size) if t else 0 for t in lengths]
        first = [adaptive_depth(t, chunk_size) for t in lengths]
        new = first if length == 1 else [adaptive_depth(t + length - 1, chunk_size) for t in lengths]
        room = capacity(max(lengths) + length)
        if room != cache.top_hidden.shape[1]:
            cache.top_hidden = resized(cache.top_hidden, 1, room)
            for layer in cache.windows:  # one at a time: the old tensor goes before the next is copied
                for k, window in enumerate(layer):
                    layer[k] = window.fit(room)
        while cache.depth < max(new):
            cache.windows.append(self._new_layer(cache.batch_size, cache.depth, room))
        for layer in range(1, cache.depth):
            rows = [row for row, (held, needed) in enumerate(zip(old, new)) if 1 <= held <= layer < needed]
            if not rows:
                continue
            # Together, or where batch invariance is asked for (cpu_decode.row_invariant) each row as it runs alone:
            # rows run together came out other in the last bits (text-regulargpt, 2 rows reaching layer 1 at t = 64).
            for group in [[row] for row in rows] if cpu_decode.row_invariant() else [rows]:
                consumed = max(lengths[row] for row in group)
                index = torch.tensor(group, device=cache.top_hidden.device)  # (R,)
                allocated = [cache.windows[layer][0].kv.shape[2]]
                start = torch.zeros(len(group), dtype=torch.long)  # the consumed positions as one chunk
                (plan,) = plan_chunk(start, consumed, chunk_size, heads, allocated, index.device, index, layer)
                hidden = cache.top_hidden[index, :consumed]  # (R, t, d) after layer - 1; garbage past each t_b
                cache.top_hidden[index, :consumed] = self._cached_thick_layer(
                    hidden, chunk_size**layer, cache.windows[layer], plan, blocks
                )
        return first

    def _new_layer(self, batch_size: int, layer: int, room: int) -> list[KVWindow]:
        """Empty windows of thick layer ``layer``'s K blocks, with room for ``room`` positions."""
        dilation = self.config.chunk_size**layer
        ring = (self.config.chunk_size - 1) * dilation
        heads = self.config.n_heads
        shape = (batch_size, 2 * heads, dilation * ring_columns(ring, dilation, room), self.config.d_model // heads)
        return [KVWindow(ring, dilation, self._zeros(shape)) for _ in self.blocks]

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape, device=self.device, dtype=self.dtype)

    def _thick_layer(self, x: torch.Tensor, dilation: int, key_offset: torch.Tensor | None = None) -> torch.Tensor:
        """The K blocks in order, all at ``dilation``, over positions 0..T-1. x: (B, T, d) -> (B, T, d)."""
        for block in self.blocks:
            x = block(x, dilation=dilation, key_offset=key_offset)
        return x

    def _cached_thick_layer(
        self, x: torch.Tensor, dilation: int, windows: list[KVWindow], plan: Plan, blocks: list[CachedBlock]
    ) -> torch.Tensor:
        """The K blocks over a chunk of new positions, attending through their windows. x: (B, n, d) -> (B, n, d)."""
        for block, window in zip(blocks, windows):
            x = block.forward(x, dilation, window, plan)
        return x

    def _compiles_step(self, x: torch.Tensor, blocks: list[CachedBlock]) -> bool:
        """Whether a decode step over x (B, 1, d) runs each thick layer as one compiled call: packed blocks
        (``for_serving``) still in place, no dropout, and :func:`model.ops.cpu_decode.compiles_step`."""
        packed = self.packed
        return (
            packed is not None and not blocks[0].dropout and cpu_decode.compiles_step(x) and packed.holds(blocks)
        )

    def _compiled_thick_layer(
        self, x: torch.Tensor, layer: int, windows: list[KVWindow], positions: np.ndarray, latest: int
    ) -> torch.Tensor:
        """Thick layer ``layer``'s K blocks over one new position per row (``positions``: (B,) int64, the largest
        ``latest``), as one compiled call (equal to :meth:`_cached_thick_layer` with the step's plan up to float
        rounding). x: (B, 1, d) -> (B, 1, d)."""
        batch, _, width = x.shape
        packed, chunk_size = self.packed, self.config.chunk_size
        dilation = chunk_size**layer
        out = cpu_decode.regulargpt_layer_step(
            x.view(batch, width), tuple(window.entries for window in windows), positions, dilation, windows[0].ring,
            reachable_slots(chunk_size, dilation, latest), packed.packed, packed.starts,
            packed.has_null, self.config.n_heads, self.config.layer_norm_eps,
        )
        return out.view(batch, 1, width)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: (..., d) -> (..., output_size)."""
        return self.embedding.logits(self.ln_f(hidden))
