"""Compile a DFA or Moore machine into exact transducer weights (block-diagonal LRNN or RegularGPT) that output the
machine's label after every prefix, at any length. The construction and its notation (n states, V symbols, M_s,
q0): docs/models.md, "Compiled automata".
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from automata.automaton import DFA, MooreMachine
from automata.task_automata import task_machines
from model.base import SequenceModel
from model.config import CheckpointConfig, LRNNConfig, RegularGPTConfig
from model.lrnn.model import BlockDiagonalLRNN
from model.regulargpt.model import RegularGPT

LABELS = ("0", "1")  # a DFA's labels; label index 1 = accepted
LABEL_MARGIN = 20.0
"""Logit of the right label minus the wrong one: softmax gives it probability 1 - 2e-9."""

EMBEDDING_SCALE = 2.0**12
"""LRNN embedding norm per entry: c**2 = 2**24, against which LayerNorm's eps = 1e-5 rounds away in float32."""

ATTENTION_BIAS = 30.0
"""RegularGPT relative bias R: the unwanted slot gets softmax weight exp(-2R) ~ 1e-26."""

GELU_SHARPNESS = 100.0
"""lambda: GELU(lambda z) / lambda = relu(z) in float32 for |z| >= 0.25, since Phi(-25) underflows."""

PRODUCT_THRESHOLDS = (1.25, 1.75)
"""g(s) = 2 relu(s - 1.25) - 2 relu(s - 1.75): 0 for s <= 1.25, 1 for s >= 1.75."""

MAX_REGULARGPT_STATES = 16
"""RegularGPT's construction over function matrices grows as n**5 weights; the LRNN's takes any DFA
(automata.automaton.MAX_STATES)."""

MAX_REGULARGPT_MONOID = 128
"""Above MAX_REGULARGPT_STATES, RegularGPT's construction over the transition monoid's elements (8 m**3 weights for
m elements: 67 MB at 128; a group's Cayley table, S5's 120 elements) when the monoid has at most this many."""


Automaton = DFA | MooreMachine


class CompileError(ValueError):
    """A valid DFA that a construction cannot take; the message says why."""


class CompileTooLarge(CompileError):
    """A valid DFA past a construction's size cap (RegularGPT's), named in the message."""


def labels_of(automaton: Automaton) -> tuple[str, ...]:
    """The label ids of a compiled automaton: ("0", "1") for a DFA, a Moore machine's outputs sorted."""
    return LABELS if isinstance(automaton, DFA) else tuple(sorted(set(automaton.output.values())))


def compile_lrnn(automaton: Automaton) -> tuple[BlockDiagonalLRNN, CheckpointConfig]:
    """The one-layer block-diagonal LRNN of docs/models.md, "Compiled automata", float32, in eval mode."""
    machine, labels = _machine(automaton), labels_of(automaton)
    n, vocab = len(machine.states), len(machine.alphabet)
    binary = labels == LABELS
    label_rows = 1 if binary else len(labels)
    d_model = max(8, _next_power_of_two(vocab + 1 + label_rows))  # Hadamard rows 1..V: symbols; then the labels'
    config = LRNNConfig(
        vocab_size=vocab,
        num_labels=len(labels),
        d_model=d_model,
        n_layers=1,
        block_size=n + 1,
        num_blocks=1,
        d_ff=1,
    )
    hadamard = _hadamard(d_model)  # (d, d)
    symbol_rows = hadamard[1 : vocab + 1]  # (V, d)
    readout_rows = hadamard[vocab + 1 : vocab + 1 + label_rows]  # (label_rows, d)
    codes = np.concatenate([-readout_rows, readout_rows]) if binary else readout_rows  # (K, d): label k's code
    matrices = machine.transition_matrices().astype(np.float64)  # (V, n, n)
    start = machine.states.index(machine.start)
    transitions = np.zeros((vocab, n + 1, n + 1))  # (V, n + 1, n + 1): A_s
    inputs = np.zeros((vocab, n + 1))  # (V, n + 1): B u_s
    for s in range(vocab):
        first = matrices[s][:, start]  # (n,) e_r, r = delta(q0, s)
        transitions[s, :n, :n] = matrices[s]
        transitions[s, :n, n] = -first
        inputs[s, :n], inputs[s, n] = first, 1.0
    label_index = {label: k for k, label in enumerate(labels)}
    readout = np.zeros((d_model, n + 1))  # (d, n + 1): c * the code of each state's label, 0 for the flag
    readout[:, :n] = EMBEDDING_SCALE * codes[[label_index[machine.output[state]] for state in machine.states]].T
    # ln_f(x) = (H_s + code) / sqrt(2): code_k . ln_f(x) = d / sqrt(2) for the state's label, and for the others
    # -d / sqrt(2) (binary: the negated code) or 0 (orthogonal rows), so the margin is 2 or 1 times gain d / sqrt(2)
    head_gain = LABEL_MARGIN / (2 if binary else 1) * math.sqrt(2) / d_model
    weights = {
        "embedding.embed.weight": EMBEDDING_SCALE * symbol_rows,
        "embedding.label_head.weight": head_gain * codes,
        "embedding.label_head.bias": np.zeros(len(labels)),
        **_layer_norm("blocks.0.ln_1", d_model),
        "blocks.0.recurrence.transition.weight": transitions.reshape(vocab, -1).T @ symbol_rows / d_model,
        "blocks.0.recurrence.transition.bias": np.zeros((n + 1) ** 2),
        "blocks.0.recurrence.input_proj.weight": inputs.T @ symbol_rows / d_model,
        "blocks.0.recurrence.input_proj.bias": np.zeros(n + 1),
        "blocks.0.recurrence.out_proj.weight": readout,
        "blocks.0.recurrence.out_proj.bias": np.zeros(d_model),
        **_layer_norm("blocks.0.ln_2", d_model),
        **_mlp("blocks.0.mlp", np.zeros((1, d_model)), np.zeros(1), np.zeros((d_model, 1))),
        **_layer_norm("ln_f", d_model),
    }
    return _assemble(BlockDiagonalLRNN(config), weights), checkpoint_config(automaton, "lrnn", config)


