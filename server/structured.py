"""Structured outputs (vLLM's ``structured_outputs``): a regex, a choice of strings or a JSON schema that every
generated text matches, enforced token by token by llguidance over the model's own tiktoken vocabulary
(docs/benchmarks.md compares it with xgrammar and outlines-core and says why this one).

**Compiling** (``ConstraintCompiler.compile``, awaited on the event loop, run in a thread of its own, never on the
engine's): a regex is first rewritten by ``server/structured_regex.py`` so that it means what ``re.fullmatch``
means; a choice is the alternation of its strings, taken literally; a JSON schema goes to llguidance's JSON
compiler, compact (no whitespace outside strings). llguidance then builds a matcher for the vocabulary, within its
own limits (lexer fuel, grammar size) and ``structured_compile_timeout_s``. An invalid pattern or schema, or one
that no text matches, is a 422 naming the problem; one over a size or time limit a 413. Compiled constraints are
kept (LRU) per vocabulary; a request's sequences each get a copy of one (``CompiledConstraint.start``).

**Decoding** (``token_bias``, ``Constraint.consume``): a step writes the allowed tokens of every constrained row
into one bitmask (a decode step on a thread of its own while the model runs: ``token_bias_later``), and the logits
of the other tokens become -inf before the penalties and filters, so constrained and free rows sample in the same
call. The end-of-text token is allowed only where the text so far matches. A sequence ends ("stop") as soon as its
text matches and nothing longer could (``Constraint.finished``), or when no token of the model may follow (a model
without an end-of-text token, at a complete match).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import llguidance
import llguidance.tiktoken
import numpy as np
import torch

from server.errors import APIError, InputTooLarge, InvalidInput, Overloaded
from server.structured_regex import PatternError, literal_regex, plain_regex

if TYPE_CHECKING:
    from model.tokenizer import Tokenizer
    from server.protocol import StructuredOutputs

logger = logging.getLogger(__name__)

CACHED_CONSTRAINTS = 256  # compiled constraints kept per vocabulary (LRU)
MAX_COMPILING = 4  # compiles still running at once (a timed-out one runs on until llguidance's limits stop it)
JSON_OPTIONS = {"whitespace_flexible": False}  # compact: "," and ":" with no whitespace around them
_MINUS_INFINITY_BITS = np.float32(-np.inf).view(np.int32)


class ConstraintVocabulary:
    """llguidance's view of one tiktoken vocabulary. A tokenizer without an end-of-text token gets one past its last
    id, which the model can never sample: its constrained sequences end when nothing else may follow."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.size = tokenizer.vocab_size  # the tokenizer's ids (a model may have more: never allowed)
        end = tokenizer.eot_token if tokenizer.eot_token is not None else self.size
        self.lltokenizer = llguidance.tiktoken.lltokenizer_from_encoding(
            tokenizer.encoding, n_vocab=max(self.size, end + 1), eos_token=end
        )
        self.words = (max(self.size, end + 1) + 31) // 32  # int32 words of one row's bitmask
        self.compiled: OrderedDict[str, CompiledConstraint] = OrderedDict()  # spec (JSON) -> it, LRU


class Constraint:
    """One sequence's matcher: the text generated so far, and what may follow it."""

    def __init__(self, matcher: llguidance.LLMatcher, vocabulary: ConstraintVocabulary) -> None:
        self.matcher, self.vocabulary = matcher, vocabulary

    def fill(self, bitmask: np.ndarray) -> None:
        """Write the allowed next tokens into ``bitmask``, one row: (words,) int32, contiguous (a bit per token).
        Row by row: llguidance's LLExecutor, which spreads rows over threads, took 3-20 ms for 32 rows whose masks
        take 0.07 ms in turn here."""
        self.matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; False if the matcher did not allow it (then ``error`` says why)."""
        return self.matcher.consume_token(token)

    @property
    def finished(self) -> bool:
        """The text matches and nothing longer could."""
        return self.matcher.is_stopped() and self.matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher stopped working (e.g. a limit of llguidance's reached at this step), or None."""
        return _first_line(self.matcher.get_error()) if self.matcher.is_error() else None


