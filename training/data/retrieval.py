"""Retrieval prompts (docs/api.md, Long-context probes): needles stating a value for a key, hidden in a filler,
then a question asking for one key's value. Wordings are composed from parts (introduction, subject, statement,
question); values are numbers of 1-10 digits, letter-and-digit codes or words. Each part list and value format has
a trained half and a held-out half that training never draws from (``SPLITS``); varied training draws add phrases
and letter-and-digit runs (``PHRASE``, ``RUN``). A greedy completion is right when its first value (``first_value``)
is the asked value.

Used by ``text-eval --probe retrieval`` and ``text-train --recall-fraction``.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from model.tokenizer import Tokenizer
from training.data.passkey import INTRODUCTION
from training.data.text_batches import cycled

TRAINED, HELD_OUT = "trained", "held-out"
SPLITS = (TRAINED, HELD_OUT)
MAX_NEEDLES = 16  # needles in one prompt (each needs a key word of its own)
SNAP_TOKENS = 64  # a needle moves up to this many tokens to start after the end of a sentence of the filler
SENTENCE_ENDS = (b".", b"!", b"?", b'"', b"\n")

# Parts of a wording, {"trained": [...], "held-out": [...]}. A subject names what a value belongs to ({key}); a
# statement is a needle ({subject} / {Subject}, {value}); a question ends the prompt, the value follows it after
# a space.
INTRODUCTIONS: dict[str, tuple[str, ...]] = {
    TRAINED: (INTRODUCTION, "Read the text below and answer the question at the end.", ""),
    HELD_OUT: (
        "Some facts are hidden in the story that follows. Find them.",
        "Below is a long document. A question about it comes at the end.",
    ),
}
SUBJECTS: dict[str, tuple[str, ...]] = {
    TRAINED: (
        "the special magic number for {key}",
        "the secret code of {key}",
        "the password for {key}",
        "the value kept for {key}",
        "the access code for {key}",
        "the number that belongs to {key}",
    ),
    HELD_OUT: (
        "the hidden token of {key}",
        "the lucky number of {key}",
        "the reference of {key}",
        "the combination for {key}",
    ),
}
STATEMENTS: dict[str, tuple[str, ...]] = {
    TRAINED: (
        "{Subject} is {value}.",
        "Remember this: {subject} is {value}.",
        "Note that {subject} is {value}. Keep it in mind.",
        "{Subject}: {value}.",
        "It is known that {subject} is {value}.",
    ),
    HELD_OUT: (
        "For the record, {subject} is {value}.",
        "Write this down: {subject} is {value}. {Subject} is {value}.",
        "Please memorise {subject}, which is {value}.",
        "{Subject} was set to {value}.",
    ),
}
QUESTIONS: dict[str, tuple[str, ...]] = {
    TRAINED: (
        "What is {subject}? {Subject} is",
        "Question: what is {subject}? Answer:",
        "Tell me {subject}. It is",
        "What was {subject}? It was",
    ),
    HELD_OUT: (
        "Do you remember {subject}? It is",
        "Recall {subject}. The answer is",
        "Which value is {subject}? {Subject} is",
        "Now say {subject}:",
    ),
}
KEYS = {
    TRAINED: (
        "apple",
        "river",
        "lantern",
        "garden",
        "window",
        "candle",
        "meadow",
        "pencil",
        "harbour",
        "violin",
        "mirror",
        "basket",
        "castle",
        "thunder",
        "feather",
        "island",
        "marble",
        "orchard",
        "pepper",
        "saddle",
        "ribbon",
        "tulip",
        "wagon",
        "whistle",
        "anchor",
        "barrel",
        "cellar",
        "dragon",
        "engine",
        "falcon",
        "glacier",
        "hammer",
        "jacket",
        "kettle",
        "ladder",
        "magnet",
        "needle",
        "oyster",
        "parrot",
        "rocket",
    ),
    HELD_OUT: (
        "compass",
        "blanket",
        "chimney",
        "dolphin",
        "emerald",
        "fountain",
        "gazelle",
        "helmet",
        "igloo",
        "jasmine",
        "kayak",
        "lobster",
        "mustard",
        "nutmeg",
        "olive",
        "pelican",
        "quartz",
        "raven",
        "sparrow",
        "tunnel",
    ),
}
WORDS = {  # values of the "word" format
    TRAINED: (
        "amber",
        "breeze",
        "copper",
        "dusk",
        "ember",
        "frost",
        "gravel",
        "hazel",
        "indigo",
        "jewel",
        "kernel",
        "linen",
        "maple",
        "nectar",
        "onyx",
        "pebble",
        "quill",
        "rustle",
        "silver",
        "timber",
        "umber",
        "velvet",
        "willow",
        "yarrow",
        "zephyr",
        "cobalt",
        "crimson",
    ),
    HELD_OUT: (
        "bramble",
        "cinder",
        "drizzle",
        "flint",
        "heron",
        "juniper",
        "lilac",
        "moss",
        "plume",
        "russet",
        "thistle",
        "walnut",
    ),
}
NUMBER_DIGITS = {TRAINED: (1, 2, 3, 5, 6, 8, 9, 10), HELD_OUT: (4, 7)}
CODE_SHAPES = {  # L: an upper-case letter, D: a digit, others as they are
    TRAINED: ("LLDD", "LDL-DLD", "DDLL-LD", "LLL-DDD"),
    HELD_OUT: ("LDDL", "DLD-LLD-D"),
}
VALUE_FAMILIES = ("number", "code", "word")
FIRST_VALUE = re.compile(r"[A-Za-z0-9]+(?:-[A-Za-z0-9]+)*")
PHRASE = "phrase"  # the value format of varied draws: 1 .. PHRASE_WORDS words of the filler's vocabulary
PHRASE_WORDS = 3
# the other format of varied draws: a run of letters of either case and digits, a lower-case letter and a digit
# present, of any length in RUN_CHARS, so that the copy learns to end where the value ends; it can never equal a
# number, a code (all upper-case) or a word of either split
RUN = "run"
RUN_CHARS = (2, 12)
VARIED_FORMATS = (PHRASE, RUN)  # the formats only varied draws give
# how a varied draw composes its subject from vocabulary words (the split's subjects have this shape too)
VARIED_SUBJECTS = ("the {0} of {{key}}", "the {0} {1} of {{key}}", "the {0} for {{key}}", "the {0} {1} for {{key}}")


def split_formats(split: str) -> tuple[str, ...]:
    """The value formats of ``split``: ``number-N`` for its digit counts, then ``code`` and ``word``."""
    return (*(f"number-{digits}" for digits in NUMBER_DIGITS[split]), "code", "word")


def value_family(fmt: str) -> str:
    """The family of a value format: "number" for "number-4", else the format itself."""
    return fmt.partition("-")[0]


def formats_named(names: str, split: str) -> tuple[str, ...]:
    """ "number,code" or "number-4,word": formats of ``split`` (a family names all of its formats there).
    ValueError naming one that is not in the split."""
    available = split_formats(split)
    chosen: list[str] = []
    for name in names.split(","):
        matches = [fmt for fmt in available if fmt == name or value_family(fmt) == name]
        if not matches:
            raise ValueError(f"value format {name!r} is not in the {split} split: {', '.join(available)}")
        chosen += [fmt for fmt in matches if fmt not in chosen]
    return tuple(chosen)


def held_out_words() -> frozenset[str]:
    """Every word of four letters or more in the held-out half of the parts, keys and word values: what varied
    draws (``Vocabulary``) never use."""
    texts = [
        *(text for part in (INTRODUCTIONS, SUBJECTS, STATEMENTS, QUESTIONS) for text in part[HELD_OUT]),
        *KEYS[HELD_OUT],
        *WORDS[HELD_OUT],
    ]
    return frozenset(word for text in texts for word in re.findall(r"[a-z]{4,}", text.lower()))


class Vocabulary:
    """The lower-case words (4-12 letters) of a filler text, less ``held_out_words``: varied draws of the trained
    split take keys, subject words and phrase values from it, so that training asks for any word, not a list's."""

    def __init__(self, tokenizer: Tokenizer, filler: np.ndarray) -> None:
        """ValueError when the filler holds fewer than ``2 * MAX_NEEDLES`` such words."""
        text = tokenizer.decode(np.asarray(filler).tolist())
        words = sorted(set(re.findall(r"\b[a-z]{4,12}\b", text)) - held_out_words())
        if len(words) < 2 * MAX_NEEDLES:
            raise ValueError(
                f"the text holds {len(words)} different lower-case words of 4-12 letters: varied retrieval "
                f"draws need at least {2 * MAX_NEEDLES}"
            )
        self.words = tuple(words)

    def pick(self, rng: np.random.Generator, count: int) -> list[str]:
        """``count`` different words."""
        return [self.words[i] for i in rng.choice(len(self.words), size=count, replace=False)]

    def subject(self, rng: np.random.Generator) -> str:
        """A subject ("the {w} of {key}", "the {w} {w} for {key}", ...) of vocabulary words."""
        shape = VARIED_SUBJECTS[int(rng.integers(len(VARIED_SUBJECTS)))]
        return shape.format(*self.pick(rng, 2))

    def phrase(self, rng: np.random.Generator) -> str:
        """1 .. ``PHRASE_WORDS`` vocabulary words joined by spaces."""
        return " ".join(self.pick(rng, int(rng.integers(1, PHRASE_WORDS + 1))))