def compile_regulargpt(automaton: Automaton) -> tuple[RegularGPT, CheckpointConfig]:
    """The C = 2, K = 1 RegularGPT with null slots of docs/models.md, "Compiled automata", float32, in eval mode: its
    stream holds each segment's transition function, as an n x n 0/1 matrix up to MAX_REGULARGPT_STATES states, else
    as a one-hot over the transition monoid if it has at most MAX_REGULARGPT_MONOID elements. Raises CompileTooLarge
    past both caps."""
    machine, labels = _machine(automaton), labels_of(automaton)
    n = len(machine.states)
    encoding = _matrix_encoding(machine) if n <= MAX_REGULARGPT_STATES else _monoid_encoding(machine)
    if encoding is None:
        raise CompileTooLarge(
            f"{machine.name}: {n} states and a transition monoid of more than {MAX_REGULARGPT_MONOID} elements; the "
            f"RegularGPT construction takes at most MAX_REGULARGPT_STATES = {MAX_REGULARGPT_STATES} states (its size "
            f"grows as n**5) or a monoid of at most MAX_REGULARGPT_MONOID = {MAX_REGULARGPT_MONOID} elements; "
            "compile it as an LRNN (architecture lrnn, --arch lrnn)"
        )
    width, d_model = encoding.width, 2 * encoding.width  # the residual stream: X = channels [0, width), O = the rest
    product_units = len(PRODUCT_THRESHOLDS) * len(encoding.products)
    config = RegularGPTConfig(
        vocab_size=len(machine.alphabet),
        num_labels=len(labels),
        d_model=d_model,
        n_heads=1,
        d_ff=product_units + 2 * d_model,
        chunk_size=2,
        thickness=1,
        out_of_range="null",
    )
    eps = config.layer_norm_eps
    attention_stats = _stream_stats(encoding.ones, d_model, blocks_in_use=1, eps=eps)  # [X, 0]: ln_1 and ln_f
    mlp_stats = _stream_stats(encoding.ones, d_model, blocks_in_use=2, eps=eps)  # [X, O]: ln_2
    qkv = np.zeros((3 * d_model, d_model))  # q = k = 0; v = [X, 0] (head dim = d_model)
    qkv[2 * d_model : 2 * d_model + width, :width] = np.eye(width)
    into_other = np.zeros((d_model, d_model))  # c_proj: the attended X into O
    into_other[width:, :width] = np.eye(width)
    null_value = np.zeros((1, d_model))
    null_value[0, :width] = encoding.identity
    labelled = np.zeros(
        (len(labels), d_model)
    )  # (K, d): the channels of X whose function takes q0 to a state labelled k
    for channel, state in enumerate(encoding.start_images):
        if state is not None:
            labelled[labels.index(machine.output[state]), channel] = 1.0
    if labels == LABELS:  # "1" scores M (the X channels taking q0 to an accepting state) - M / 2, "0" the negation
        head = _label_head(LABEL_MARGIN * labelled[1], -LABEL_MARGIN / 2)
    else:  # label k scores M (the X channels taking q0 to a state labelled k): M for one label, 0 for the others
        head = {
            "embedding.label_head.weight": LABEL_MARGIN * labelled,
            "embedding.label_head.bias": np.zeros(len(labels)),
        }
    weights = {
        "embedding.embed.weight": np.concatenate([encoding.symbols, np.zeros_like(encoding.symbols)], axis=1),
        **head,
        **_layer_norm("blocks.0.ln_1", d_model, *attention_stats),
        "blocks.0.attention.heads.c_attn.weight": qkv,
        "blocks.0.attention.heads.c_attn.bias": np.zeros(3 * d_model),
        "blocks.0.attention.heads.c_proj.weight": into_other,
        "blocks.0.attention.heads.c_proj.bias": np.zeros(d_model),
        "blocks.0.attention.relative_bias": np.array([[-ATTENTION_BIAS, ATTENTION_BIAS]]),
        "blocks.0.attention.null_key": np.zeros((1, d_model)),
        "blocks.0.attention.null_value": null_value,
        **_layer_norm("blocks.0.ln_2", d_model, *mlp_stats),
        **_mlp("blocks.0.mlp", *_composition_mlp(encoding.products, width)),
        **_layer_norm("ln_f", d_model, *attention_stats),
    }
    return _assemble(RegularGPT(config), weights), checkpoint_config(automaton, "regulargpt", config)


