"""Pass-key prompts (docs/api.md, Long-context probes; Mohtashami & Jaggi's landmark-attention probe), built in
tokens: introduction, filler, needle, filler, question, exactly ``size`` tokens of the model's tokenizer, the needle
at ``depth`` of the filler. The key is a 5-digit number; a greedy completion is right when its first number is the
key. Used by ``text-eval --probe passkey`` and ``text-train --passkey-fraction``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from model.tokenizer import Tokenizer
from training.data.text_batches import cycled

INTRODUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is"
GRASS = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
KEY_DIGITS = 5
DISTRACTOR_PLACES = ("either", "before", "after")  # where PassKeyBuilder.prompt puts its distractor numbers
# Forms a distractor number takes with ``number_forms`` (:meth:`PassKeyBuilder.with_numbers`), as numbers stand in
# prose: {a} has 1 to KEY_DIGITS digits, {b} two, {y} is a year.
NUMBER_FORMS = (" {a}", " {a}-{b}", " in {y}", " in {y}-{b}", " No. {a}", " £{a}", " {a},{b}0", "\n\nCHAPTER {a}\n\n")


@dataclass(frozen=True)
class PassKeyPrompt:
    tokens: np.ndarray  # (size,) int64: the prompt, ending with the question
    answer: np.ndarray  # (n,) int64: " {key}." in the tokenizer's tokens, what a right greedy answer starts with
    key: str
    depth: float  # where the needle is, as a fraction of the filler tokens before it
    needle: slice  # the needle's tokens in ``tokens``


class PassKeyBuilder:
    """Pass-key prompts in one tokenizer over one filler (a token stream, cycled when a prompt needs more)."""

    def __init__(self, tokenizer: Tokenizer, filler: np.ndarray, number_forms: bool = False) -> None:
        """``number_forms``: distractor numbers take the forms of ``NUMBER_FORMS`` (else each is " {a}")."""
        if len(filler) == 0:
            raise ValueError("the pass-key filler holds no tokens")
        self.tokenizer, self.filler = tokenizer, np.asarray(filler, dtype=np.int64)
        self.number_forms = number_forms
        self.introduction = self._encode(INTRODUCTION)
        self.question = self._encode(QUESTION)

    @property
    def fixed_tokens(self) -> int:
        """The tokens of a prompt that are not filler, but for the needle (a few more)."""
        return len(self.introduction) + len(self.question)

    def shortest(self, key: str | None = None) -> int:
        """The fewest tokens a prompt with ``key`` can have (no filler at all); without a key, a bound for any key
        (a key's BPE tokens merge with their neighbours differently: allow every digit a token of its own, twice)."""
        if key is not None:
            return self.fixed_tokens + len(self.needle(key))
        return self.shortest("0" * KEY_DIGITS) + 2 * KEY_DIGITS

    def prompt(
        self,
        size: int,
        depth: float,
        rng: np.random.Generator,
        key: str | None = None,
        distractors: int = 0,
        distractors_at: str = "either",
    ) -> PassKeyPrompt:
        """A prompt of exactly ``size`` tokens with the needle at ``depth`` in [0, 1] of the filler, with up to
        ``distractors`` other numbers "either" side of it (a fair coin each), "before" or "after" it. ValueError on
        a bad depth, place or size."""
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"a pass-key depth is a fraction in [0, 1], not {depth}")
        if distractors_at not in DISTRACTOR_PLACES:
            raise ValueError(f"distractors go {' or '.join(DISTRACTOR_PLACES)} the needle, not {distractors_at!r}")
        key = key if key is not None else draw_key(rng)
        needle = self.needle(key)
        filler_tokens = size - self.fixed_tokens - len(needle)
        if filler_tokens < 0:
            raise ValueError(f"a pass-key prompt needs at least {self.fixed_tokens + len(needle)} tokens, not {size}")
        before = round(depth * filler_tokens)
        filler = cycled(self.filler, int(rng.integers(len(self.filler))), filler_tokens)
        head, tail = filler[:before], filler[before:]
        if distractors:
            after = {"either": int(rng.binomial(distractors, 0.5)), "before": 0, "after": distractors}[distractors_at]
            head = self.with_numbers(head, distractors - after, key, rng)
            tail = self.with_numbers(tail, after, key, rng)
        tokens = np.concatenate([self.introduction, head, needle, tail, self.question])
        start = len(self.introduction) + before
        return PassKeyPrompt(tokens, self.answer(key), key, depth, slice(start, start + len(needle)))

    def needle(self, key: str) -> np.ndarray:
        """The needle naming ``key`` in the tokenizer's tokens."""
        return self._encode(NEEDLE.format(key=key))

    def answer(self, key: str) -> np.ndarray:
        """``" {key}."`` in the tokenizer's tokens: what a right greedy answer starts with."""
        return self._encode(f" {key}.")

    def with_numbers(self, filler: np.ndarray, count: int, key: str, rng: np.random.Generator) -> np.ndarray:
        """``filler`` with up to ``count`` numbers other than ``key`` put in at random places, as long as before;
        fewer when it is too short. A number that would hold the key is the key's first four digits instead."""
        numbers: list[np.ndarray] = []
        for _ in range(count):
            text = self._number(rng)
            encoded = self._encode(text if key not in re.findall(r"\d+", text) else f" {int(key) // 10}")
            if sum(map(len, numbers)) + len(encoded) > len(filler):
                break
            numbers.append(encoded)
        if not numbers:
            return filler
        kept = filler[: len(filler) - sum(map(len, numbers))]
        places = np.sort(rng.integers(0, len(kept) + 1, size=len(numbers)))
        pieces, start = [], 0
        for place, number in zip(places, numbers):
            pieces += [kept[start:place], number]
            start = place
        return np.concatenate(pieces + [kept[start:]])

    def _number(self, rng: np.random.Generator) -> str:
        """A distractor number as text: " {a}", or with ``number_forms`` one of ``NUMBER_FORMS``, drawn uniformly."""
        digits = int(rng.integers(1, KEY_DIGITS + 1))
        number = str(int(rng.integers(10 ** (digits - 1) if digits > 1 else 0, 10**digits)))
        if not self.number_forms:
            return f" {number}"
        form = NUMBER_FORMS[int(rng.integers(len(NUMBER_FORMS)))]
        return form.format(a=number, b=f"{int(rng.integers(100)):02d}", y=int(rng.integers(1500, 2030)))

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text), dtype=np.int64)


def draw_key(rng: np.random.Generator) -> str:
    """A random ``KEY_DIGITS``-digit key (no leading zero)."""
    return str(int(rng.integers(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS)))


def grass_filler(tokenizer: Tokenizer, repeats: int = 64) -> np.ndarray:
    """The classic filler, "The grass is green. ...", repeated: a token stream for :class:`PassKeyBuilder`."""
    return np.asarray(tokenizer.encode(GRASS * repeats), dtype=np.int64)


def first_number(text: str) -> str | None:
    """The first run of digits in ``text`` (the answer a greedy completion gives), or None."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else None
