"""Typed, frozen model configurations and the ``config.json`` format (:class:`CheckpointConfig`). Loading refuses
unknown, missing and mistyped keys; files older than ``FORMAT_VERSION`` are read through :func:`migrate_config`."""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

FORMAT_VERSION = 7


class ConfigError(ValueError):
    """A configuration (or config.json) that cannot describe a model; the message says why."""


@dataclass(frozen=True, kw_only=True)
class BaseModelConfig:
    """``vocab_size`` input symbols or tokens; ``num_labels`` a transducer's labels, or 0 for a tied-head language
    model."""

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
    """RegularGPT (model/regulargpt/model.py): layer l lets position m attend to m - j chunk_size**l, j in [chunk_size],
    through ``thickness`` shared blocks. ``attention_impl``: "reference" (T x T mask), "fast" (gathered keys) or "auto".
    ``out_of_range``: slots before position 0 hold a learned null key/value ("null") or are masked ("mask").
    ``block_norm``: "pre" x + f(LN(x)) or "post" LN(x + f(x)). ``level_codes`` (transducers): each thick layer's output
    is replaced, at every position, by the code (a row of the weights' ``level_codes``, one per label) of the label the
    head reads there, so the shared blocks compose the same vectors at every depth (``python -m training snap``)."""

    n_heads: int = 4
    d_ff: int = 256
    chunk_size: int = 2
    thickness: int = 1
    attention_impl: Literal["auto", "reference", "fast"] = "auto"
    out_of_range: Literal["mask", "null"] = "null"
    block_norm: Literal["pre", "post"] = "pre"
    layer_norm_eps: float = 1e-5
    level_codes: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "n_heads", "d_ff", "thickness")
        _check_heads(self.d_model, self.n_heads)
        if self.chunk_size < 2:
            raise ConfigError(f"chunk_size must be >= 2, got {self.chunk_size}")
        if self.level_codes and self.is_language_model:
            raise ConfigError("level_codes needs a transducer's labels (num_labels > 0)")