@dataclass(frozen=True)
class FunctionEncoding:
    """How RegularGPT's stream holds a segment's transition function f (the states' images after reading it):
    ``width`` channels with ``ones`` of them 1; ``symbols`` (V, width) each symbol's f, ``identity`` (width,) the
    empty segment's; ``products`` (x, o, out): channel x of the later segment's f and channel o of the earlier one's
    set channel out of their composition; ``start_images``: for each channel, the state that an f holding it takes
    the start state to (None: it says nothing of the start)."""

    width: int
    ones: int
    symbols: np.ndarray
    identity: np.ndarray
    products: list[tuple[int, int, int]]
    start_images: list[str | None]


def _matrix_encoding(machine: MooreMachine) -> FunctionEncoding:
    """f as its n x n 0/1 matrix, channel i n + j = [f(state j) = state i]: n**3 products."""
    n, start = len(machine.states), machine.states.index(machine.start)
    products = [(i * n + j, j * n + k, i * n + k) for i in range(n) for j in range(n) for k in range(n)]
    images: list[str | None] = [None] * (n * n)
    for i, state in enumerate(machine.states):
        images[i * n + start] = state
    return FunctionEncoding(
        n * n,
        n,
        machine.transition_matrices().reshape(len(machine.alphabet), n * n),
        np.eye(n).flatten(),
        products,
        images,
    )


def _monoid_encoding(machine: MooreMachine) -> FunctionEncoding | None:
    """f as a one-hot over the transition monoid's elements (the functions of all strings, the identity first): m**2
    products, the monoid's table. None when the monoid has more than MAX_REGULARGPT_MONOID elements."""
    index = {state: i for i, state in enumerate(machine.states)}
    generators = [tuple(index[machine.delta[state][symbol]] for state in machine.states) for symbol in machine.alphabet]
    identity = tuple(range(len(machine.states)))
    elements, position = [identity], {identity: 0}
    for element in elements:  # grows while read: every string's function, by appending symbols
        for generator in generators:
            following = tuple(generator[image] for image in element)  # the element, then the symbol
            if following not in position:
                if len(elements) == MAX_REGULARGPT_MONOID:
                    return None
                position[following] = len(elements)
                elements.append(following)
    m = len(elements)
    products = [
        (x, o, position[tuple(elements[x][image] for image in elements[o])]) for x in range(m) for o in range(m)
    ]
    one_hot = np.eye(m)
    start = index[machine.start]
    return FunctionEncoding(
        m,
        1,
        one_hot[[position[generator] for generator in generators]],
        one_hot[0],
        products,
        [machine.states[element[start]] for element in elements],
    )


COMPILERS: dict[str, Callable[[Automaton], tuple[SequenceModel, CheckpointConfig]]] = {
    "lrnn": compile_lrnn,
    "regulargpt": compile_regulargpt,
}


def checkpoint_config(
    automaton: Automaton, architecture: str, model_config: LRNNConfig | RegularGPTConfig
) -> CheckpointConfig:
    """A transducer config with :func:`labels_of` the automaton, naming the task only if the automaton computes it;
    metadata records the "dfa" or "moore_machine" compiled."""
    source = {"dfa": automaton.to_json()} if isinstance(automaton, DFA) else {"moore_machine": automaton.to_json()}
    return CheckpointConfig(
        architecture=architecture,
        model=model_config,
        kind="transduce",
        task=task_of(automaton),
        alphabet=automaton.alphabet,
        labels=labels_of(automaton),
        metadata={"compiled": True, "compiler": "automata.compiler", **source},
    )