def draw_value(fmt: str, split: str, rng: np.random.Generator) -> str:
    """A value of format ``fmt`` (``split_formats``) from ``split``'s half of its family."""
    family, _, digits = fmt.partition("-")
    if family == "number":
        count = int(digits)
        return str(int(rng.integers(10 ** (count - 1) if count > 1 else 0, 10**count)))
    if family == "code":
        shape = CODE_SHAPES[split][int(rng.integers(len(CODE_SHAPES[split])))]
        letters, numbers = "ABCDEFGHJKLMNPQRSTUVWXYZ", "0123456789"
        return "".join(
            letters[int(rng.integers(len(letters)))]
            if char == "L"
            else numbers[int(rng.integers(10))]
            if char == "D"
            else char
            for char in shape
        )
    if family == "word":
        return WORDS[split][int(rng.integers(len(WORDS[split])))]
    raise ValueError(f"unknown value format {fmt!r}")


def draw_run(rng: np.random.Generator) -> str:
    """A ``RUN`` value: ``RUN_CHARS`` letters of either case and digits, at least one lower-case letter and one
    digit (upper-case letters are copied too, and the run is never all upper-case: never a code)."""
    lower, digits = string.ascii_lowercase, string.digits
    any_char = string.ascii_letters + digits
    length = int(rng.integers(RUN_CHARS[0], RUN_CHARS[1] + 1))
    chars = [any_char[int(rng.integers(len(any_char)))] for _ in range(length - 2)]
    chars += [lower[int(rng.integers(len(lower)))], digits[int(rng.integers(len(digits)))]]
    return "".join(chars[i] for i in rng.permutation(length))


