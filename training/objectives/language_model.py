"""The objective of ``python -m training text-train`` (``train --corpus``): a language model on text windows of
``length + 1`` tokens, scored on each next token; evaluation is the next-token loss on fixed held-out windows.
Writes a ``kind="generate"`` checkpoint with the latest weights, plus ``tokenizer.tiktoken`` when the tokenizer is
a ranks file. Options and their reasons: docs/training.md, "Training for long context".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from model.base import SequenceModel
from model.config import BaseModelConfig, CheckpointConfig
from model.serving import largest_fitting
from model.tokenizer import FILE_PREFIX, Tokenizer
from training.data.batches import IGNORE_INDEX, Batch
from training.data.corpus import corpus_documents, is_streamed, split_document
from training.data.mqar import HELD_OUT as MQAR_HELD_OUT
from training.data.mqar import TRAINED as MQAR_TRAINED
from training.data.mqar import mqar_row, split_ids
from training.data.passkey import PassKeyBuilder, draw_key
from training.data.retrieval import HELD_OUT, TRAINED, RetrievalBuilder, split_formats
from training.data.text_batches import StreamedWindows, TokenArray, cycled, tokenize_documents
from training.objectives.distill import Teacher
from training.objectives.distributed import Distributed
from training.objectives.run import Evaluation, Objective, RunState

RANKS_FILE = "tokenizer.tiktoken"
VALIDATION_STREAM = 1  # key of the validation windows' random stream (with the seed)


@dataclass(frozen=True)
class TextData:
    """What a language model trains and is validated on. ``tokenizer`` is what the checkpoint names."""

    corpus: str
    tokenizer: str
    length: int = 128  # the training context length L_tr
    validation_fraction: float = 0.1  # the tail of each document held out (in-memory corpora)
    validation_corpus: str | None = None  # for a streamed corpus: where validation windows come from
    validation_windows: int = 64
    passkey_fraction: float = 0.0  # of the training rows: pass-key examples (training/data/passkey.py)
    passkey_fraction_final: float | None = None  # the fraction at the run's last step, linear from the first
    passkey_distractors: int = 2  # a pass-key row's filler holds 0 .. this many other numbers
    passkey_number_forms: bool = False  # the distractors take the forms of training.data.passkey.NUMBER_FORMS
    state_passing: bool = False  # each row reads consecutive windows, its state carried over (recurrent models)
    passkey_span: int = 1  # with state passing: a pass-key example stretches over up to this many windows of a row
    recall_span: int = 1  # with state passing: a retrieval example stretches over up to this many windows of a row
    state_reset: float = 0.0  # with state passing: the chance that a row starts a step from the initial state
    passkey_fresh: bool = False  # with state passing: a row given a pass-key example starts it from the initial state
    recall_fraction: float = 0.0  # of the training rows: retrieval examples (training/data/retrieval.py, trained split)
    recall_needles: int = 4  # a retrieval row hides 1 .. this many needles; with several, it may ask for several
    recall_varied: float = 0.0  # the chance that a retrieval draw takes keys, subject and values from the vocabulary
    mqar_fraction: float = 0.0  # of the training rows: key-value recall (training/data/mqar.py)
    mqar_pairs: int = 4  # an MQAR row holds 1 .. this many pairs, all asked
    mqar_value_tokens: int = 1  # each MQAR value is a run of this many tokens
    example_weight: float = 1.0  # the loss weight of a row holding a whole pass-key, retrieval or MQAR example
    teacher: str | None = None  # a language model's folder whose distributions the text rows learn too
    teacher_weight: float = 0.0  # with a teacher: the share of its cross-entropy in a text row's loss


@dataclass(frozen=True)
class OpenExample:
    """An example spanning windows of one row (``passkey_span``, ``recall_span``), begun in an earlier window:
    ``left`` windows to go, the last one ending in ``question`` (unscored) and ``answer`` (scored), token ids.
    ``key``: a pass key's, whose last window also gets up to ``passkey_distractors`` other numbers."""

    left: int
    question: list[int]
    answer: list[int]
    key: str | None = None


