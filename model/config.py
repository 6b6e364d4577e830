"""Typed, frozen model configurations.

Every architecture has one frozen dataclass of hyper-parameters. A checkpoint's ``config.json`` holds a
:class:`CheckpointConfig`: the architecture's name, its hyper-parameters under ``"model"``, and what the
model reads and writes (task, alphabet, labels or tokenizer). Loading refuses unknown and missing keys and
values of the wrong type, with a message that names them.

Format versions: a file of the current ``FORMAT_VERSION`` (4) holds every key, and loading refuses one that lacks
any, defaults or not: a key a file leaves out would otherwise load as whatever this build's default is, which can
change the model. Version 1 let a file leave out keys that had defaults; :func:`migrate_config` reads such a file
as the build that wrote it did (the values in ``_V1_DEFAULTS``, spelled out so that a later change of a default
cannot change what an old file means). A key added later gets, in a file older than it, the value that file meant
(``_ADDED_KEYS``; version 3 added ``LRNNConfig.transition_rank``, version 4 ``RegularGPTConfig.block_norm``).
``python -m training upgrade DIR`` rewrites old files.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

FORMAT_VERSION = 4


class ConfigError(ValueError):
    """A configuration (or config.json) that cannot describe a model; the message says why."""


@dataclass(frozen=True, kw_only=True)
class BaseModelConfig:
    """Hyper-parameters shared by every architecture.

    ``vocab_size`` is the number of input symbols or tokens. ``num_labels`` is the size of the per-position
    label head of a transducer; 0 makes the model a token language model whose head is tied to the embedding.
    """

    vocab_size: int
    num_labels: int = 0
    d_model: int = 64
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _check_literals(self)
        _check_positive(self, "vocab_size", "d_model")
        if self.num_labels < 0:
            raise ConfigError(f"num_labels must be >= 0, got {self.num_labels}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def output_size(self) -> int:
        """Width of the logits: the label count for a transducer, the vocabulary for a language model."""
        return self.num_labels or self.vocab_size

    @property
    def is_language_model(self) -> bool:
        return self.num_labels == 0


@dataclass(frozen=True, kw_only=True)
class RegularGPTConfig(BaseModelConfig):
    """RegularGPT (regulargpt.txt section 3): GPT-2 blocks with Sliding-Dilated-Attention.

    Layer ``l`` lets position m attend to m - j * chunk_size**l for j in [chunk_size]. The depth is
    ceil(log_chunk_size(m + 1)) thickened layers for the prefix ending at m (at least one), and the
    ``thickness`` distinct sub-layers are reused at every depth.

    ``attention_impl``: "reference" builds the T x T mask; "fast" gathers the chunk_size dilated keys per
    position; "auto" is the reference up to 64 positions and "fast" beyond (model/ops/dilated_attention.py).

    ``out_of_range``: what a slot j whose key m - j * C**l lies before position 0 holds. "null" (default) fills
    it with a learned null key and value per block and head (scored with the slot's r_j like any key), as if
    the input were left-padded with a null token (regulargpt.txt footnote 1): a layer can then tell "no
    partner" (the identity of the composition) from "a partner equal to me". "mask" drops the slot, so the query
    attends over fewer keys and those two cases look the same: trained on parity_check, a "mask" model did not
    get past chance in 1500 steps where a "null" one was at 100% on lengths 41-500 by step 250 (2026-11).

    ``block_norm``: where each block's two LayerNorms sit. "pre" (default, GPT-2's): x + f(LN(x)), so the
    residual stream sums one update per thick layer and is normalised only where it is read. "post" (the
    authors' code, and the original Transformer's): LN(x + f(x)), so every thick layer maps a normalised state to
    a normalised state, and the shared layer is one map iterated as often as the input's depth needs.
    """

    n_heads: int = 4
    d_ff: int = 256
    chunk_size: int = 2
    thickness: int = 1
    attention_impl: Literal["auto", "reference", "fast"] = "auto"
    out_of_range: Literal["mask", "null"] = "null"
    block_norm: Literal["pre", "post"] = "pre"
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "n_heads", "d_ff", "thickness")
        _check_heads(self.d_model, self.n_heads)
        if self.chunk_size < 2:
            raise ConfigError(f"chunk_size must be >= 2, got {self.chunk_size}")


@dataclass(frozen=True, kw_only=True)
class LRNNConfig(BaseModelConfig):
    """Block-diagonal input-dependent linear RNN (block-diagonal-lrnn.txt sections 3.3-3.4).

    Each layer runs x_k = A(u_k) x_{k-1} + B u_k with A block-diagonal (``num_blocks`` blocks of
    ``block_size`` x ``block_size``) and y_k = h(x_k). ``transition_norm`` constrains A: "column" (the paper's
    eq. 6) scales every column by 1 / max(1, ||column||_p) with p = ``p_norm``; "spectral" (ours) does that, then
    scales every block by 1 / max(1, ||block||_2), which keeps every product of transitions non-expanding at any
    length. For p > 1 the column clamp alone lets a block's spectral radius reach b^(1 - 1/p) (1.41 for b = 8,
    p = 1.2; docs/results.md measures what that does past the training length); for p = 1 it is stable but
    cannot represent a rotation by 72 degrees (Z_5). With p = 2 and b = 2, "spectral" keeps exactly the
    rotations and reflections (unit orthogonal columns) unchanged and contracts every other block. "stochastic"
    (ours) projects each column onto the probability simplex (sparsemax: column-stochastic A with exact zeros, on
    the boundary of the p = 1 ball), drops B u and learns h_0: every layer is a probabilistic automaton
    (model/lrnn/model.py); ``p_norm`` is then unused.

    ``transition_rank``: the generator g of the transitions, A(u) = constraint(g(u)). None (default, the paper's):
    g is one linear map d_model -> H b^2, d_model H b^2 weights per layer (2.1 M of a d_model = 512, H = 64, b = 8
    layer's 4.7 M). An integer r: g(u) = V (s U u) + c factors through r dimensions, U: d_model -> r made in one
    product with the input map B, s = d_model / r a fixed multiplier (model/lrnn/model.py says why), V: r -> H b^2, so
    r (d_model + H b^2) weights; r must be below min(d_model, H b^2), where the factorisation saves nothing. The
    norm constraint is the same either way. On a transducer whose V input symbols reach the layer as V distinct
    vectors, g takes at most V values, which span an affine space of dimension V - 1: a rank of V - 1 then loses
    nothing it could represent (docs/results.md measures training).

    ``scan_impl``: "sequential" (the reference loop), "parallel" (log-depth scan), "chunked" (sequential
    inside chunks of ``scan_chunk_size``, scanned across them) or "auto" (the measured policy documented in
    model/ops/linear_scan.py, figures from benchmarks/bench_linear_scan.py).
    """

    n_layers: int = 1
    block_size: int = 8
    num_blocks: int = 8
    p_norm: float = 1.2
    transition_norm: Literal["column", "spectral", "stochastic"] = "column"
    transition_rank: int | None = None
    d_ff: int = 256
    scan_impl: Literal["auto", "sequential", "parallel", "chunked"] = "auto"
    scan_chunk_size: int = 64
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "n_layers", "block_size", "num_blocks", "d_ff", "scan_chunk_size")
        if self.p_norm < 1.0:
            raise ConfigError(f"p_norm must be >= 1 (a norm), got {self.p_norm}")
        full_rank = min(self.d_model, self.num_blocks * self.block_size**2)
        if self.transition_rank is not None and not 1 <= self.transition_rank < full_rank:
            raise ConfigError(
                f"transition_rank must be None (the full generator) or in [1, {full_rank}) (below min(d_model, "
                f"num_blocks * block_size**2), where a factorisation saves nothing), got {self.transition_rank}"
            )

    @property
    def state_size(self) -> int:
        return self.block_size * self.num_blocks


@dataclass(frozen=True, kw_only=True)
class DiagonalLRNNConfig(BaseModelConfig):
    """Diagonal, input-independent linear RNN (S4D / LRU style baseline).

    Each layer has ``state_size`` complex eigenvalues lambda = exp(-exp(nu) + i theta), fixed over time,
    run as ``state_size`` 2 x 2 rotation-scaling blocks on the same scan. ``scan_impl`` as in :class:`LRNNConfig`.
    """

    n_layers: int = 1
    state_size: int = 64
    d_ff: int = 256
    scan_impl: Literal["auto", "sequential", "parallel", "chunked"] = "auto"
    scan_chunk_size: int = 64
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "n_layers", "state_size", "d_ff", "scan_chunk_size")


PositionKind = Literal["sinusoidal", "alibi", "kerple", "t5", "xl"]


@dataclass(frozen=True, kw_only=True)
class TransformerConfig(BaseModelConfig):
    """Causal GPT-2 style transformer baseline with a choice of position handling.

    ``position``: "sinusoidal" (absolute, added to the embedding), "alibi", "kerple" (logarithmic variant),
    "t5" (relative buckets; distances below t5_num_buckets // 2 get a bucket each, larger ones log-spaced
    buckets up to t5_max_distance), "xl" (Transformer-XL relative attention). ``log_length_scaling``
    multiplies the attention logits (content and position terms) of the query at 0-based position m by
    log(m + 1), the log of the number of positions it attends over (exact-parity-first.txt section 5.3).
    """

    n_layers: int = 2
    n_heads: int = 4
    d_ff: int = 256
    position: PositionKind = "alibi"
    log_length_scaling: bool = False
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "n_layers", "n_heads", "d_ff", "t5_num_buckets", "t5_max_distance")
        _check_heads(self.d_model, self.n_heads)
        if self.t5_num_buckets < 2:
            raise ConfigError(f"t5_num_buckets must be >= 2, got {self.t5_num_buckets}")
        if self.t5_max_distance <= self.t5_num_buckets // 2:
            raise ConfigError(
                f"t5_max_distance ({self.t5_max_distance}) must exceed t5_num_buckets // 2 "
                f"({self.t5_num_buckets // 2}), where the log-spaced buckets start"
            )


@dataclass(frozen=True, kw_only=True)
class LSTMConfig(BaseModelConfig):
    """Stacked LSTM baseline: ``n_layers`` of width ``hidden_size``, projected to d_model for the head."""

    n_layers: int = 1
    hidden_size: int = 128
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "n_layers", "hidden_size")


ExactConstruction = Literal["parity", "first", "one", "palindrome", "palindrome_mirror"]
PositionFeature = Literal[
    "fraction", "alternating", "is_first_symbol", "index", "mirror_index", "index_squared", "left_half", "right_half"
]


@dataclass(frozen=True, kw_only=True)
class ExactTransformerConfig(BaseModelConfig):
    """Hand-built post-norm transformer encoder that classifies a whole string from its CLS position
    (exact-parity-first.txt section 2.2, exact-one-palindrome.txt section 2.2); see model/transformer/exact.py.

    The model prepends CLS (and appends EOS with ``append_eos``) to the symbols; n counts them. Position i
    gets PE(i) = W_pos f(i, n), f the ``position_features`` (model/transformer/exact.py defines them). Each of the
    ``n_layers`` layers has ``n_heads`` heads with d_model x d_model query, key and value maps, summed, and a
    ReLU FFN of width ``d_ff``. With ``layer_norm``, LN(x) = (x - mean) / sqrt(var + eps), without gain or
    bias, follows both residual sums; ``layer_norm_eps`` may be 0. ``log_length_scaling`` multiplies the
    attention logits by log n (exact-parity-first.txt Eq. 2). ``output``: "logits" reads the label logits off
    the CLS vector with a linear head; "zero_test" (two labels) is the palindrome paper's y = I[s = 0] with s
    the label-1 minus label-0 logit, |s| <= ``zero_test_tolerance`` counting as 0. ``construction`` names the
    construction the weights implement (training/exact_builders.py). The model computes in
    ``compute_dtype`` and holds at most ``attention_block_elements`` attention weights (batch x heads x
    queries x keys) at once.
    """

    construction: ExactConstruction
    n_layers: int = 2
    n_heads: int = 1
    d_ff: int = 4
    position_features: tuple[PositionFeature, ...] = ()
    append_eos: bool = False
    layer_norm: bool = False
    layer_norm_eps: float = 0.0
    log_length_scaling: bool = False
    output: Literal["logits", "zero_test"] = "logits"
    zero_test_tolerance: float = 0.0
    compute_dtype: Literal["float32", "float64"] = "float32"
    attention_block_elements: int = 1 << 22

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "n_layers", "n_heads", "d_ff", "attention_block_elements")
        if self.is_language_model:
            raise ConfigError("an exact transformer is a classifier: num_labels must be > 0")
        if self.dropout != 0.0:
            raise ConfigError(f"an exact transformer has no dropout, got {self.dropout}")
        features = typing.get_args(PositionFeature)
        for feature in self.position_features:
            if feature not in features:
                raise ConfigError(f"position_features: {feature!r} is not one of {list(features)}")
        if len(set(self.position_features)) != len(self.position_features):
            raise ConfigError(f"position_features repeats a feature: {list(self.position_features)}")
        if self.layer_norm_eps < 0.0 or self.zero_test_tolerance < 0.0:
            raise ConfigError("layer_norm_eps and zero_test_tolerance must be >= 0")
        if self.output == "zero_test" and self.num_labels != 2:
            raise ConfigError(f"output 'zero_test' needs two labels, got num_labels = {self.num_labels}")


ARCHITECTURE_CONFIGS: dict[str, type[BaseModelConfig]] = {
    "regulargpt": RegularGPTConfig,
    "lrnn": LRNNConfig,
    "diagonal_lrnn": DiagonalLRNNConfig,
    "transformer": TransformerConfig,
    "lstm": LSTMConfig,
    "exact": ExactTransformerConfig,
}


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Everything ``config.json`` holds: the architecture, its hyper-parameters and its interface.

    A transducer (``kind="transduce"``) names its ``task`` (or null for a compiled automaton without one),
    its input ``alphabet`` (one character per symbol, index = token id) and its ``labels``. A language
    model (``kind="generate"``) names its ``tokenizer``. ``metadata`` is free-form provenance (training
    command, steps, accuracy) that loading keeps but never interprets.
    """

    architecture: str
    model: BaseModelConfig
    kind: Literal["transduce", "generate"]
    task: str | None = None
    alphabet: str | None = None
    labels: tuple[str, ...] | None = None
    tokenizer: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        _check_literals(self)
        expected = ARCHITECTURE_CONFIGS.get(self.architecture)
        if expected is None:
            raise ConfigError(
                f"unknown architecture {self.architecture!r}; known: {sorted(ARCHITECTURE_CONFIGS)}"
            )
        if type(self.model) is not expected:
            raise ConfigError(
                f"architecture {self.architecture!r} needs a {expected.__name__}, got {type(self.model).__name__}"
            )
        if self.format_version != FORMAT_VERSION:
            raise ConfigError(f"format_version must be {FORMAT_VERSION} in a config built here, got {self.format_version}")
        if self.kind == "transduce":
            self._check_transducer()
        elif not self.tokenizer:
            raise ConfigError("a generate model must name its tokenizer")
        elif not self.model.is_language_model:
            raise ConfigError("a generate model must have num_labels = 0 (a tied language-model head)")

    def _check_transducer(self) -> None:
        if not self.alphabet:
            raise ConfigError("a transduce model must have a non-empty alphabet")
        if len(set(self.alphabet)) != len(self.alphabet):
            raise ConfigError(f"alphabet {self.alphabet!r} repeats a symbol")
        if not self.labels:
            raise ConfigError("a transduce model must have a non-empty list of labels")
        if len(set(self.labels)) != len(self.labels):
            raise ConfigError(f"labels {list(self.labels)} repeat a label")
        if self.model.vocab_size != len(self.alphabet):
            raise ConfigError(
                f"model.vocab_size is {self.model.vocab_size} but the alphabet has {len(self.alphabet)} symbols"
            )
        if self.model.num_labels != len(self.labels):
            raise ConfigError(
                f"model.num_labels is {self.model.num_labels} but there are {len(self.labels)} labels"
            )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["labels"] = list(self.labels) if self.labels is not None else None
        return out

    @classmethod
    def from_dict(cls, data: Any) -> CheckpointConfig:
        """A config.json object of any version this build reads (older ones through :func:`migrate_config`)."""
        data = migrate_config(data)
        model_class = ARCHITECTURE_CONFIGS[data["architecture"]]
        fields = dict(data)
        fields["model"] = dataclass_from_dict(model_class, data.get("model"), where="model")
        return dataclass_from_dict(cls, fields, where="config")


# What a format_version 1 file meant by a key it left out: the defaults of the builds that wrote version 1.
_V1_DEFAULTS: dict[str, dict[str, Any]] = {
    "config": {"task": None, "alphabet": None, "labels": None, "tokenizer": None, "metadata": {}},
    "model": {"num_labels": 0, "d_model": 64, "dropout": 0.0},
    "regulargpt": {"n_heads": 4, "d_ff": 256, "chunk_size": 2, "thickness": 1, "attention_impl": "auto",
                   "out_of_range": "null", "layer_norm_eps": 1e-5},
    "lrnn": {"n_layers": 1, "block_size": 8, "num_blocks": 8, "p_norm": 1.2, "transition_norm": "column",
             "d_ff": 256, "scan_impl": "auto", "scan_chunk_size": 64, "layer_norm_eps": 1e-5},
    "diagonal_lrnn": {"n_layers": 1, "state_size": 64, "d_ff": 256, "scan_impl": "auto", "scan_chunk_size": 64,
                      "layer_norm_eps": 1e-5},
    "transformer": {"n_layers": 2, "n_heads": 4, "d_ff": 256, "position": "alibi", "log_length_scaling": False,
                    "t5_num_buckets": 32, "t5_max_distance": 128, "layer_norm_eps": 1e-5},
    "lstm": {"n_layers": 1, "hidden_size": 128, "layer_norm_eps": 1e-5},
    "exact": {"n_layers": 2, "n_heads": 1, "d_ff": 4, "position_features": [], "append_eos": False,
              "layer_norm": False, "layer_norm_eps": 0.0, "log_length_scaling": False, "output": "logits",
              "zero_test_tolerance": 0.0, "compute_dtype": "float32", "attention_block_elements": 1 << 22},
}


# What a file older than the version that added a model key meant by it, by that version and architecture.
_ADDED_KEYS: dict[int, dict[str, dict[str, Any]]] = {
    3: {"lrnn": {"transition_rank": None}},  # the full transition generator, the only one before
    4: {"regulargpt": {"block_norm": "pre"}},  # pre-norm blocks, the only ones before
}


def migrate_config(data: Any) -> dict[str, Any]:
    """A config.json object of any version this build reads -> a copy in the current version (every key there).

    Version 1 -> 2: the keys a version 1 file left out get the values that file meant (``_V1_DEFAULTS``). Then
    each key added since the file's version gets the value the file meant (``_ADDED_KEYS``). Keys the file has,
    unknown ones included, are left for the loader to check. Raises ConfigError for a version this build does not
    read or an unknown architecture.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
    version = data.get("format_version")
    if "format_version" not in data:
        raise ConfigError("config: missing key 'format_version'")
    if version not in range(1, FORMAT_VERSION + 1) or isinstance(version, bool):
        raise ConfigError(f"unsupported format_version {version!r}; this build reads 1 to {FORMAT_VERSION}")
    architecture = data.get("architecture")
    if architecture not in ARCHITECTURE_CONFIGS:
        raise ConfigError(f"unknown architecture {architecture!r}; known: {sorted(ARCHITECTURE_CONFIGS)}")
    if version == FORMAT_VERSION:
        return dict(data)
    migrated = {**data, "format_version": FORMAT_VERSION}
    model = data.get("model")
    if version == 1:
        migrated = {**_V1_DEFAULTS["config"], **migrated}
        if isinstance(model, dict):
            model = {**_V1_DEFAULTS["model"], **_V1_DEFAULTS[architecture], **model}
    if isinstance(model, dict):
        for added_in, keys in _ADDED_KEYS.items():
            if version < added_in:
                model = {**keys.get(architecture, {}), **model}
        migrated["model"] = model
    return migrated


def dataclass_from_dict(cls: type, data: Any, where: str) -> Any:
    """Build the frozen dataclass ``cls`` from ``data``, refusing unknown, mistyped and missing keys (every field
    must be there, defaults or not)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(data).__name__}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        values[name] = _coerce(value, hints[name], f"{where}.{name}")
    missing = [name for name in known if name not in values]
    if missing:
        raise ConfigError(f"{where}: missing key(s) {missing}")
    try:
        return cls(**values)
    except TypeError as error:
        raise ConfigError(f"{where}: {error}") from None


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """Check a JSON value against a type hint, converting lists to tuples where the hint asks for one."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(hint):
            try:
                return _coerce(value, option, where)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(f"{where}: {value!r} matches none of {hint}")
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{where}: {value!r} is not one of {list(typing.get_args(hint))}")
        return value
    if hint is type(None):
        if value is not None:
            raise ConfigError(f"{where}: expected null, got {value!r}")
        return None
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {type(value).__name__}")
        (item_hint, _ellipsis) = typing.get_args(hint)
        return tuple(_coerce(item, item_hint, f"{where}[{i}]") for i, item in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected an object, got {type(value).__name__}")
        return dict(value)
    if dataclasses.is_dataclass(value) and isinstance(hint, type) and isinstance(value, hint):
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if hint is Any:
        return value
    if isinstance(hint, type) and isinstance(value, hint):
        return value
    raise ConfigError(f"{where}: expected {hint}, got {value!r}")


def _check_literals(config: object) -> None:
    """Refuse a value outside a ``Literal[...]`` field's choices, also when the dataclass is built in code."""
    for name, hint in typing.get_type_hints(type(config)).items():
        if typing.get_origin(hint) is Literal and getattr(config, name) not in typing.get_args(hint):
            raise ConfigError(f"{name}: {getattr(config, name)!r} is not one of {list(typing.get_args(hint))}")


def _check_positive(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")


def _check_heads(d_model: int, n_heads: int) -> None:
    if d_model % n_heads:
        raise ConfigError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