@dataclass(frozen=True, kw_only=True)
class LRNNConfig(BaseModelConfig):
    """Block-diagonal input-dependent LRNN (model/lrnn/model.py), ``num_blocks`` blocks of ``block_size`` per layer.
    ``transition_norm``: "column" (each column by 1 / max(1, ||column||_p), p = ``p_norm``), "spectral" (then each block
    by 1 / max(1, ||block||_2)), "stochastic" (sparsemax columns, no B u, learned h_0), "orthogonal" (each block's
    orthogonal polar factor, no B u, learned h_0: norms kept at any length) or "delta" (model/lrnn/delta.py: per head
    of ``num_blocks`` a ``block_size`` x ``block_size`` matrix state written by the delta rule; ``scan_impl``
    "sequential" runs its reference loop, any other its chunked form in chunks of ``scan_chunk_size``). ``transition_rank``: None for
    a full generator, or r below min(d_model, num_blocks block_size**2). ``scan_impl``: "sequential", "parallel",
    "chunked" (chunks of ``scan_chunk_size``) or "auto". ``state_codes`` (transducers): with K > 0, after every
    ``snap_every``-th symbol (counting from 1) each block's state is replaced by the nearest of its K codes (a
    recurrence's ``state_codes`` weights, (H, K, b): states visited at the training lengths), and that symbol's readout
    reads the code, so that long inputs stay on the states the model was trained on (``python -m training snap``).
    ``short_conv`` (delta only): with K > 0, q, k and v are each channel's causal convolution over the last K
    positions' projections, then SiLU (DeltaNet's short convolution; 0: the projections as they are)."""

    n_layers: int = 1
    block_size: int = 8
    num_blocks: int = 8
    p_norm: float = 1.2
    transition_norm: Literal["column", "spectral", "stochastic", "orthogonal", "delta"] = "column"
    transition_rank: int | None = None
    d_ff: int = 256
    scan_impl: Literal["auto", "sequential", "parallel", "chunked"] = "auto"
    scan_chunk_size: int = 64
    layer_norm_eps: float = 1e-5
    state_codes: int = 0
    snap_every: int = 1
    short_conv: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, "n_layers", "block_size", "num_blocks", "d_ff", "scan_chunk_size", "snap_every")
        if self.short_conv < 0:
            raise ConfigError(f"short_conv must be >= 0 (0: none), got {self.short_conv}")
        if self.short_conv and self.transition_norm != "delta":
            raise ConfigError("short_conv applies to transition_norm 'delta' only")
        if self.state_codes < 0:
            raise ConfigError(f"state_codes must be >= 0 (0: none), got {self.state_codes}")
        if self.state_codes and self.is_language_model:
            raise ConfigError("state_codes needs a transducer's labels (num_labels > 0)")
        if self.p_norm < 1.0:
            raise ConfigError(f"p_norm must be >= 1 (a norm), got {self.p_norm}")
        if self.transition_norm == "delta" and (self.transition_rank is not None or self.state_codes):
            raise ConfigError("transition_norm 'delta' takes neither a transition_rank nor state_codes")
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
    """Diagonal LRNN baseline (model/lrnn/diagonal.py): ``state_size`` complex eigenvalues; ``scan_impl`` as
    :class:`LRNNConfig`'s."""

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
    """Causal transformer baseline (model/transformer/model.py). ``position``: "sinusoidal", "alibi", "kerple", "t5"
    (buckets up to ``t5_max_distance``) or "xl". ``log_length_scaling``: query m's logits times log(m + 1)."""

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
    """Hand-built post-norm encoder classifying a string from its CLS position (model/transformer/exact.py): CLS (and
    EOS with ``append_eos``) added; ``n_layers`` of ``n_heads`` summed d_model x d_model heads and a ReLU FFN of
    ``d_ff``; ``layer_norm`` without gain or bias. ``output``: "logits", or "zero_test" (label 1 iff the logit
    difference is within ``zero_test_tolerance`` of 0). ``construction``: what the weights implement. Computes in
    ``compute_dtype``, at most ``attention_block_elements`` attention weights at once."""

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
    """Everything ``config.json`` holds: a transducer (``kind="transduce"``) names ``task``, ``alphabet`` (a character
    per token id) and ``labels``; a language model (``kind="generate"``) its ``tokenizer``. ``metadata`` is free-form.
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
            raise ConfigError(f"unknown architecture {self.architecture!r}; known: {sorted(ARCHITECTURE_CONFIGS)}")
        if type(self.model) is not expected:
            raise ConfigError(
                f"architecture {self.architecture!r} needs a {expected.__name__}, got {type(self.model).__name__}"
            )
        if self.format_version != FORMAT_VERSION:
            raise ConfigError(
                f"format_version must be {FORMAT_VERSION} in a config built here, got {self.format_version}"
            )
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
            raise ConfigError(f"model.num_labels is {self.model.num_labels} but there are {len(self.labels)} labels")

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
        config: CheckpointConfig = dataclass_from_dict(cls, fields, where="config")
        return config


# What a format_version 1 file meant by a key it left out: the defaults of the builds that wrote version 1.
_V1_DEFAULTS: dict[str, dict[str, Any]] = {
    "config": {"task": None, "alphabet": None, "labels": None, "tokenizer": None, "metadata": {}},
    "model": {"num_labels": 0, "d_model": 64, "dropout": 0.0},
    "regulargpt": {
        "n_heads": 4,
        "d_ff": 256,
        "chunk_size": 2,
        "thickness": 1,
        "attention_impl": "auto",
        "out_of_range": "null",
        "layer_norm_eps": 1e-5,
    },
    "lrnn": {
        "n_layers": 1,
        "block_size": 8,
        "num_blocks": 8,
        "p_norm": 1.2,
        "transition_norm": "column",
        "d_ff": 256,
        "scan_impl": "auto",
        "scan_chunk_size": 64,
        "layer_norm_eps": 1e-5,
    },
    "diagonal_lrnn": {
        "n_layers": 1,
        "state_size": 64,
        "d_ff": 256,
        "scan_impl": "auto",
        "scan_chunk_size": 64,
        "layer_norm_eps": 1e-5,
    },
    "transformer": {
        "n_layers": 2,
        "n_heads": 4,
        "d_ff": 256,
        "position": "alibi",
        "log_length_scaling": False,
        "t5_num_buckets": 32,
        "t5_max_distance": 128,
        "layer_norm_eps": 1e-5,
    },
    "lstm": {"n_layers": 1, "hidden_size": 128, "layer_norm_eps": 1e-5},
    "exact": {
        "n_layers": 2,
        "n_heads": 1,
        "d_ff": 4,
        "position_features": [],
        "append_eos": False,
        "layer_norm": False,
        "layer_norm_eps": 0.0,
        "log_length_scaling": False,
        "output": "logits",
        "zero_test_tolerance": 0.0,
        "compute_dtype": "float32",
        "attention_block_elements": 1 << 22,
    },
}


# What a file older than the version that added a model key meant by it, by that version and architecture.
_ADDED_KEYS: dict[int, dict[str, dict[str, Any]]] = {
    3: {"lrnn": {"transition_rank": None}},  # the full transition generator, the only one before
    4: {"regulargpt": {"block_norm": "pre"}},  # pre-norm blocks, the only ones before
    5: {"regulargpt": {"level_codes": False}},  # each layer's output as it is
    6: {"lrnn": {"state_codes": 0, "snap_every": 1}},  # each block's state as it is
    7: {"lrnn": {"short_conv": 0}},  # q, k and v of a delta-rule layer straight from its projection
}


def with_added_keys(architecture: str, model: dict[str, Any]) -> dict[str, Any]:
    """A model config ``model`` of ``architecture`` with each key a later format version added, where it lacks one, as
    older files meant it: for model configs kept without a version (a training run's resume state)."""
    added = {key: value for keys in _ADDED_KEYS.values() for key, value in keys.get(architecture, {}).items()}
    return {**added, **model}


def migrate_config(data: Any) -> dict[str, Any]:
    """A config.json object of any readable version -> a copy in the current one; ConfigError for an unreadable version
    or unknown architecture."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a JSON object, got {type(data).__name__}")
    version: Any = data.get("format_version")  # a JSON value: checked against the range below
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
    """Build ``cls`` from ``data``; ConfigError for unknown, mistyped or missing keys."""
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
    """Refuse a value outside a ``Literal[...]`` field's choices."""
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