PASSKEY_VALIDATION_PROMPTS = 32  # per evaluated size, depths spread evenly over [0, 1]
PASSKEY_VALIDATION_MULTIPLES = (1, 16)  # evaluated prompt sizes, in training lengths
PASSKEY_STREAM = 2  # key of the validation prompts' random stream (with the seed)
EVALUATION_MEMORY = 2 * 2**30  # bytes: the most one validation call may take, by the model's own estimate
PASSKEY_ANSWER_TOKENS = 8  # room for " {key}." in any tokenizer this project uses (the bytes one: 7)
RECALL_ANSWER_TOKENS = 16  # room for " {value}." of any format in any tokenizer this project uses
RECALL_STREAM = 3  # key of the retrieval validation prompts' random stream (with the seed)
RECALL_VALIDATION_PROMPTS = 32  # per evaluated size, held-out split, formats in turn
RECALL_PAIR_STREAM = 5  # key of the two-needle retrieval validation prompts' random stream (with the seed)
RECALL_DRAWS = 64  # draws of a retrieval validation prompt tried before its window counts as too short
MQAR_STREAM = 4  # key of the MQAR validation prompts' random stream (with the seed)
MQAR_VALIDATION_PROMPTS = 32  # per evaluated size and split, ``mqar_pairs`` pairs each


