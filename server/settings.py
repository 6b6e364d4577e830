"""Server settings: ``REGULARLM_*`` environment variables (``REGULARLM_PORT=9000``), overridden by the command line of
``python -m server``. Lists are JSON in the environment; ``REGULARLM_MODELS`` also takes paths separated by
``os.pathsep``. The models served: the shipped ``checkpoints/`` (unless ``shipped_models`` is false) and the folders of
``models`` (``Settings.model_folders``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

SHIPPED_CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="REGULARLM_", frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    models: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="folders served beside the shipped checkpoints/: each a folder of checkpoint "
        "folders, or one checkpoint folder (python -m server --models DIR [DIR ...]). In the environment a path, "
        "paths separated by os.pathsep (':'), or a JSON list",
    )
    shipped_models: bool = Field(
        True,
        description="serve the shipped checkpoints/ (where the package runs from the repository, which has "
        "them) as well as the folders of models; false (python -m server --no-shipped-models): the folders of models "
        "only",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"

    api_key: SecretStr | None = Field(None, description="when set, /v1/* needs 'Authorization: Bearer <key>'")
    metrics_need_api_key: bool = Field(
        False, description="when an API key is set, /metrics needs it too (its series name the served models)"
    )
    docs_need_api_key: bool | None = Field(
        None,
        description="when an API key is set, /openapi.json, /docs and /redoc need it too (the schema lists the "
        "served model ids); default: as metrics_need_api_key",
    )
    cors_origins: list[str] = Field(default_factory=list, description="origins allowed by CORS; empty: no CORS")
    max_body_bytes: int = Field(
        16 * 2**20,
        gt=0,
        description="bytes of a request body; more is refused (413) from Content-Length before the "
        "body is read, or once a chunked body passes it. The default holds a transduce request of "
        "max_request_symbols (2^20) even with every symbol written as a 6-byte JSON escape",
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="the longest a request body may take to arrive, from the app's first read; then 408"
    )
    linger_max_bytes: int = Field(
        64 * 2**20,
        ge=0,
        description="bytes of a body answered without being read (401, 413, 429 from the headers, "
        "a body past max_body_bytes) that are read and discarded before the connection closes, as nginx's lingering "
        "close does, so that a client still sending it reads the answer rather than a reset",
    )
    linger_timeout_s: float = Field(10.0, ge=0, description="the longest that discarding may take in all")
    linger_read_timeout_s: float = Field(
        2.0, gt=0, description="discarding stops after this long without a byte arriving"
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="the longest a connection may take to send a request's headers, from its opening or "
        "the first byte of a later request; then it is closed (python -m server)",
    )
    keep_alive_s: float = Field(
        75.0,
        gt=0,
        description="how long an idle connection is kept open after a response (uvicorn's keep-alive "
        "timeout, python -m server): longer than clients keep idle connections (httpx and the openai client 5 s, "
        "aiohttp 15 s), so that a client does not reuse one just as the server closes it (its request is then reset). "
        "uvicorn's own default, 5 s, is httpx's: under load 1 run in 8 of 384 streams lost a request that way",
    )

    max_input_symbols: int = Field(
        2**20,
        gt=0,
        description="symbols of one transduce input or prompt tokens (each model's own limits, from "
        "its memory and max_job_seconds, may be lower): 2^20, the longest length of the long-context probes' "
        "induction-heads test, which an LRNN runs in O(1) memory",
    )
    max_request_symbols: int = Field(2**20, gt=0, description="symbols of all inputs of one transduce request")
    max_inputs: int = Field(256, gt=0, description="inputs of one transduce request, prompts x n of a completion")
    max_tokens: int = Field(4096, ge=0, description="the largest max_tokens a request may ask for")
    max_stop_strings: int = Field(256, ge=0, description="stop strings of one request; more is refused (413)")
    max_stop_chars: int = Field(
        16_384,
        ge=0,
        description="characters of a request's stop strings together; more is refused (413). Matching "
        "costs the same per generated character whatever the number of strings (an Aho-Corasick automaton)",
    )
    max_logit_bias: int = Field(4096, ge=0, description="logit_bias entries of one request; more is refused (413)")
    max_body_values: int = Field(
        2**20 + 2**17,
        gt=0,
        description="JSON values (numbers, strings, arrays, objects, and object keys) of one "
        "request body, counted before it is parsed; more is refused (413). The default holds a request at every other limit (2^20 token ids "
        "or symbols, with its stop strings, logit_bias and schema), and bounds what parsing a body may cost",
    )

    batch_wait_ms: float = Field(3.0, ge=0, description="how long transduce inputs are gathered into a batch")
    max_batch_size: int = Field(64, gt=0, description="rows of one transduce batch")
    max_batch_symbols: int = Field(65_536, gt=0, description="padded symbols (rows x length) of one transduce batch")
    max_running: int = Field(64, gt=0, description="sequences decoded at once (continuous batching)")
    cuda_graphs: bool = Field(
        True,
        description="on CUDA, run the decode step of models with a fixed-size cache (LRNN, LSTM) through CUDA "
        "graphs captured at batch sizes 1, 2, 4, 8, 16, ... up to max_running (model/cuda_graphs.py); false: eager",
    )
    batch_invariant: bool | Literal["auto"] = Field(
        "auto",
        description="decode every row by the same arithmetic whatever the other rows, so that a seeded "
        "request gets the same logits and text alone or beside others: a decode step's products and layers through "
        "the row-wise kernels of model/ops/cpu/cpu_decode.py (slower at many rows: 64 rows of text-lrnn ~1.6x). It "
        "holds for float32 LRNN and RegularGPT language models on the CPU, with numba. auto (default): on where it "
        "holds for every served language model, off otherwise (logged); true: the server does not start where it does "
        "not hold",
    )
    decode_steps: int = Field(
        8,
        gt=0,
        description="decode steps the scheduler may run in one iteration while decoding is all it has to do "
        "and nothing new has arrived (vLLM's multi-step scheduling; at most one slice_ms of time): the planning, "
        "sweeps and the message to the API process are shared by them, and streamed tokens leave together; 1: one "
        "step per iteration",
    )
    max_waiting: int = Field(256, gt=0, description="requests queued beyond those running; more get 429")
    prefill_chunk_tokens: int = Field(2048, gt=0, description="prompt tokens prefilled per scheduler iteration")
    anticipate_ms: float = Field(
        10.0,
        ge=0,
        description="after a generate request ends, how long prompts that were yielding to it keep yielding (never "
        "past their own resume time), so that the client's next request, sent as the answer arrives, finds the "
        "engine free (anticipatory scheduling); 0: they resume at once",
    )
    slice_ms: float = Field(
        50.0,
        gt=0,
        description="the work of one scheduler slice (a transduce batch, a slice of a long input, a "
        "prefill chunk), in milliseconds of the model's measured speed: how long other work may wait behind it",
    )
    max_job_seconds: float = Field(
        300.0,
        gt=0,
        description="the longest estimated computation one input may need on a model whose state grows "
        "with its length (RegularGPT, transformers, the exact encoders); longer ones are refused (413)",
    )
    max_constant_state_job_seconds: float = Field(
        3600.0,
        gt=0,
        description="the same on a model whose state has one size at every length (LRNN, LSTM): a long "
        "input to it holds O(1) memory and runs in slices that yield to every other client, so only this bounds it. "
        "The default admits 2^20 tokens of the shipped text-lrnn (estimated 600-900 s, 160-480 s to run) on a "
        "loaded 2-core CPU, with room for a larger or stochastic LRNN",
    )
    memory_budget_bytes: int | None = Field(
        None,
        ge=0,
        description="bytes running work may hold at once (caches, activations); default half the "
        "memory available after loading, less state_cache_bytes",
    )
    retry_after_s: int = Field(1, ge=0, description="the Retry-After of a 429 or 503")
    structured_max_chars: int = Field(
        65_536,
        gt=0,
        description="characters of a structured_outputs regex, of its choices together, or of its JSON "
        "schema as JSON text; more is refused (413)",
    )
    structured_compile_timeout_s: float = Field(
        5.0,
        gt=0,
        description="the longest a structured_outputs constraint may take to compile (off the engine "
        "thread); longer is refused (413)",
    )
    structured_mask_timeout_s: float = Field(
        0.25,
        gt=0,
        description="the longest the allowed tokens of one constrained sequence's next token may take "
        "to compute (off the engine thread, which waits no longer); a sequence past it ends with an error (413, or "
        "an SSE error event once streaming), the others go on",
    )
    structured_mask_budget_s: float = Field(
        5.0,
        gt=0,
        description="the time computing allowed tokens may take in all for one constrained sequence; a "
        "sequence past it ends with an error (413, or an SSE error event once streaming)",
    )
    runtime_models_max: int = Field(
        16,
        ge=0,
        description="models POST /v1/models may add (compiled regular expressions and DFAs) at one time; "
        "more is refused (413); 0 turns the route off",
    )
    runtime_model_max_states: int = Field(
        1024,
        gt=0,
        description="states of a runtime model's minimal DFA (RegularGPT: at most 16, its construction "
        "grows as n^5); more is refused (413)",
    )
    runtime_compile_timeout_s: float = Field(
        10.0,
        gt=0,
        description="the longest compiling a runtime model may take (off the engine thread); longer is refused (413)",
    )

    state_cache_entries: int = Field(64, ge=0, description="prompt-state snapshots kept (LRU); 0 turns it off")
    state_cache_bytes: int = Field(256 * 2**20, ge=0, description="bytes the snapshots may hold together")
    state_cache_min_tokens: int = Field(32, gt=0, description="prompts shorter than this are not snapshotted")
    state_cache_tail_tokens: int = Field(
        256,
        ge=0,
        description="a prompt is also snapshotted this many tokens before its end (when that leaves at "
        "least this many and state_cache_min_tokens), so that a prompt that differs only in its last tokens (another "
        "question on the same document) skips the shared part; 0: whole prompts only",
    )

    torch_threads: int | None = Field(
        None,
        gt=0,
        description="intra-op threads of the model calls; default max(1, (cores - 1) // 1): one core is left to "
        "the event loop, tokenizer and HTTP (model/threads.py says why: torch's one per core stalls as soon as "
        "anything else runs)",
    )
    engine_heartbeat_timeout_s: float = Field(
        5.0,
        gt=0,
        description="the engine process sends a heartbeat every second while its worker thread turns; "
        "when none has come for this long, /health answers 503 (unresponsive) and new requests 503, until one comes",
    )
    engine_timeout_s: float = Field(
        180.0,
        gt=0,
        description="when the engine process has been silent this long, every request in flight ends "
        "with 503 instead of waiting on; a working engine is never silent for more than a slice (it sends a "
        "heartbeat between slices), however long a request's computation is",
    )
    drain_timeout_s: float = Field(
        30.0,
        ge=0,
        description="how long SIGTERM waits for requests in flight; then they get 503 and the process "
        "exits within drain_timeout_s + 5 s",
    )
    engine_process: bool | None = Field(
        None,
        description="run the engine core (models, scheduler, sampling) in a child process of its own, which "
        "sends each step's tokens to this one, where HTTP, tokenizing, detokenizing and streaming run "
        "(server/engine/client.py); false: on a thread of this process. Default: a process under python -m server, "
        "a thread in an app built by server.api.app.create_app (tests, embedding)",
    )
    engine_niceness: int = Field(
        5,
        ge=0,
        le=19,
        description="added to the engine process's niceness: where the two processes want the same core (a "
        "machine with fewer free cores than busy threads), the API process's HTTP, refusals and /health win it, "
        "and the engine takes every cycle they leave; 0: equal shares",
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    access_log: bool = Field(
        False,
        description="uvicorn's access log, a line per request at INFO (python -m server). Off by default: it is "
        "formatted and written on the event loop, between one request and the next",
    )

    @field_validator("models", mode="before")
    @classmethod
    def _model_paths(cls, value: object) -> object:
        """A ``Path`` or string is a list of one; a string may hold several (``os.pathsep``), or a JSON list."""
        if isinstance(value, os.PathLike):
            return [value]
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [part for part in value.split(os.pathsep) if part]
        return value

    @model_validator(mode="after")
    def _something_to_serve(self) -> Settings:
        if not self.shipped_models and not self.models:
            raise ValueError("shipped_models is false and models names no folder: there is nothing to serve")
        return self

    @property
    def model_folders(self) -> list[Path]:
        """The folders loaded, in order, each once: the shipped checkpoints/ (unless ``shipped_models`` is false or the
        installation has none), then those of ``models``."""
        folders = [SHIPPED_CHECKPOINTS] if self.shipped_models and SHIPPED_CHECKPOINTS.is_dir() else []
        for folder in self.models:
            if all(folder.resolve() != seen.resolve() for seen in folders):
                folders.append(folder)
        return folders
