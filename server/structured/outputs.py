"""Structured outputs (vLLM's ``structured_outputs``): a regex, a choice of strings or a JSON schema that every
generated text matches, enforced token by token by llguidance over the model's tiktoken vocabulary.

:class:`ConstraintCompiler` compiles off the engine thread within llguidance's limits and
``structured_compile_timeout_s``: 422 for an invalid constraint or one no text matches, 413 over a size or time limit.
:func:`token_bias` masks a step's constrained rows on the mask thread; end-of-text is allowed only where the text
matches. A mask over ``structured_mask_timeout_s`` (or a sequence's masks over ``structured_mask_budget_s``) ends the
sequence with 413 and its constraint is refused from then on; while ``MAX_LEFT_BEHIND`` late masks still run (llguidance
cannot be interrupted), new constraints get 429.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import llguidance
import llguidance.tiktoken
import numpy as np
import torch

from server.errors import APIError, InputTooLarge, InvalidInput, ModelFailure, Overloaded
from server.structured.regex import PatternError, literal_regex, plain_regex

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

    from model.tokenizer import Tokenizer
    from server.api.protocol import StructuredOutputs
    from server.settings import Settings

logger = logging.getLogger(__name__)
T = TypeVar("T")

CACHED_CONSTRAINTS = 256  # compiled constraints kept per vocabulary (LRU)
MAX_COMPILING = 4  # compiles still running at once (a timed-out one runs on until llguidance's limits stop it)
MAX_LEFT_BEHIND = 4  # masks past their budget still computing (each holds a core) before constraints get 429
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False}  # compact: "," and ":" with no whitespace around them
_MINUS_INFINITY_BITS = np.float32(-np.inf).view(np.int32)


class ConstraintVocabulary:
    """llguidance's view of one tiktoken vocabulary; one without an end-of-text token gets one past its last id, never
    sampled."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.size = tokenizer.vocab_size  # the tokenizer's ids (a model may have more: never allowed)
        end = tokenizer.eot_token if tokenizer.eot_token is not None else self.size
        self.lltokenizer = llguidance.tiktoken.lltokenizer_from_encoding(
            tokenizer.encoding, n_vocab=max(self.size, end + 1), eos_token=end
        )
        self.words = (max(self.size, end + 1) + 31) // 32  # int32 words of one row's bitmask
        self.compiled: OrderedDict[str, CompiledConstraint] = OrderedDict()  # spec (JSON) -> it, LRU


@dataclass(frozen=True)
class MaskBudget:
    """How long one sequence's masks may take: per token, and in all."""

    per_token_s: float
    total_s: float

    @classmethod
    def of(cls, settings: Settings) -> MaskBudget:
        return cls(settings.structured_mask_timeout_s, settings.structured_mask_budget_s)