class LanguageModelObjective(Objective):
    """Next-token prediction on text windows, with the options of ``TextData`` (docs/training.md, "Training for
    long context"): pass-key rows (evaluation then adds ``passkey_accuracy_<size>``), retrieval rows
    (``recall_accuracy_<size>``; with several needles also ``recall_pair_accuracy_<size>``), MQAR rows
    (``mqar_accuracy_<size>`` on held-out ids, ``mqar_trained_accuracy_<size>``), state passing (``carries_state``),
    examples spanning windows, fresh rows (``Batch.fresh``) and a teacher."""

    name = "text"
    keep_best = False

    def __init__(
        self,
        data: TextData,
        tokenizer: Tokenizer,
        ranks_file: Path | None,
        steps: int,
        batch_size: int,
        seed: int,
        evaluate: bool,
        dist: Distributed,
    ) -> None:
        """``steps``: the run's, over which the pass-key fraction and span move. ValueError on a streamed corpus
        with pass-key or retrieval examples or state passing, or one without a validation corpus when ``evaluate``."""
        self.data, self.tokenizer, self.ranks_file, self.batch_size = data, tokenizer, ranks_file, batch_size
        self.steps = steps
        if is_streamed(data.corpus):
            self.windows: TokenArray | StreamedWindows = StreamedWindows(
                lambda: corpus_documents(data.corpus, dist.rank, dist.world_size), tokenizer
            )
            self.train_tokens = None
        else:
            texts = [
                split_document(document.text, data.validation_fraction, "train")
                for document in corpus_documents(data.corpus)
            ]
            tokens = tokenize_documents(texts, tokenizer)
            self.windows, self.train_tokens = TokenArray(tokens), len(tokens)
        if (
            data.passkey_fraction or data.recall_fraction or data.mqar_fraction or data.state_passing
        ) and not isinstance(self.windows, TokenArray):
            raise ValueError(
                f"{data.corpus} is streamed: pass-key, retrieval and MQAR examples and state passing need an in-memory "
                "corpus (austen or text:PATH)"
            )
        self.carries_state = data.state_passing
        self.cursors: np.ndarray | None = None  # with state passing: where each row reads next
        self.spans: list[OpenExample | None] | None = None  # with spans over 1: each row's open example
        self.passkey = None
        if data.passkey_fraction:
            self.shortest_passkey_row = check_passkey_length(tokenizer, data.length)
            self.passkey = PassKeyBuilder(tokenizer, self._corpus_tokens(), data.passkey_number_forms)
        self.recall = None
        if data.recall_fraction:
            self.recall = RetrievalBuilder(tokenizer, self._corpus_tokens(), TRAINED, varied=data.recall_varied)
        self.mqar_ids = split_ids(tokenizer, MQAR_TRAINED) if data.mqar_fraction else None
        if data.teacher is not None:
            self.teacher = Teacher.load(
                Path(data.teacher), data.teacher_weight, tokenizer, batch_size, data.state_passing, dist.device
            )
        self.validation = self._validation_windows(seed) if evaluate else None
        self.passkey_validation = (  # {figure: prompts}, as recall_validation and mqar_validation
            {"passkey_accuracy": self._passkey_prompts(seed)} if evaluate and self.passkey else {}
        )
        self.recall_validation = self._recall_prompts(seed) if evaluate and self.recall else {}
        self.mqar_validation = (
            {
                "mqar_accuracy": self._mqar_prompts(seed, MQAR_HELD_OUT),
                "mqar_trained_accuracy": self._mqar_prompts(seed, MQAR_TRAINED),
            }
            if evaluate and data.mqar_fraction
            else {}
        )

    def _corpus_tokens(self) -> np.ndarray:
        """The tokens of the in-memory corpus (a streamed one has none): the training examples' filler, the text
        that state passing reads on."""
        assert isinstance(self.windows, TokenArray)  # examples and state passing: refused when streamed
        return self.windows.tokens

    def _validation_windows(self, seed: int) -> torch.Tensor:
        """Fixed (N, length + 1) validation windows, the same on every process."""
        corpus = self.data.validation_corpus or self.data.corpus
        if is_streamed(corpus) and self.data.validation_corpus is None:
            raise ValueError(
                f"{corpus} is streamed and has no held-out tail: give a validation corpus "
                "(--validation-corpus owt2:...) or turn evaluation off (--eval-every 0)"
            )
        if self.data.validation_corpus is None:
            tokens = self.held_out
        else:
            tokens = self._held_out_stream(corpus)
        rng = np.random.default_rng([seed, VALIDATION_STREAM])
        return TokenArray(tokens).batch(rng, self.data.validation_windows, self.data.length)

    @functools.cached_property
    def held_out(self) -> np.ndarray:
        """The corpus's held-out tokens as one stream, (N,) int64: the validation prompts' filler, read once."""
        return self._held_out_stream(self.data.corpus)

    def _held_out_stream(self, corpus: str) -> np.ndarray:
        """``corpus``'s held-out tokens as one stream, (N,) int64; ValueError naming the corpus when it holds none."""
        documents = validation_tokens(corpus, self.data.validation_fraction, self.tokenizer)
        if not documents:
            raise ValueError(
                f"{corpus} holds no held-out text: each document's tail from a paragraph break (a blank line) near "
                f"{1 - self.data.validation_fraction:.0%} of it is held out, and none has one there; add paragraph "
                "breaks or turn evaluation off (--eval-every 0)"
            )
        return np.concatenate(documents)

    def _fixed_prompts(
        self,
        seed: int,
        stream: int,
        count: int,
        row: Callable[[int, int, float, np.random.Generator], tuple[torch.Tensor, torch.Tensor]],
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Fixed validation prompts at each of ``PASSKEY_VALIDATION_MULTIPLES`` of the length: {size: ((count, size + 1)
        tokens, (count, size) targets)}, row i ``row(size, i, depth, rng)`` with ``count`` depths spread evenly over
        [0, 1], drawn from the stream keyed by ``seed`` and ``stream``."""
        rng = np.random.default_rng([seed, stream])
        prompts = {}
        for multiple in PASSKEY_VALIDATION_MULTIPLES:
            size = self.data.length * multiple
            rows = [row(size, index, float(depth), rng) for index, depth in enumerate(np.linspace(0.0, 1.0, count))]
            prompts[size] = (torch.stack([tokens for tokens, _ in rows]), torch.stack([targets for _, targets in rows]))
        return prompts

    def _passkey_prompts(self, seed: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Pass-key validation prompts (``_fixed_prompts``), filler from the held-out text."""
        builder = PassKeyBuilder(self.tokenizer, self.held_out)
        return self._fixed_prompts(
            seed,
            PASSKEY_STREAM,
            PASSKEY_VALIDATION_PROMPTS,
            lambda size, index, depth, rng: self._passkey_row(builder, size + 1, depth, rng),
        )

    def _recall_prompts(self, seed: int) -> dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
        """Retrieval validation prompts, {figure: ``_fixed_prompts``}, filler from the held-out text, the answer
        scored. ``recall_accuracy``: one needle of the held-out split, its formats in turn. With ``recall_needles``
        > 1, ``recall_pair_accuracy``: two needles of the trained split (composed wordings, its formats in turn),
        the one at the row's depth asked, so that only the key tells which value is meant; left out when windows
        are too short for two needles."""
        prompts = {"recall_accuracy": self._recall_split_prompts(seed, RECALL_STREAM, HELD_OUT, 1)}
        if self.data.recall_needles > 1:
            with contextlib.suppress(ValueError):  # no draw of some format fits the window
                prompts["recall_pair_accuracy"] = self._recall_split_prompts(seed, RECALL_PAIR_STREAM, TRAINED, 2)
        return prompts

    def _recall_split_prompts(
        self, seed: int, stream: int, split: str, needles: int
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """``_fixed_prompts`` of ``needles`` needles of ``split``, its formats in turn, needle 0 (at the row's depth)
        asked. ValueError when ``RECALL_DRAWS`` draws of a format all take more than the window."""
        builder = RetrievalBuilder(self.tokenizer, self.held_out, split)
        formats = split_formats(split)

        def row(size: int, index: int, depth: float, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            fmt = formats[index % len(formats)]
            for _ in range(RECALL_DRAWS):
                draw = builder.draw(rng, fmt, depth, needles)
                try:
                    prompt = builder.prompt(draw, size + 1 - len(builder.answer(draw.values[0])))
                    break
                except ValueError:  # this draw takes more than the window
                    continue
            else:
                raise ValueError(f"{needles} needles of the {fmt} format do not fit {size} tokens")
            targets = torch.full((size,), IGNORE_INDEX, dtype=torch.long)
            targets[-len(prompt.answer) :] = torch.from_numpy(prompt.answer)
            return torch.from_numpy(np.concatenate([prompt.tokens, prompt.answer])), targets

        return self._fixed_prompts(seed, stream, RECALL_VALIDATION_PROMPTS, row)

    def _mqar_prompts(self, seed: int, split: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """MQAR validation prompts (``_fixed_prompts``) of ``mqar_pairs`` pairs from the ids of ``split``, filler from
        the held-out text, every value scored."""
        ids, pairs = split_ids(self.tokenizer, split), self.data.mqar_pairs

        def row(size: int, index: int, depth: float, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            filler = cycled(self.held_out, int(rng.integers(0, len(self.held_out))), size + 1)
            return mqar_row(rng, ids, size + 1, pairs, filler, self.data.mqar_value_tokens)

        return self._fixed_prompts(seed + (split == MQAR_TRAINED), MQAR_STREAM, MQAR_VALIDATION_PROMPTS, row)

    def _recall_row(
        self, size: int, prompt_size: int, text: np.ndarray, rng: np.random.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(size,) tokens and (size - 1,) targets: ``text``, then a retrieval example of about ``prompt_size``
        tokens from the trained split: 1 .. ``recall_needles`` needles, the first asked, and with several, half
        the time more of them asked in turn after its answer; scored on the answers only."""
        assert self.recall is not None
        fmt, needles = self._recall_format_and_needles(rng)
        while True:
            draw = self.recall.draw(rng, fmt, float(rng.random()), needles)
            asked = [0]
            if needles > 1 and rng.random() < 0.5:
                asked += [int(i) for i in rng.permutation(np.arange(1, needles))[: int(rng.integers(1, needles))]]
            answer = self.recall.answer(draw.values[0])
            follow = [(self.recall.question(draw, i), self.recall.answer(draw.values[i])) for i in asked[1:]]
            tail = len(answer) + sum(len(q) + len(a) for q, a in follow)
            fixed = self.recall.fixed_tokens(draw) + tail
            if fixed <= size or needles == 1:  # a window too short for several needles gets one
                break
            needles = 1
        prompt_size = min(max(prompt_size, fixed), size)
        prompt = self.recall.prompt(draw, prompt_size - tail)
        pieces = [text[: size - prompt_size], prompt.tokens, answer]
        scored = [(len(text[: size - prompt_size]) + len(prompt.tokens), len(answer))]
        for question, reply in follow:
            start = sum(map(len, pieces)) + len(question)
            pieces += [question, reply]
            scored.append((start, len(reply)))
        tokens = torch.from_numpy(np.concatenate(pieces).astype(np.int64))
        targets = torch.full((size - 1,), IGNORE_INDEX, dtype=torch.long)
        for start, count in scored:  # target j is token j + 1
            targets[start - 1 : start - 1 + count] = tokens[start : start + count]
        return tokens, targets

    def _recall_format_and_needles(self, rng: np.random.Generator) -> tuple[str, int]:
        """A training retrieval example's value format (uniform over the builder's) and needles (1 ..
        ``recall_needles``)."""
        assert self.recall is not None
        formats = self.recall.formats()
        return formats[int(rng.integers(len(formats)))], int(rng.integers(1, self.data.recall_needles + 1))

    @staticmethod
    def _passkey_row(
        builder: PassKeyBuilder,
        size: int,
        depth: float,
        rng: np.random.Generator,
        prompt_size: int | None = None,
        text: np.ndarray | None = None,
        distractors: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(size,) tokens and (size - 1,) targets: ``text``, then a pass-key prompt of ``prompt_size`` tokens
        (None: the whole row) with its answer; scored on the answer, and with ``text`` the needle too."""
        key = draw_key(rng)
        answer = builder.answer(key)
        head = min(size - (prompt_size or size), size - len(answer) - builder.shortest(key))
        prompt = builder.prompt(size - head - len(answer), depth, rng, key=key, distractors=distractors)
        assert text is not None or not head  # a prompt shorter than the row follows text
        before: np.ndarray | list[int] = text[:head] if text is not None and head else []
        tokens = torch.from_numpy(np.concatenate([before, prompt.tokens, answer]).astype(np.int64))
        targets = torch.full((size - 1,), IGNORE_INDEX, dtype=torch.long)
        targets[-len(answer) :] = tokens[-len(answer) :]
        if text is not None:  # target j is token j + 1
            needle = slice(head + prompt.needle.start, head + prompt.needle.stop)
            targets[needle.start : needle.stop - 1] = tokens[needle.start + 1 : needle.stop]
        return tokens, targets

    def batch(self, rng: np.random.Generator, step: int) -> Batch:
        length = self.data.length
        if self.data.state_passing:
            windows = self._consecutive_windows(rng)  # (B, L + 1)
        else:
            windows = self.windows.batch(rng, self.batch_size, length)  # (B, L + 1)
        targets = windows[:, 1:].clone()  # (B, L)
        examples = np.zeros(len(windows), dtype=bool)  # the rows given an in-window pass-key or retrieval example
        in_examples = np.zeros(len(windows), dtype=bool)  # ... or a window of an example spanning windows
        if self.spans is None and max(self.data.passkey_span, self.data.recall_span) > 1:
            self.spans = [None] * self.batch_size
        for row, open_example in enumerate(self.spans or ()):
            if open_example is not None:
                self._span_window(row, open_example, windows[row], targets[row], rng)
                in_examples[row] = True
        if self.passkey is not None:
            chosen = rng.random(self.batch_size) < self.passkey_fraction(step)
            for row in np.flatnonzero(chosen & ~in_examples).tolist():
                # a uniform length, the row's text before it
                prompt_size = int(rng.integers(self.shortest_passkey_row, length + 2))
                distractors = int(rng.integers(0, self.data.passkey_distractors + 1))
                in_examples[row] = True
                if self._opens_span(
                    rng, step, self.data.passkey_span, row, windows[row], targets[row], self._passkey_span_start
                ):
                    continue
                windows[row], targets[row] = self._passkey_row(
                    self.passkey, length + 1, float(rng.random()), rng, prompt_size, windows[row].numpy(), distractors
                )
                examples[row] = True
                if self.cursors is not None:  # the row's text goes on after the example
                    self.cursors[row] -= length
        if self.recall is not None:
            self._end_in_examples(
                rng,
                self.data.recall_fraction,
                (windows, targets, examples, in_examples),
                # the prompt's size drawn first, raised to what the example needs
                lambda text: self._recall_row(length + 1, int(rng.integers(1, length + 2)), text, rng),
                lambda row: self._opens_span(
                    rng, step, self.data.recall_span, row, windows[row], targets[row], self._recall_span_start
                ),
            )
        if self.mqar_ids is not None:
            mqar_ids = self.mqar_ids
            self._end_in_examples(
                rng,
                self.data.mqar_fraction,
                (windows, targets, examples, in_examples),
                lambda text: mqar_row(
                    rng,
                    mqar_ids,
                    length + 1,
                    int(rng.integers(1, self.data.mqar_pairs + 1)),
                    text,
                    self.data.mqar_value_tokens,
                ),
            )
        lengths = torch.full((len(windows),), length, dtype=torch.long)
        fresh = None
        if self.data.state_passing and self.data.state_reset:
            fresh = torch.from_numpy(rng.random(len(windows)) < self.data.state_reset)  # (B,)
        if self.data.passkey_fresh:
            fresh = torch.from_numpy(examples) if fresh is None else fresh | torch.from_numpy(examples)
        # not the pass-key rows: the teacher may answer them wrong
        distilled = None if self.teacher is None else torch.from_numpy(~in_examples)
        weights = None
        if self.data.example_weight != 1.0 and examples.any():
            weights = torch.from_numpy(np.where(examples, self.data.example_weight, 1.0).astype(np.float32))  # (B,)
        return Batch(windows[:, :-1], targets, lengths, fresh, distilled, weights)

    def longest_span(self, step: int, most: int) -> int:
        """The most windows an example started at step ``step`` (from 1) may span: growing geometrically from 1 at
        the first step to ``most`` (``passkey_span`` or ``recall_span``) at the run's last."""
        windows: float = most ** self._progress(step)  # int ** float is typed Any
        return max(1, round(windows))

    def _opens_span(
        self,
        rng: np.random.Generator,
        step: int,
        most: int,
        row: int,
        window: torch.Tensor,
        targets: torch.Tensor,
        start: Callable[[np.ndarray, np.random.Generator], tuple[np.ndarray, int, int, OpenExample]],
    ) -> bool:
        """Whether row ``row``, given an example at ``step``, opens one spanning windows (log-uniform over 1 ..
        ``longest_span(step, most)`` windows; never with ``most`` 1). If so its window (in place) begins it:
        ``start(text, rng)`` gives the tokens put in, the place in the window's text they go, how many of their
        first tokens go unscored, and the example (its ``left`` counting this window). The text before and after
        them is scored but for the token after them; the row's text goes on where the window's stopped."""
        if self.spans is None or most <= 1:
            return False
        longest = self.longest_span(step, most)
        span = min(int(math.exp(rng.uniform(0.0, math.log(longest + 1)))), longest)
        if span <= 1:
            return False
        assert self.cursors is not None  # spans come with state passing
        text = window.numpy()  # read before the window is written: the concatenation below copies it
        inserted, place, unscored, example = start(text, rng)
        room = len(window) - len(inserted)
        window.copy_(torch.from_numpy(np.concatenate([text[:place], inserted, text[place:room]]).astype(np.int64)))
        targets.copy_(window[1:])
        targets[max(place - 1, 0) : place + unscored - 1] = IGNORE_INDEX  # target j is token j + 1
        targets[place + len(inserted) - 1] = IGNORE_INDEX  # the text token after them
        self.cursors[row] -= len(inserted)
        self.spans[row] = dataclasses.replace(example, left=span - 1)
        return True

    def _passkey_span_start(
        self, text: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, int, int, OpenExample]:
        """``_opens_span``'s start of a pass-key example: the introduction and the needle at a uniform place, scored
        on the needle after its first token."""
        assert self.passkey is not None
        key = draw_key(rng)
        inserted = np.concatenate([self.passkey.introduction, self.passkey.needle(key)])
        place = int(rng.integers(0, len(text) - len(inserted)))  # a text token after them: the next window's first
        unscored = len(self.passkey.introduction) + 1
        return (
            inserted,
            place,
            unscored,
            OpenExample(0, self.passkey.question.tolist(), self.passkey.answer(key).tolist(), key),
        )

    def _recall_span_start(
        self, text: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, int, int, OpenExample]:
        """``_opens_span``'s start of a retrieval example (the trained split, drawn as ``_recall_row`` draws): its
        introduction and needles with filler between them, of a uniform size that holds them, before the window's
        last text token, unscored; the question for one needle, drawn uniformly, ends the example's last window."""
        assert self.recall is not None
        fmt, needles = self._recall_format_and_needles(rng)
        while True:
            draw = self.recall.draw(rng, fmt, float(rng.random()), needles)
            asked = int(rng.integers(needles))
            question = self.recall.question(draw, asked)
            fixed = self.recall.fixed_tokens(draw, asked) - len(question)
            if fixed < len(text) - 1 or needles == 1:  # a window too short for several needles gets one
                break
            needles = 1
        size = int(rng.integers(fixed, len(text) - 1))  # a text token before them and one after
        hidden = self.recall.prompt(draw, size + len(question), asked).tokens[:size]
        answer = self.recall.answer(draw.values[asked])
        return hidden, len(text) - 1 - size, size, OpenExample(0, question.tolist(), answer.tolist())

    def _span_window(
        self, row: int, example: OpenExample, window: torch.Tensor, targets: torch.Tensor, rng: np.random.Generator
    ) -> None:
        """Row ``row`` is inside ``example``: its text as it is, or (the example's last window) its text (a pass
        key's with up to ``passkey_distractors`` numbers put in) ending in the question, unscored, and the answer."""
        assert self.spans is not None and self.cursors is not None
        if example.left > 1:
            self.spans[row] = dataclasses.replace(example, left=example.left - 1)
            return
        question, answer = np.asarray(example.question), np.asarray(example.answer)
        room = len(window) - len(question) - len(answer)
        text = window.numpy()[:room]
        if example.key is not None:
            assert self.passkey is not None
            distractors = int(rng.integers(0, self.data.passkey_distractors + 1))
            text = self.passkey.with_numbers(text, distractors, example.key, rng)
        window.copy_(torch.from_numpy(np.concatenate([text, question, answer]).astype(np.int64)))
        targets.copy_(window[1:])
        targets[room - 1 : room - 1 + len(question)] = IGNORE_INDEX
        self.cursors[row] -= len(question) + len(answer)
        self.spans[row] = None

    def passkey_fraction(self, step: int) -> float:
        """The chance that a row of step ``step`` (from 1) is a pass-key example."""
        first, final = self.data.passkey_fraction, self.data.passkey_fraction_final
        return first if final is None else first + (final - first) * self._progress(step)

    def _progress(self, step: int) -> float:
        """How far step ``step`` (from 1) is through the run's ``steps``, from 0 to 1 (0 for a run of one step)."""
        return min(max(step - 1, 0) / (self.steps - 1), 1.0) if self.steps > 1 else 0.0

    def _consecutive_windows(self, rng: np.random.Generator) -> torch.Tensor:
        """(B, L + 1) windows, row i's starting where its last one's inputs ended (a random place at first and
        when the text runs out)."""
        tokens, length = self._corpus_tokens(), self.data.length
        if self.cursors is None:
            self.cursors = rng.integers(0, len(tokens) - length, size=self.batch_size)
        ended = self.cursors + length + 1 > len(tokens)
        self.cursors[ended] = rng.integers(0, len(tokens) - length, size=int(ended.sum()))
        index = self.cursors[:, None] + np.arange(length + 1)[None, :]  # (B, L + 1)
        self.cursors = self.cursors + length
        return torch.from_numpy(tokens[index])

    def _end_in_examples(
        self,
        rng: np.random.Generator,
        fraction: float,
        rows: tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray],
        example: Callable[[np.ndarray], tuple[torch.Tensor, torch.Tensor]],
        opens: Callable[[int], bool] | None = None,
    ) -> None:
        """Each row of ``rows`` = (windows (B, L + 1), targets (B, L), examples (B,), in_examples (B,)) not yet in an
        example becomes, with probability ``fraction``, ``example(its window)``: (L + 1,) tokens and (L,) targets, in
        place; it is marked in both masks, and with state passing its text resumes where the example began.
        ``opens(row)``: whether the row instead opened an example spanning windows (marked in ``in_examples``)."""
        windows, targets, examples, in_examples = rows
        chosen = (rng.random(self.batch_size) < fraction) & ~in_examples
        for row in np.flatnonzero(chosen).tolist():
            in_examples[row] = True
            if opens is not None and opens(row):
                continue
            windows[row], targets[row] = example(windows[row].numpy())
            examples[row] = True
            if self.cursors is not None:
                self.cursors[row] -= self.data.length

    @torch.no_grad()
    def evaluate(self, model: SequenceModel, dist: Distributed, batch_size: int = 16) -> Evaluation | None:
        """Validation perplexity and the pass-key accuracy of the fixed prompts (None without evaluation), at most
        ``batch_size`` rows a call and within ``EVALUATION_MEMORY`` by the model's estimate."""
        if self.validation is None:
            return None
        total = 0.0
        rows = evaluation_rows(model, self.data.length, batch_size)
        for start in range(0, len(self.validation), rows):
            chunk = self.validation[start : start + rows].to(dist.device)  # (b, L + 1)
            logits = model(chunk[:, :-1])  # (b, L, V)
            total += float(F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
        loss = total / self.validation[:, 1:].numel()
        figures = {"validation_loss": loss, "validation_perplexity": math.exp(loss)}
        for name, prompts in {**self.passkey_validation, **self.recall_validation, **self.mqar_validation}.items():
            for size, (tokens, targets) in prompts.items():
                figures[f"{name}_{size}"] = _answered(model, tokens, targets, dist, batch_size)
        return Evaluation(figures, score=-loss)

    def checkpoint_config(
        self, architecture: str, model_config: BaseModelConfig, metadata: dict[str, Any]
    ) -> CheckpointConfig:
        return CheckpointConfig(
            architecture=architecture,
            model=model_config,
            kind="generate",
            tokenizer=self.data.tokenizer,
            metadata=metadata,
        )

    def write_files(self, out: Path) -> None:
        if self.ranks_file is not None and self.ranks_file.resolve() != (out / RANKS_FILE).resolve():
            shutil.copyfile(self.ranks_file, out / RANKS_FILE)

    def start_figures(self) -> dict[str, Any]:
        return {"corpus": self.data.corpus, "tokenizer": self.data.tokenizer, "train_tokens": self.train_tokens}

    def metadata(self, run: RunState) -> dict[str, Any]:
        loss = (run.last_evaluation or {}).get("validation_loss")
        return {"train_length": self.data.length, "validation_loss": loss}

    def settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self.data)

    def data_state(self) -> Any:
        if isinstance(self.windows, StreamedWindows):
            return self.windows.state()
        if self.cursors is None:
            return None
        state: dict[str, Any] = {"cursors": self.cursors.tolist()}
        if self.spans is not None:
            state["spans"] = [None if span is None else dataclasses.asdict(span) for span in self.spans]
        return state

    def load_data_state(self, state: Any) -> None:
        if isinstance(self.windows, StreamedWindows):
            self.windows.load_state(state)
        elif state is not None:
            self.cursors = np.asarray(state["cursors"], dtype=np.int64)
            if "spans" in state:
                self.spans = [None if span is None else self._open_example(span) for span in state["spans"]]

    def _open_example(self, saved: Any) -> OpenExample:
        """An open example as ``data_state`` wrote it; a run saved before retrieval spans wrote a pass key's
        [key, windows left]."""
        if isinstance(saved, list):
            assert self.passkey is not None
            key = str(saved[0])
            return OpenExample(int(saved[1]), self.passkey.question.tolist(), self.passkey.answer(key).tolist(), key)
        return OpenExample(int(saved["left"]), saved["question"], saved["answer"], saved["key"])


def _answered(
    model: SequenceModel, tokens: torch.Tensor, targets: torch.Tensor, dist: Distributed, batch_size: int
) -> float:
    """The share of the (N, size + 1) validation rows whose scored ``targets`` (N, size) are all the model's argmax
    (teacher-forced), at most ``batch_size`` rows a call."""
    right, rows = 0, evaluation_rows(model, tokens.shape[1] - 1, batch_size)
    for start in range(0, len(tokens), rows):
        prompts = tokens[start : start + rows, :-1].to(dist.device)  # (b, size)
        chunk = targets[start : start + rows].to(dist.device)  # (b, size)
        scored = chunk != IGNORE_INDEX  # (b, size)
        if model.selects_positions:
            wrong = model(prompts, positions=scored).argmax(dim=-1) != chunk[scored]  # (N,) row-major
            misses = torch.zeros(len(chunk), dtype=torch.long, device=chunk.device)  # (b,)
            misses.index_add_(0, scored.nonzero()[:, 0], wrong.long())
            right += int((misses == 0).sum())
        else:
            logits = model(prompts)  # (b, size, V)
            right += int(((logits.argmax(dim=-1) == chunk) | ~scored).all(dim=1).sum())
    return right / len(tokens)


def evaluation_rows(model: SequenceModel, length: int, limit: int) -> int:
    """How many rows of ``length`` tokens one validation call takes: at most ``limit``, and as many as the model's
    estimate of a parallel pass over them keeps within ``EVALUATION_MEMORY`` (one at least)."""
    return largest_fitting(lambda rows: model.cost("forward", rows, length).nbytes <= EVALUATION_MEMORY, limit)


def check_passkey_length(tokenizer: Tokenizer, length: int) -> int:
    """The fewest tokens a pass-key row (prompt and answer) takes, for any key; a ValueError unless training windows
    of ``length`` tokens hold it."""
    shortest = PassKeyBuilder(tokenizer, np.zeros(1, dtype=np.int64)).shortest() + PASSKEY_ANSWER_TOKENS
    if shortest > length + 1:
        raise ValueError(
            f"pass-key examples need windows of at least {shortest} tokens; --length {length} is too short"
        )
    return shortest


def check_recall_length(tokenizer: Tokenizer, length: int) -> int:
    """The most tokens a one-needle retrieval row of the trained split takes, by
    :meth:`RetrievalBuilder.longest_fixed` and ``RECALL_ANSWER_TOKENS``; a ValueError unless training windows of
    ``length`` tokens hold it."""
    builder = RetrievalBuilder(tokenizer, np.zeros(1, dtype=np.int64), TRAINED)
    longest = builder.longest_fixed(split_formats(TRAINED)) + RECALL_ANSWER_TOKENS
    if longest > length + 1:
        raise ValueError(
            f"retrieval examples need windows of at least {longest} tokens; --length {length} is too short"
        )
    return longest


def checkpoint_tokenizer_name(ranks_file: Path | None, spec: str) -> str:
    """What config.json calls the tokenizer: the copied ranks file, or the tokenizer's own name."""
    return f"{FILE_PREFIX}{RANKS_FILE}" if ranks_file is not None else spec


def validation_tokens(corpus: str, validation_fraction: float, tokenizer: Tokenizer) -> list[np.ndarray]:
    """The held-out tokens, one array per document: the tails of an in-memory corpus's documents, or the
    whole documents of a streamed one (then give a held-out shard)."""
    documents = corpus_documents(corpus)
    if is_streamed(corpus):
        texts = [document.text for document in documents]
    else:
        texts = [split_document(document.text, validation_fraction, "validation") for document in documents]
    return [tokenize_documents([text], tokenizer) for text in texts if text]