def first_value(text: str) -> str | None:
    """The first value in ``text`` (a run of letters and digits, hyphens inside it), or None."""
    match = FIRST_VALUE.search(text)
    return match.group(0) if match else None


# How an answer (a completion's first value) relates to the asked value, tried in this order: the value itself,
# another needle's value, the value with more after it ("62808" for 6280), a start of it ("657407" for 6574078),
# no value at all, anything else
OUTCOMES = ("right", "other_needle", "ran_on", "cut_short", "no_value", "other")


def outcome(answer: str | None, value: str, values: tuple[str, ...] = ()) -> str:
    """The ``OUTCOMES`` name of ``answer`` for the asked ``value``; ``values``: every needle's of the prompt."""
    if answer == value:
        return "right"
    if answer is None:
        return "no_value"
    if answer in values:
        return "other_needle"
    if answer.startswith(value):
        return "ran_on"
    if value.startswith(answer):
        return "cut_short"
    return "other"


def matched(answer: str | None, value: str) -> int:
    """How many leading characters of ``value`` the ``answer`` has right, before its first wrong one (or its end)."""
    if answer is None:
        return 0
    return next((i for i, (a, b) in enumerate(zip(answer, value)) if a != b), min(len(answer), len(value)))


@dataclass(frozen=True)
class Wording:
    """One way to hide and ask: an introduction, a statement (the needle) and a question, with a subject."""

    introduction: str
    statement: str  # with {value}, and {subject}/{Subject} or {key}
    question: str  # with {subject}/{Subject} or {key}; the value follows it after a space
    subject: str = "{key}"
    name: str = ""  # how reports name it

    def needle(self, key: str, value: str) -> str:
        return " " + self._fill(self.statement, key, value)

    def ask(self, key: str) -> str:
        return " " + self._fill(self.question, key, "")

    def _fill(self, text: str, key: str, value: str) -> str:
        subject = self.subject.format(key=key)
        return text.format(subject=subject, Subject=subject[:1].upper() + subject[1:], key=key, value=value)


