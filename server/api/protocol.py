"""The HTTP API's request and response bodies (docs/api.md, HTTP API), as pydantic models and nothing else.

No torch and no engine here: the Python client imports this module. Requests of our own endpoints refuse
unknown fields; ``/v1/completions`` ignores unknown OpenAI fields but refuses known ones it cannot honour.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WithJsonSchema,
    WrapValidator,
    model_validator,
)

FinishReason = Literal["stop", "length"]
SETTING = "x-regularlm-setting"
TOKEN_ID_PATTERN = "^(0|[1-9][0-9]*)$"


def schema_only(**keywords: Any) -> dict[str, Any]:
    """JSON-schema keywords the serving code checks itself, in the schema so that clients know them."""
    return keywords


def setting_limit(**keywords: str) -> dict[str, Any]:
    """JSON-schema keywords whose values are settings (``maxItems="max_inputs"``), checked by the serving code (413) and
    written in by ``server/api/openapi.py``."""
    return {SETTING: keywords}


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# JSON has one number type: 2.0 is the integer 2 (JSON Schema agrees). In a union (``| None``) constraints go
# before it, Annotated[int, Field(ge=0), INTEGRAL]; after it, pydantic writes "ge" into the schema, not "minimum".
INTEGRAL = BeforeValidator(_integral)
Integer = Annotated[int, INTEGRAL]


class RequestModel(BaseModel):
    """A request body holds the JSON types its schema states: no "8" for 8, no 0 for false (integers are
    ``Integer``); no NaN or Infinity ("Input should be a finite number")."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


class StrictModel(RequestModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error: ``{"error": {"message": ..., "type": ...}}``."""

    error: ErrorDetail


class HealthResponse(BaseModel):
    """200 "ok", or "degraded" where checkpoint folders were skipped at load (``detail`` names them; the models that
    loaded serve); 503 "loading", "draining", "failed" or "unresponsive" (the engine process has sent no heartbeat
    for ``engine_heartbeat_timeout_s``: it is stopped or stuck; 200 again once it answers)."""

    status: Literal["ok", "degraded", "loading", "draining", "failed", "unresponsive"]
    detail: str | None = None


class DecodeStep(BaseModel):
    mode: Literal["cuda_graphs", "eager"]
    batch_sizes: list[int] = Field(
        default_factory=list,
        description="cuda_graphs: the captured batch sizes; a batch runs the graph of the next "
        "size up (padded), a larger one runs eagerly",
    )
    reason: str | None = Field(None, description="eager: why")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "regularlm"
    kind: Literal["transduce", "generate"]
    architecture: str
    task: str | None = None
    alphabet: str | None = None
    labels: list[str] | None = None
    tokenizer: str | None = None
    vocab_size: int
    parameters: int
    limits: dict[str, int] | None = Field(
        None,
        description="the largest inputs this server ever admits for the model, given the path it runs, its measured "
        "speed and the memory budget: max_input_symbols (a transduce input with outputs 'final', or a prompt), "
        "max_all_outputs_symbols (outputs 'all'), max_context_tokens (prompt + max_tokens)",
    )
    decode: DecodeStep | None = Field(
        None, description="how a generation model's decode step runs (none for transduce models)"
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class RuntimeModelRequest(BaseModel):
    """``POST /v1/models``: compile a regular expression or a DFA (docs/api.md, Automaton files) into a transduce model that
    labels every prefix "1" when it is accepted (a regex: fully matched), else "0"."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", description="the new model's id")
    regex: str | None = Field(None, min_length=1, max_length=4096, description="a Python regular expression")
    dfa: dict[str, Any] | None = Field(
        None, description="a DFA as in docs/api.md, Automaton files (name, alphabet, states, ...)"
    )
    alphabet: str | None = Field(None, min_length=1, max_length=256, description="with regex: the input symbols")
    architecture: Literal["lrnn", "regulargpt"] = "lrnn"