class Constraint:
    """One sequence's matcher: the text generated so far, and what may follow it."""

    def __init__(self, matcher: llguidance.LLMatcher, compiled: CompiledConstraint) -> None:
        self.matcher, self.compiled = matcher, compiled
        self.vocabulary, self.budget = compiled.vocabulary, compiled.budget
        self.spent_s = 0.0  # its masks' time so far
        self.over_budget: str | None = None  # set once past its budget: then its matcher is not touched again

    def fill(self, bitmask: np.ndarray) -> None:
        """Write the allowed next tokens into one (words,) int32 row of ``bitmask``."""
        self.matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def consume(self, token: int) -> bool:
        """Advance past a sampled token; False if the matcher did not allow it (then ``failure`` says why)."""
        return self.matcher.consume_token(token)

    def charge(self, seconds: float) -> None:
        """Count a mask's time (on the mask thread)."""
        self.spent_s += seconds
        if self.spent_s > self.budget.total_s:
            self.over_budget = (
                f"computing the allowed tokens took {self.spent_s:.2f} s in all, over the "
                f"{self.budget.total_s:g} s a sequence may take (REGULARLM_STRUCTURED_MASK_BUDGET_S)"
            )

    def too_slow(self) -> None:
        """Its last mask ran past the budget per token: it ends, as will any later request for the same constraint."""
        self.over_budget = self.compiled.too_slow = (
            f"computing the allowed next tokens took longer than {self.budget.per_token_s:g} s "
            "(REGULARLM_STRUCTURED_MASK_TIMEOUT_S)"
        )

    @property
    def finished(self) -> bool:
        """The text matches and nothing longer could."""
        return self.matcher.is_stopped() and self.matcher.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the sequence cannot go on (budget spent, a limit of llguidance's reached), or None."""
        if self.over_budget is not None:
            return self.over_budget
        return _first_line(self.matcher.get_error()) if self.matcher.is_error() else None

    def failure(self, token: int | None = None) -> APIError:
        """The error that ends the sequence once ``error`` is set: 413 for a limit, else 500 (``token`` allowed by its
        mask, then refused)."""
        error = self.error
        if self.over_budget is not None:
            return InputTooLarge(f"structured_outputs: {error}; simplify the constraint")
        if _over_limit(error):
            return InputTooLarge(f"structured_outputs: {error} (a limit of llguidance's); simplify the constraint")
        return ModelFailure(f"structured_outputs: token {token} was sampled but not allowed: {error}")


class CompiledConstraint:
    """A compiled ``structured_outputs`` for one vocabulary, in its initial state."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocabulary: ConstraintVocabulary,
        budget: MaskBudget,
        spec: StructuredOutputs | None = None,
    ) -> None:
        self.matcher, self.vocabulary, self.budget = matcher, vocabulary, budget
        self.spec = spec  # what it was compiled from (the engine process compiles it again: a matcher is not sent)
        self.too_slow: str | None = None  # set when one of its sequences' masks ran past the budget per token

    def start(self) -> Constraint:
        """A new sequence's own matcher."""
        return Constraint(self.matcher.deep_copy(), self)


def token_bias(constraints: list[Constraint], vocabulary: int) -> tuple[torch.Tensor, list[bool]]:
    """What each constrained row may sample next: a (R, V) float32 bias, 0 where allowed, -inf where not, and whether
    each row may sample any token; computed on the mask thread within the budget."""
    return token_bias_later(constraints, vocabulary).result()


def token_bias_later(constraints: list[Constraint], vocabulary: int) -> Masks:
    """:func:`token_bias` started on the mask thread, to overlap the model's step; the constraints must not advance
    meanwhile."""
    masks = Masks(constraints, vocabulary)
    _MASK_THREADS.submit(masks)
    return masks


def bias_from_bitmask(bitmask: np.ndarray, vocabulary: int) -> tuple[torch.Tensor, list[bool]]:
    """:func:`token_bias` from llguidance's (R, words) int32 bitmasks, one little-endian word per 32 tokens."""
    bits = np.unpackbits(bitmask.view(np.uint8), axis=-1, bitorder="little")[:, :vocabulary]  # (R, V) 0 or 1
    if bits.shape[1] < vocabulary:  # a model with more ids than its tokenizer: those are never allowed
        bits = np.pad(bits, ((0, 0), (0, vocabulary - bits.shape[1])))
    bias = np.subtract(bits, 1, dtype=np.int32)  # (R, V) 0 or all ones
    bias &= _MINUS_INFINITY_BITS
    allowed = bits.any(axis=-1)  # (R,): bits is 2-D
    assert isinstance(allowed, np.ndarray)
    return torch.from_numpy(bias.view(np.float32)), allowed.tolist()  # (R, V) 0 or -inf


class Masks:
    """One decode step's masks, filled row by row on the mask thread."""

    def __init__(self, constraints: list[Constraint], vocabulary: int) -> None:
        self.constraints, self.vocabulary = constraints, vocabulary
        self.bitmask = np.zeros((len(constraints), constraints[0].vocabulary.words), dtype=np.int32)  # (R, words)
        self._lock = threading.Lock()
        self._row, self._row_started, self._filling = 0, time.monotonic(), False  # the row in llguidance's hands
        self._left = False  # the engine stopped waiting: its thread must not touch the other rows
        self._done = threading.Event()
        self._outcome: tuple[torch.Tensor, list[bool]] | BaseException | None = None

    def run(self) -> None:
        """On the mask thread."""
        try:
            for row, constraint in enumerate(self.constraints):
                if constraint.compiled.too_slow is not None:  # another sequence's mask was: its row allows nothing
                    constraint.over_budget = constraint.compiled.too_slow
                    continue
                with self._lock:
                    if self._left:
                        return
                    self._row, self._row_started, self._filling = row, time.monotonic(), True
                constraint.fill(self.bitmask[row])
                with self._lock:
                    if self._left:  # this row is the one past its budget
                        return
                    self._filling = False
                    constraint.charge(time.monotonic() - self._row_started)
            self._outcome = bias_from_bitmask(self.bitmask, self.vocabulary)
        except BaseException as error:  # the engine's to raise (a failure of the library's)
            self._outcome = error
        finally:
            self._done.set()

    def result(self) -> tuple[torch.Tensor, list[bool]]:
        """:func:`token_bias`'s result. A row past its budget per token allows nothing and its constraint is
        ``over_budget``; the rows after it run on a new thread. Re-raises the library's failures."""
        late = self._wait()
        if late is None:
            if isinstance(self._outcome, BaseException):
                raise self._outcome
            assert self._outcome is not None  # every row done: run() set it
            return self._outcome
        self.constraints[late].too_slow()
        bitmask = np.zeros_like(self.bitmask[: late + 1])  # (late + 1, words): the late row allows nothing
        bitmask[:late] = self.bitmask[:late]  # done before it (its thread may still write the late row)
        bias, allowed = bias_from_bitmask(bitmask, self.vocabulary)
        if late + 1 == len(self.constraints):
            return bias, allowed
        rest_bias, rest_allowed = token_bias(self.constraints[late + 1 :], self.vocabulary)
        return torch.cat([bias, rest_bias]), allowed + rest_allowed  # (R, V)

    @property
    def left(self) -> bool:
        """The engine stopped waiting for it (a row past its budget)."""
        return self._left

    def _wait(self) -> int | None:
        """Wait until every row is done (None), or return the row being filled once past its budget (left to its thread,
        which is replaced)."""
        while True:
            with self._lock:
                if self._done.is_set():
                    return None
                budget = self.constraints[self._row].budget.per_token_s
                timeout = self._row_started + budget - time.monotonic() if self._filling else budget
                if timeout <= 0:
                    self._left = True
                    late = self._row
                    break
            if self._done.wait(timeout):
                return None
        _MASK_THREADS.replace()
        return late


class MaskThreads:
    """The mask thread, fed from one queue. One left computing a late mask ends after it, a new one taking over;
    ``left_behind`` counts those."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Masks] = queue.SimpleQueue()
        self._started = False  # on first use
        self.left_behind = 0

    def submit(self, masks: Masks) -> None:
        with self._lock:
            if not self._started:
                self._started = True
                self._start()
        self._jobs.put(masks)

    def replace(self) -> None:
        """A thread's mask was left to it: another thread takes the queue."""
        with self._lock:
            self.left_behind += 1
        self._start()

    def _start(self) -> None:
        threading.Thread(target=self._serve, name="regularlm-masks", daemon=True).start()

    def _serve(self) -> None:
        while True:
            masks = self._jobs.get()
            masks.run()
            if masks.left:
                with self._lock:
                    self.left_behind -= 1
                return


_MASK_THREADS = MaskThreads()


def grammar(spec: StructuredOutputs, deadline: float) -> str:
    """llguidance's grammar for the spec; raises :class:`PatternError` if the regex cannot be one."""
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


def _kind(spec: StructuredOutputs) -> str:
    """Which of ``structured_outputs``' fields ``spec`` sets (error messages name it)."""
    return "regex" if spec.regex is not None else "choice" if spec.choice is not None else "json"


def _key(spec: StructuredOutputs) -> str:
    """``spec``'s key in a vocabulary's cache of compiled constraints."""
    return json.dumps(spec.model_dump(by_alias=True), sort_keys=True)


class ConstraintCompiler:
    """Compiles ``structured_outputs`` off the engine thread within size and time limits and caches the results (LRU per
    vocabulary)."""

    def __init__(self, max_chars: int, timeout_s: float, mask_budget: MaskBudget) -> None:
        self.max_chars, self.timeout_s, self.mask_budget = max_chars, timeout_s, mask_budget
        self._vocabularies: weakref.WeakKeyDictionary[Tokenizer, ConstraintVocabulary] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._compiling = 0

    async def compile(self, spec: StructuredOutputs, tokenizer: Tokenizer) -> CompiledConstraint:
        kind = _kind(spec)
        size = spec_size(spec)
        if size > self.max_chars:
            raise InputTooLarge(
                f"structured_outputs.{kind} has {size} characters; the limit is {self.max_chars} "
                "(REGULARLM_STRUCTURED_MAX_CHARS)"
            )
        key = _key(spec)
        with self._lock:
            known = self._vocabularies.get(tokenizer)
            cached = None if known is None else known.compiled.get(key)
            if cached is not None and cached.too_slow is not None:
                raise InputTooLarge(f"structured_outputs.{kind}: {cached.too_slow} for an earlier request; simplify it")
            if _MASK_THREADS.left_behind >= MAX_LEFT_BEHIND:
                raise Overloaded(
                    f"{_MASK_THREADS.left_behind} structured_outputs masks past their time budget are "
                    "still being computed; retry later",
                    retry_after_s=1,
                )
            if cached is not None:
                assert known is not None  # cached came from it
                known.compiled.move_to_end(key)
                return cached
            if self._compiling >= MAX_COMPILING:
                raise Overloaded(
                    f"{MAX_COMPILING} structured_outputs constraints are compiling; retry later", retry_after_s=1
                )
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
        self._keep(key, compiled)
        return compiled

    def compile_checked(self, spec: StructuredOutputs, tokenizer: Tokenizer) -> CompiledConstraint:
        """Compile again, blocking, a constraint the API process checked already (matchers do not cross processes)."""
        key = _key(spec)
        vocabulary = self.vocabulary(tokenizer)
        with self._lock:
            cached = vocabulary.compiled.get(key)
        if cached is None:
            cached = self._compile_now(spec, _kind(spec), tokenizer, time.monotonic() + self.timeout_s)
            self._keep(key, cached)
        return cached

    def _keep(self, key: str, compiled: CompiledConstraint) -> None:
        with self._lock:
            compiled.vocabulary.compiled[key] = compiled
            while len(compiled.vocabulary.compiled) > CACHED_CONSTRAINTS:
                compiled.vocabulary.compiled.popitem(last=False)

    def _too_slow(self, kind: str) -> InputTooLarge:
        return InputTooLarge(
            f"structured_outputs.{kind} did not compile within {self.timeout_s:g} s "
            "(REGULARLM_STRUCTURED_COMPILE_TIMEOUT_S); simplify it"
        )

    def vocabulary(self, tokenizer: Tokenizer) -> ConstraintVocabulary:
        with self._lock:
            vocabulary = self._vocabularies.get(tokenizer)
        if vocabulary is None:  # built outside the lock (it is slow); two threads may both build it
            vocabulary = ConstraintVocabulary(tokenizer)
            with self._lock:
                vocabulary = self._vocabularies.setdefault(tokenizer, vocabulary)
        return vocabulary

    def _compile_now(
        self, spec: StructuredOutputs, kind: str, tokenizer: Tokenizer, deadline: float
    ) -> CompiledConstraint:
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
        compiled = CompiledConstraint(matcher, vocabulary, self.mask_budget, spec)
        bitmask = np.empty(vocabulary.words, dtype=np.int32)
        Constraint(matcher, compiled).fill(bitmask)  # the first mask: builds the start state, finds a dead one
        if not bitmask.any() or (matcher.is_stopped() and not matcher.is_accepting()):
            raise InvalidInput(f"structured_outputs.{kind}: no text matches it")
        _check(matcher, kind)
        allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))  # token ids
        first = next((int(token) for token in allowed if token != vocabulary.lltokenizer.eos_token), None)
        if first is not None:  # a lexer out of fuel says so only once a token is consumed
            probe = matcher.deep_copy()
            probe.consume_token(first)
            _check(probe, kind)
        return compiled


_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


# How llguidance words the errors of its limits (ParserLimits): lexer fuel, lexer states, Earley items, grammar size.
_LIMIT_ERRORS = (
    "limit",
    "too many expressions",
    "too many states",
    "too many items",
    "fuel",
    "too big",
    "schema too large",
)


def _over_limit(error: str | None) -> bool:
    return error is not None and any(words in error.lower() for words in _LIMIT_ERRORS)


def _check(matcher: llguidance.LLMatcher, kind: str) -> None:
    if not matcher.is_error():
        return
    message = _first_line(matcher.get_error())
    if _over_limit(message):
        raise InputTooLarge(f"structured_outputs.{kind}: {message} (a limit of llguidance's); simplify it")
    raise InvalidInput(f"structured_outputs.{kind}: {message}")


def _first_line(error: str) -> str:
    return (error.strip().splitlines() or [""])[0]


def _settle(future: asyncio.Future[T], result: T | BaseException) -> None:
    if future.cancelled():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