def wordings_from_file(path: Path) -> list[Wording]:
    """Wordings from a JSON list of {"needle": ..., "question": ..., "introduction": ... (optional)}, with
    ``{value}`` in each needle and ``{key}`` in both or neither. ValueError naming what is wrong."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"wordings file {path}: {error}") from None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"wordings file {path}: expected a non-empty JSON list of objects")
    wordings = []
    for index, entry in enumerate(entries):
        where = f"wordings file {path}, entry {index}"
        if not isinstance(entry, dict) or not all(isinstance(entry.get(name), str) for name in ("needle", "question")):
            raise ValueError(f"{where}: needs the strings 'needle' and 'question'")
        needle, question, introduction = entry["needle"], entry["question"], entry.get("introduction", "")
        if not isinstance(introduction, str):
            raise ValueError(f"{where}: 'introduction' must be a string")
        fields = {name: _fields(text, where) for name, text in (("needle", needle), ("question", question))}
        if "value" not in fields["needle"]:
            raise ValueError(f"{where}: the needle {needle!r} has no {{value}} placeholder")
        if "value" in fields["question"]:
            raise ValueError(f"{where}: the question {question!r} must not hold {{value}} (the answer follows it)")
        unknown = (fields["needle"] | fields["question"]) - {"value", "key"}
        if unknown:
            raise ValueError(f"{where}: unknown placeholder {{{sorted(unknown)[0]}}}: use {{value}} and {{key}}")
        if ("key" in fields["needle"]) != ("key" in fields["question"]):
            raise ValueError(f"{where}: {{key}} must be in both the needle and the question, or in neither")
        wordings.append(Wording(introduction, needle, question, name=f"{path.name}#{index}"))
    return wordings


def _fields(text: str, where: str) -> set[str]:
    """The placeholders of ``text``. ValueError on a malformed one."""
    try:
        return {name for _, name, _, _ in string.Formatter().parse(text) if name is not None}
    except ValueError as error:
        raise ValueError(f"{where}: {text!r}: {error}") from None


def keyed(wording: Wording) -> bool:
    """Whether the wording names a key (several needles need one each)."""
    names_subject = "{subject}" in wording.statement or "{Subject}" in wording.statement
    return "{key}" in wording.statement or ("{key}" in wording.subject and names_subject)


@dataclass(frozen=True)
class Draw:
    """What one prompt (or one haystack asked about each of its needles) hides: the same for every size."""

    wording: Wording
    fmt: str
    keys: tuple[str, ...]
    values: tuple[str, ...]
    depths: tuple[float, ...]  # each needle's, as a fraction of the filler before it
    filler_start: int


@dataclass(frozen=True)
class RetrievalPrompt:
    tokens: np.ndarray  # (size,) int64, ending with the question
    answer: np.ndarray  # " {value}." in the tokenizer's tokens
    value: str
    key: str
    fmt: str
    wording: str
    depth: float  # the asked needle's
    asked: int  # which needle of the draw is asked
    needles: tuple[slice, ...] = field(default=())  # each needle's tokens in ``tokens``, in the draw's order
    values: tuple[str, ...] = field(default=())  # each needle's value, in the draw's order


class RetrievalBuilder:
    """Retrieval prompts over one filler token stream (cycled when a prompt needs more), from one split's parts
    or from given wordings."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        filler: np.ndarray,
        split: str,
        wordings: list[Wording] | None = None,
        varied: float = 0.0,
    ) -> None:
        """``varied``: the trained split only, the chance that a draw takes its keys, its subject's words and (in
        the ``PHRASE`` format) its values from the filler's ``Vocabulary`` instead of the split's lists."""
        if len(filler) == 0:
            raise ValueError("the retrieval filler holds no tokens")
        if split not in SPLITS:
            raise ValueError(f"a split is {' or '.join(SPLITS)}, not {split!r}")
        if varied and split != TRAINED:
            raise ValueError(f"varied draws are of the {TRAINED} split, not {split!r}")
        self.tokenizer, self.filler, self.split = tokenizer, np.asarray(filler, dtype=np.int64), split
        self.wordings = wordings
        self.varied = varied
        self.vocabulary = Vocabulary(tokenizer, self.filler) if varied else None
        self._ends: dict[int, bool] = {}  # token -> whether it ends a sentence

    def formats(self) -> tuple[str, ...]:
        """The value formats training draws from: the split's, and ``PHRASE`` and ``RUN`` with varied draws."""
        return (*split_formats(self.split), *(VARIED_FORMATS if self.vocabulary else ()))

    def wording(self, rng: np.random.Generator, needles: int = 1, subject: str | None = None) -> Wording:
        """A wording drawn from the given ones or composed from the split's parts (keyed if ``needles`` > 1), with
        ``subject`` instead of the split's when given."""
        if self.wordings is not None:
            usable = [w for w in self.wordings if needles == 1 or keyed(w)]
            if not usable:
                raise ValueError("several needles need wordings with {key} in the needle and the question")
            return usable[int(rng.integers(len(usable)))]
        parts = [INTRODUCTIONS, SUBJECTS, STATEMENTS, QUESTIONS]
        picks = [int(rng.integers(len(part[self.split]))) for part in parts]
        introduction, split_subject, statement, question = (part[self.split][i] for part, i in zip(parts, picks))
        name = "{}.{}.{}.{}".format(*picks) if subject is None else "{}.varied.{}.{}".format(*picks[::2], picks[3])
        return Wording(introduction, statement, question, subject or split_subject, name=name)

    def draw(
        self, rng: np.random.Generator, fmt: str, depth: float, needles: int = 1, wording: Wording | None = None
    ) -> Draw:
        """The first needle at ``depth``, the others (distractors with keys and values of their own) at uniform
        depths. A ``PHRASE`` or ``RUN`` value makes the draw varied; other formats are, with the chance ``varied``."""
        if not 1 <= needles <= MAX_NEEDLES:
            raise ValueError(f"a prompt holds 1 to {MAX_NEEDLES} needles, not {needles}")
        vocabulary = self.vocabulary
        if fmt in VARIED_FORMATS and vocabulary is None:
            raise ValueError(f"the {fmt!r} format needs varied draws")
        varied = vocabulary is not None and (fmt in VARIED_FORMATS or rng.random() < self.varied)
        if vocabulary is not None and varied:
            wording = wording or self.wording(rng, needles, vocabulary.subject(rng))
            keys = tuple(vocabulary.pick(rng, needles))
        else:
            wording = wording or self.wording(rng, needles)
            chosen = rng.choice(len(KEYS[self.split]), size=needles, replace=False)
            keys = tuple(KEYS[self.split][i] for i in chosen)
        values: list[str] = []
        while len(values) < needles:
            if fmt == RUN:
                value = draw_run(rng)
            elif vocabulary is not None and fmt == PHRASE:
                value = vocabulary.phrase(rng)
            else:
                value = draw_value(fmt, self.split, rng)
            if value not in values or len(values) >= _distinct_values(fmt, self.split):
                values.append(value)
        depths = (depth, *(float(d) for d in rng.random(needles - 1)))
        return Draw(wording, fmt, keys, tuple(values), depths, int(rng.integers(len(self.filler))))

    def prompt(self, draw: Draw, size: int, asked: int = 0) -> RetrievalPrompt:
        """The draw as a prompt of exactly ``size`` tokens asking for needle ``asked``. ValueError when ``size`` is
        too small."""
        intro, needles, question = self._pieces(draw, asked)
        count = size - len(intro) - sum(map(len, needles)) - len(question)
        if count < 0:
            raise ValueError(f"a retrieval prompt needs at least {size - count} tokens here, not {size}")
        filler = cycled(self.filler, draw.filler_start, count)
        places = self._snapped(filler, [round(depth * count) for depth in draw.depths])
        order = sorted(range(len(needles)), key=lambda i: (places[i], i))
        pieces, slices, start, written = [intro], [slice(0, 0)] * len(needles), 0, len(intro)
        for i in order:
            pieces.append(filler[start : places[i]])
            written += places[i] - start
            pieces.append(needles[i])
            slices[i] = slice(written, written + len(needles[i]))
            written += len(needles[i])
            start = places[i]
        pieces += [filler[start:], question]
        value = draw.values[asked]
        return RetrievalPrompt(
            np.concatenate(pieces).astype(np.int64),
            self.answer(value),
            value,
            draw.keys[asked],
            draw.fmt,
            draw.wording.name,
            draw.depths[asked],
            asked,
            tuple(slices),
            draw.values,
        )

    def _snapped(self, filler: np.ndarray, places: list[int]) -> list[int]:
        """Each place in ``filler`` moved to the nearest one after a sentence's end, within ``SNAP_TOKENS``."""
        window = np.unique(np.concatenate([filler[max(p - SNAP_TOKENS - 1, 0) : p + SNAP_TOKENS] for p in places]))
        for token in window.tolist():
            if token not in self._ends:
                self._ends[token] = self.tokenizer.token_bytes(token).rstrip(b" ").endswith(SENTENCE_ENDS)
        snapped = []
        for place in places:
            low, high = max(place - SNAP_TOKENS, 1), min(place + SNAP_TOKENS, len(filler))
            after_end = [p for p in range(low, high + 1) if self._ends[int(filler[p - 1])]]
            snapped.append(min(after_end, key=lambda p: abs(p - place)) if after_end else place)
        return snapped

    def longest_fixed(self, formats: tuple[str, ...], needles: int = 1, draws: int = 64) -> int:
        """A bound on the tokens besides filler of a prompt with these formats and needles: the most over ``draws``
        draws per format, each needle asked, plus 8 (keys and values merge with their neighbours differently)."""
        rng = np.random.default_rng(0)
        longest = 0
        for fmt in formats:
            for _ in range(draws):
                draw = self.draw(rng, fmt, 0.5, needles)
                longest = max(longest, *(self.fixed_tokens(draw, asked) for asked in range(needles)))
        return longest + 8

    def fixed_tokens(self, draw: Draw, asked: int = 0) -> int:
        """The tokens of the draw's prompt that are not filler."""
        intro, needles, question = self._pieces(draw, asked)
        return len(intro) + sum(map(len, needles)) + len(question)

    def _pieces(self, draw: Draw, asked: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
        """The introduction, each needle and the question asking for needle ``asked``, in tokens."""
        needles = [self._encode(draw.wording.needle(key, value)) for key, value in zip(draw.keys, draw.values)]
        introduction = "\n\n" + draw.wording.introduction + ("\n\n" if draw.wording.introduction else "")
        return self._encode(introduction), needles, self.question(draw, asked)

    def question(self, draw: Draw, asked: int) -> np.ndarray:
        """The question asking for needle ``asked``, in tokens."""
        return self._encode(draw.wording.ask(draw.keys[asked]))

    def answer(self, value: str) -> np.ndarray:
        """``" {value}."`` in the tokenizer's tokens: what a right greedy answer starts with."""
        return self._encode(f" {value}.")

    def _encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text) if text else [], dtype=np.int64)


def _distinct_values(fmt: str, split: str) -> int:
    """How many different values ``fmt`` can take (the draw repeats one only past that)."""
    family, _, digits = fmt.partition("-")
    if family == PHRASE:
        return 10**4
    if family == "number":  # int ** int is typed Any in typeshed (a negative power is a float)
        count: int = 10 ** int(digits) - (10 ** (int(digits) - 1) if int(digits) > 1 else 0)
        return count
    return len(WORDS[split]) if family == "word" else 10**4