class CompiledConstraint:
    """A compiled ``structured_outputs`` for one vocabulary, in its initial state."""

    def __init__(self, matcher: llguidance.LLMatcher, vocabulary: ConstraintVocabulary) -> None:
        self.matcher, self.vocabulary = matcher, vocabulary

    def start(self) -> Constraint:
        """A new sequence's own matcher."""
        return Constraint(self.matcher.deep_copy(), self.vocabulary)


def token_bias(constraints: list[Constraint], vocabulary: int) -> tuple[torch.Tensor, list[bool]]:
    """What each constrained row may sample next, as a bias to add to its logits: (R, V) float32, 0 where allowed,
    -inf where not (V: the model's logits); and whether each row may sample any token of the model at all.

    Branch-free: llguidance's bitmasks (one int32 word per 32 tokens, filled row by row) are unpacked to one 0/1
    byte per token, and (bit - 1) & bits(-inf) is the bias's float bits. A masked_fill or where with the mask
    took 4 ms for 32 x 8,192 tokens on this 2-core machine (a mispredicted branch per token), this 0.2 ms.
    """
    words = constraints[0].vocabulary.words
    bitmask = np.empty((len(constraints), words), dtype=np.int32)  # (R, words), little-endian words
    for row, constraint in enumerate(constraints):
        constraint.fill(bitmask[row])
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :vocabulary]  # (R, V) 0 or 1
    if bits.shape[1] < vocabulary:  # a model with more ids than its tokenizer: those are never allowed
        bits = np.pad(bits, ((0, 0), (0, vocabulary - bits.shape[1])))
    bias = np.subtract(bits, 1, dtype=np.int32)  # (R, V) 0 or all ones
    bias &= _MINUS_INFINITY_BITS
    return torch.from_numpy(bias.view(np.float32)), bits.any(axis=-1).tolist()  # (R, V) 0 or -inf


def token_bias_later(constraints: list[Constraint], vocabulary: int) -> Future[tuple[torch.Tensor, list[bool]]]:
    """``token_bias`` on a thread of its own, to run while the model computes the step's logits (the constraints
    must not advance meanwhile). llguidance and numpy let go of the GIL for their work, as torch does for its."""
    return _MASK_THREAD.submit(token_bias, constraints, vocabulary)


_MASK_THREAD = ThreadPoolExecutor(1, thread_name_prefix="regularlm-masks")


def grammar(spec: StructuredOutputs, deadline: float) -> str:
    """llguidance's grammar for the spec (module docstring); :class:`PatternError` if the regex cannot be one."""
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(plain_regex(spec.regex, deadline=deadline))
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_regex("(?:" + "|".join(map(literal_regex, spec.choice)) + ")")
    schema = spec.json_schema
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise PatternError(f"the schema is not JSON: {error}") from None
    if not isinstance(schema, dict):
        raise PatternError("the schema must be a JSON object")
    return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def spec_size(spec: StructuredOutputs) -> int:
    """Characters of the regex, of the choices together, or of the schema as JSON text."""
    if spec.regex is not None:
        return len(spec.regex)
    if spec.choice is not None:
        return sum(map(len, spec.choice))
    return len(spec.json_schema if isinstance(spec.json_schema, str) else json.dumps(spec.json_schema))