def task_of(automaton: Automaton) -> str | None:
    """The automaton's name if a regular task (docs/api.md, Tasks) has that name, the same alphabet in the same
    order and the same labels after every non-empty prefix; None otherwise."""
    machine = _machine(automaton)
    task = task_machines().get(machine.name)
    if task is None or task.alphabet != machine.alphabet:
        return None
    return machine.name if same_transduction(task, machine) else None


def same_transduction(first: MooreMachine, second: MooreMachine) -> bool:
    """Whether the machines (same alphabet) output the same label after every non-empty prefix."""
    pending = [(first.start, second.start)]
    seen = set(pending)
    while pending:
        pair = pending.pop()
        for symbol in first.alphabet:
            successor = (first.delta[pair[0]][symbol], second.delta[pair[1]][symbol])
            if first.output[successor[0]] != second.output[successor[1]]:
                return False
            if successor not in seen:
                seen.add(successor)
                pending.append(successor)
    return True


def _machine(automaton: Automaton) -> MooreMachine:
    return automaton.machine if isinstance(automaton, DFA) else automaton


def _composition_mlp(products: list[tuple[int, int, int]], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """c_fc weight (d_ff, 2 width), c_fc bias (d_ff,), c_proj weight (2 width, d_ff) of the composing MLP: two units
    per product (x, o, out), firing when X[x] and O[o] are both 1 and writing 1 into the new X[out], then a +x and a
    -x pass-through unit per channel."""
    d_model, units = 2 * width, len(PRODUCT_THRESHOLDS) * len(products)
    fc = np.zeros((units + 2 * d_model, d_model))
    fc_bias = np.zeros(units + 2 * d_model)
    proj = np.zeros((d_model, units + 2 * d_model))
    unit = 0
    for x, o, out in products:
        for threshold, slope in zip(PRODUCT_THRESHOLDS, (2.0, -2.0)):  # g = 2 relu(. - 1.25) - 2 relu(. - 1.75)
            fc[unit, x] = fc[unit, width + o] = GELU_SHARPNESS  # X[x] + O[o]
            fc_bias[unit] = -GELU_SHARPNESS * threshold
            proj[out, unit] = slope / GELU_SHARPNESS  # into the new X[out]
            unit += 1
    channels = np.arange(d_model)
    fc[units + channels, channels] = GELU_SHARPNESS  # GELU(lambda x) - GELU(-lambda x) = lambda x
    fc[units + d_model + channels, channels] = -GELU_SHARPNESS
    proj[channels, units + channels] = -1.0 / GELU_SHARPNESS  # ... written back as -x: X -> new - X, O -> -O
    proj[channels, units + d_model + channels] = 1.0 / GELU_SHARPNESS
    return fc, fc_bias, proj


def _stream_stats(ones: int, d_model: int, blocks_in_use: int, eps: float) -> tuple[float, float]:
    """(sqrt(variance + eps), mean) of a residual stream holding ``blocks_in_use`` encoded functions (``ones`` ones
    each) in d_model channels: LayerNorm weight and bias that undo the normalisation."""
    mean = blocks_in_use * ones / d_model
    return math.sqrt(mean - mean**2 + eps), mean


def _label_head(direction: np.ndarray, bias: float) -> dict[str, np.ndarray]:
    """Label "1" scores direction . h + bias, label "0" the negation."""
    return {
        "embedding.label_head.weight": np.stack([-direction, direction]),
        "embedding.label_head.bias": np.array([-bias, bias]),
    }


def _layer_norm(prefix: str, d_model: int, scale: float = 1.0, shift: float = 0.0) -> dict[str, np.ndarray]:
    return {f"{prefix}.weight": np.full(d_model, scale), f"{prefix}.bias": np.full(d_model, shift)}


def _mlp(prefix: str, fc: np.ndarray, fc_bias: np.ndarray, proj: np.ndarray) -> dict[str, np.ndarray]:
    return {
        f"{prefix}.c_fc.weight": fc,
        f"{prefix}.c_fc.bias": fc_bias,
        f"{prefix}.c_proj.weight": proj,
        f"{prefix}.c_proj.bias": np.zeros(proj.shape[0]),
    }


Model = TypeVar("Model", bound=SequenceModel)


def _assemble(model: Model, weights: dict[str, np.ndarray]) -> Model:
    """Load every tensor of the model from ``weights`` (strict: none left at its random init), as float32."""
    model.load_state_dict({name: torch.tensor(value, dtype=torch.float32) for name, value in weights.items()})
    return model.eval()


def _hadamard(size: int) -> np.ndarray:
    """The Sylvester-Hadamard matrix of a power-of-two size: entries +-1, orthogonal rows, row 0 all ones."""
    matrix = np.ones((1, 1))
    while matrix.shape[0] < size:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix


def _next_power_of_two(value: int) -> int:
    return 1 << (value - 1).bit_length()