class DeletedModel(BaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: Literal[True] = True


# --- /v1/transduce -------------------------------------------------------------------------------------


INPUT_LIMIT = setting_limit(maxLength="max_input_symbols")


class TransduceRequest(StrictModel):
    model: str
    inputs: list[Annotated[str, Field(json_schema_extra={**schema_only(minLength=1), **INPUT_LIMIT})]] = Field(
        min_length=1, json_schema_extra=setting_limit(maxItems="max_inputs")
    )
    outputs: Literal["final", "all"] = "final"


class TransduceResult(BaseModel):
    final: str
    all: list[str] | None = Field(None, description="the label at every position; only with outputs='all'")
    confidence: float = Field(description="the model's probability of the final label")


class TransduceUsage(BaseModel):
    symbols: int


class TransduceResponse(BaseModel):
    model: str
    results: list[TransduceResult]
    usage: TransduceUsage


# --- sampling, shared by /v1/generate and /v1/completions ------------------------------------------------


MAX_TOKENS_LIMIT = setting_limit(maximum="max_tokens")
STRUCTURED_LIMIT = setting_limit(maxLength="structured_max_chars")


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs``: exactly one of ``regex``, ``choice`` and ``json``. Every returned text matches
    it unless cut by max_tokens or a stop string (finish_reason "length", or "stop" with a stop string). An invalid
    pattern or schema is refused (422), one too large or too slow to compile too (413)."""

    model_config = ConfigDict(
        json_schema_extra={"oneOf": [{"required": ["regex"]}, {"required": ["choice"]}, {"required": ["json"]}]}
    )

    regex: Annotated[str | None, WithJsonSchema({"type": "string", **STRUCTURED_LIMIT})] = Field(
        None, description="a Python regular expression; each text matches it whole (re.fullmatch)"
    )
    choice: Annotated[
        list[str] | None,
        WithJsonSchema({"type": "array", "items": {"type": "string", **STRUCTURED_LIMIT}, "minItems": 1}),
    ] = Field(None, description="each text is one of these strings")
    json_schema: Annotated[dict[str, Any] | str | None, WithJsonSchema({"type": ["object", "string"]})] = Field(
        None,
        alias="json",
        description="a JSON schema (an object, or one as a JSON string); each text is compact JSON (no whitespace "
        "outside strings) that validates against it",
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("regex", "choice", "json_schema") if name in self.model_fields_set]
        if len(given) != 1 or getattr(self, given[0]) is None:
            raise ValueError("give exactly one of regex, choice and json, not null")
        if self.choice == []:
            raise ValueError("choice needs at least one string")
        return self


class SamplingFields(RequestModel):
    """temperature 0 is greedy; top_k 0 and top_p 1 turn those filters off; a seed makes sampling repeatable.

    Every value in range gives a distribution: values below what float32 holds act as its smallest normal
    (temperature, repetition_penalty) or keep only the most likely token (top_p)."""

    temperature: float = Field(
        1.0,
        ge=0.0,
        le=100.0,
        description="0: greedy; above 0, a value below float32's smallest normal (1.2e-38) acts "
        "as that (the most likely tokens, ties drawn among)",
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="the most likely tokens up to this share of the probability, at least one and "
        "any tied with the last; a tiny value keeps the most likely token (and its ties)",
    )
    top_k: Integer = Field(0, ge=0)
    seed: Annotated[int, Field(ge=0), INTEGRAL] | None = Field(None, description="any integer >= 0 (used modulo 2^63)")
    stop: str | list[str] | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's: minus this once per seen token")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="OpenAI's: minus this per occurrence")
    repetition_penalty: float = Field(
        1.0,
        gt=0.0,
        le=100.0,
        description="vLLM's (CTRL's): seen tokens' logits divided (if > 0) or multiplied by it; "
        "a value below float32's smallest normal (1.2e-38) acts as that, and a logit it pushes past float32's largest "
        "stays at the largest",
    )
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None,
        description="token id (a decimal string, as OpenAI's) -> a bias added to its logit",
        json_schema_extra=schema_only(propertyNames={"pattern": TOKEN_ID_PATTERN}),
    )
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM's: a regex, a choice of strings or a JSON schema every returned text matches"
    )

    @property
    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        return [stop for stop in stops if stop]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# --- /v1/generate ----------------------------------------------------------------------------------------


class GenerateRequest(SamplingFields, StrictModel):
    model: str
    prompt: str = Field(min_length=1)
    max_tokens: Integer = Field(
        64, ge=0, description="left out: 64, or the server's limit if lower", json_schema_extra=MAX_TOKENS_LIMIT
    )
    stream: bool = False


class GenerateResponse(BaseModel):
    model: str
    text: str
    finish_reason: FinishReason
    usage: Usage


class GenerateChunk(BaseModel):
    """One Server-Sent Event of a streamed /v1/generate; the last one has the finish reason and usage."""

    model: str
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


# --- /v1/completions (OpenAI) ----------------------------------------------------------------------------


class StreamOptions(RequestModel):
    include_usage: bool = False


PROMPTS_LIMIT = setting_limit(maxItems="max_inputs")  # prompts x n is checked too


def _integral_items(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Token ids validated as one strict list of integers; only a list that fails pays a pass turning 2.0 into 2."""
    try:
        return handler(value)
    except ValidationError:
        if not isinstance(value, list):
            raise
        return handler([_integral(item) for item in value])


def _prompt_kind(value: Any) -> str:
    """Which form a prompt takes, from its type and first item, so that one member of the union is tried."""
    if isinstance(value, str):
        return "text"
    first = value[0] if isinstance(value, list) and value else None
    return "texts" if isinstance(first, str) else "token_lists" if isinstance(first, list) else "tokens"


TokenIds = Annotated[list[int], Field(min_length=1), WrapValidator(_integral_items)]
TOKEN_IDS_SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0},
    "minItems": 1,
    **setting_limit(maxItems="max_input_symbols"),
}
Prompt = Annotated[
    Annotated[str, Field(min_length=1), Tag("text")]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1), Tag("texts")]
    | Annotated[TokenIds, Tag("tokens")]
    | Annotated[list[TokenIds], Field(min_length=1), Tag("token_lists")],
    Discriminator(_prompt_kind),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, **PROMPTS_LIMIT},
                TOKEN_IDS_SCHEMA,
                {"type": "array", "items": TOKEN_IDS_SCHEMA, "minItems": 1, **PROMPTS_LIMIT},
            ]
        }
    ),
]


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(extra="ignore")

    model: str
    prompt: Prompt = Field(description="a text, a batch of texts, token ids, or a batch of token-id lists; none empty")
    max_tokens: Annotated[int, Field(ge=0), INTEGRAL] | None = Field(
        16,
        description="left out: 16, or the server's limit if lower; null: the limit",
        json_schema_extra=MAX_TOKENS_LIMIT,
    )
    n: Integer = Field(1, ge=1, json_schema_extra=setting_limit(maximum="max_inputs"))
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5), INTEGRAL] | None = None
    user: str | None = None
    # Known OpenAI fields this server cannot honour: accepted only at their neutral values (so stated in the schema).
    best_of: Annotated[int, Field(ge=1, le=1), INTEGRAL] | None = Field(None, description="only 1 (or absent)")
    suffix: Annotated[str, Field(max_length=0)] | None = Field(None, description="not supported: only empty")

    @property
    def prompts(self) -> Sequence[str | list[int]]:
        """Each prompt: a text or a list of token ids."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]
        return self.prompt


class ChatRequest(RequestModel):
    """/v1/chat/completions: only ``model`` is read (no served model ships a chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: str


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed one (then ``usage`` is null except in the usage chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