class ConstraintCompiler:
    """Compiles ``structured_outputs`` off the engine thread, with size and time limits, and keeps the results."""

    def __init__(self, max_chars: int, timeout_s: float) -> None:
        self.max_chars, self.timeout_s = max_chars, timeout_s
        self._vocabularies: weakref.WeakKeyDictionary[Tokenizer, ConstraintVocabulary] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._compiling = 0

    async def compile(self, spec: StructuredOutputs, tokenizer: Tokenizer) -> CompiledConstraint:
        kind = "regex" if spec.regex is not None else "choice" if spec.choice is not None else "json"
        size = spec_size(spec)
        if size > self.max_chars:
            raise InputTooLarge(
                f"structured_outputs.{kind} has {size} characters; the limit is {self.max_chars} "
                "(REGULARLM_STRUCTURED_MAX_CHARS)"
            )
        key = json.dumps(spec.model_dump(by_alias=True), sort_keys=True)  # ASCII: lone surrogates escaped too
        with self._lock:
            known = self._vocabularies.get(tokenizer)
            if known is not None and key in known.compiled:
                known.compiled.move_to_end(key)
                return known.compiled[key]
            if self._compiling >= MAX_COMPILING:
                raise Overloaded(f"{MAX_COMPILING} structured_outputs constraints are compiling; retry later",
                                 retry_after_s=1)  # fmt: skip
            self._compiling += 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[CompiledConstraint] = loop.create_future()
        deadline = time.monotonic() + self.timeout_s

        def run() -> None:
            try:
                result: CompiledConstraint | Exception = self._compile_now(spec, kind, tokenizer, deadline)
            except APIError as error:  # the request's answer
                result = error
            except Exception as error:  # a failure of the library's: the request's answer too (500)
                logger.exception("compiling structured_outputs.%s failed", kind)
                result = error
            finally:
                with self._lock:
                    self._compiling -= 1
            loop.call_soon_threadsafe(_settle, future, result)

        threading.Thread(target=run, name="regularlm-constraint", daemon=True).start()
        try:
            compiled = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
            raise self._too_slow(kind) from None
        with self._lock:
            compiled.vocabulary.compiled[key] = compiled
            while len(compiled.vocabulary.compiled) > CACHED_CONSTRAINTS:
                compiled.vocabulary.compiled.popitem(last=False)
        return compiled

    def _too_slow(self, kind: str) -> InputTooLarge:
        return InputTooLarge(
            f"structured_outputs.{kind} did not compile within {self.timeout_s:g} s "
            "(REGULARLM_STRUCTURED_COMPILE_TIMEOUT_S); simplify it"
        )

    def vocabulary(self, tokenizer: Tokenizer) -> ConstraintVocabulary:
        with self._lock:
            vocabulary = self._vocabularies.get(tokenizer)
        if vocabulary is None:  # built outside the lock (~0.1 s for 8k tokens); two threads may both build it
            vocabulary = ConstraintVocabulary(tokenizer)
            with self._lock:
                vocabulary = self._vocabularies.setdefault(tokenizer, vocabulary)
        return vocabulary

    def _compile_now(self, spec: StructuredOutputs, kind: str, tokenizer: Tokenizer, deadline: float
                     ) -> CompiledConstraint:  # fmt: skip
        """Runs in a compile thread: the matcher, checked to accept some text."""
        vocabulary = self.vocabulary(tokenizer)
        try:
            text = grammar(spec, deadline)
        except PatternError as error:
            if time.monotonic() > deadline:
                raise self._too_slow(kind) from None
            raise (InputTooLarge if error.over_limit else InvalidInput)(f"structured_outputs.{kind}: {error}") from None
        except ValueError as error:  # llguidance refuses the schema's JSON itself
            raise InvalidInput(f"structured_outputs.{kind}: {error}") from None
        matcher = llguidance.LLMatcher(vocabulary.lltokenizer, text, log_level=0, limits=_LIMITS)
        _check(matcher, kind)
        bitmask = np.empty(vocabulary.words, dtype=np.int32)
        Constraint(matcher, vocabulary).fill(bitmask)  # the first mask: builds the start state, finds a dead one
        if not bitmask.any() or (matcher.is_stopped() and not matcher.is_accepting()):
            raise InvalidInput(f"structured_outputs.{kind}: no text matches it")
        _check(matcher, kind)
        return CompiledConstraint(matcher, vocabulary)


_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


def _check(matcher: llguidance.LLMatcher, kind: str) -> None:
    if not matcher.is_error():
        return
    message = _first_line(matcher.get_error())
    raise (InputTooLarge if "limit" in message else InvalidInput)(f"structured_outputs.{kind}: {message}")


def _first_line(error: str) -> str:
    return (error.strip().splitlines() or [""])[0]


def _settle(future: asyncio.Future, result: object) -> None:
    if future.cancelled():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
