"""The tasks (docs/api.md, Tasks): alphabet, labels, reference labeler, automaton and string sampler of each.

Every regular task's labels are its automaton's labels sorted, so a compiled task checkpoint's label ids are the
task's. Sampling takes the length, ``p_one`` (the frequency of the alphabet's second symbol) or ``balanced`` (the
final label uniform, then the string uniform among those with that label); modular_arithmetic also takes ``p_times``
(the frequency of "*" among its operators: long products, which uniform strings of the training lengths rarely hold).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType

import numpy as np

from automata import task_automata
from automata.automaton import MooreMachine
from automata.task_automata import DIGITS, INDUCTION_LETTERS, INDUCTION_MARK, NO_KEY, OPERATORS
from training.data import labelers
from training.data.final_label_sampling import FinalLabelSampler

BINARY_LABELS = ("0", "1")
MOD5_LABELS = ("0", "1", "2", "3", "4")
INDUCTION_LABELS = tuple(sorted(NO_KEY + INDUCTION_LETTERS + INDUCTION_MARK))  # "#": after "##", never drawn
DELETANG_TRAIN_LENGTHS = (1, 40)
BHATTAMISHRA_TRAIN_LENGTHS = (1, 50)  # the d* and tomita* tasks
INDUCTION_TRAIN_LENGTHS = (3, 256)  # Mamba's training length (docs/api.md, Long-context probes)
HARD_LENGTHS = (501, 2000)  # the ``hard`` eval protocol's lengths (training/evaluation/evaluate.py)
GROUP_HARD_LENGTHS = (HARD_LENGTHS, (2001, 5000))  # s5_generators, a5_generators: beyond 2000 as well
REJECTION_TRIES = 64

Drawer = Callable[[np.random.Generator, int], str]
FinalLabelDrawer = Callable[[np.random.Generator, int, str], str | None]
SkewedDrawer = Callable[[np.random.Generator, int, float], str]
ProductDrawer = Callable[[np.random.Generator, int, float | None, float], str]  # (rng, length, p_one, p_times)


@dataclass(frozen=True, eq=False)
class Task:
    """One transduction task: a label at every position of a string over ``alphabet``. ``automaton`` is None for
    palindrome, ``draw_with_final_label`` without balanced sampling; ``draw_power_offset`` (induction_heads only)
    puts the decisive position a power of two before the last. ``hard_lengths``: the length ranges of the ``hard``
    eval protocol."""

    name: str
    alphabet: str
    labels: tuple[str, ...]
    train_lengths: tuple[int, int]  # inclusive
    labeler: Callable[[str], list[str]]
    automaton: MooreMachine | None
    draw: Drawer
    draw_with_final_label: FinalLabelDrawer | None
    draw_skewed: SkewedDrawer  # (rng, length, p_one): the ``p_one`` sampling of ``sample``
    shortest_length: int = 1  # the shortest string the generator draws
    draw_power_offset: Drawer | None = None
    draw_products: ProductDrawer | None = None  # modular_arithmetic: "*" among the operators with probability p_times
    hard_lengths: tuple[tuple[int, int], ...] = (HARD_LENGTHS,)

    def label(self, string: str) -> list[str]:
        """The reference label at every position of ``string``."""
        for position, symbol in enumerate(string):
            if symbol not in self.alphabet:
                raise ValueError(
                    f"{self.name}: symbol {symbol!r} at position {position} is not in the alphabet {self.alphabet!r}"
                )
        return self.labeler(string)

    def sample(
        self,
        rng: np.random.Generator,
        length: int,
        p_one: float | None = None,
        balanced: bool = False,
        p_times: float | None = None,
    ) -> str:
        """A string of ``length`` symbols (modular_arithmetic: rounded down to an odd length), skewed by ``p_one``
        and/or ``p_times``, or label-balanced; ValueError on a short length, balanced with a skew, or a task without
        balanced sampling or operators."""
        if length < self.shortest_length:
            raise ValueError(f"length must be at least {self.shortest_length} for {self.name}, got {length}")
        for name, p in (("p_one", p_one), ("p_times", p_times)):
            if p is not None:
                if not 0.0 <= p <= 1.0:
                    raise ValueError(f"{name} must be a probability, got {p}")
                if balanced:
                    raise ValueError(f"{name} and balanced cannot be combined: balanced draws condition on the label")
        if p_times is not None:
            if self.draw_products is None:
                raise ValueError(f"p_times: {self.name} has no operators (only modular_arithmetic has)")
            return self.draw_products(rng, length, p_one, p_times)
        if p_one is not None:
            return self.draw_skewed(rng, length, p_one)
        if balanced:
            if self.draw_with_final_label is None:
                raise ValueError(f"{self.name} offers no balanced sampling")
            string = self.draw_with_final_label(rng, length, self.labels[rng.integers(len(self.labels))])
            if string is not None:
                return string
        return self.draw(rng, length)


def sample_batch(
    task: Task,
    rng: np.random.Generator,
    n: int,
    length_range: tuple[int, int],
    p_one: float | tuple[float, float] | None = None,
    balanced: bool = False,
    p_times: float | tuple[float, float] | None = None,
) -> list[str]:
    """``n`` strings of ``task`` of lengths uniform in ``length_range`` (inclusive); ``p_one`` and ``p_times`` are
    each one probability or a range (lo, hi) each string draws its own from."""
    shortest, longest = length_range
    if not task.shortest_length <= shortest <= longest:
        raise ValueError(
            f"length_range must satisfy {task.shortest_length} <= shortest <= longest for {task.name}, "
            f"got {length_range}"
        )
    lengths = rng.integers(shortest, longest + 1, size=n)
    ones, times = _per_string(rng, n, "p_one", p_one), _per_string(rng, n, "p_times", p_times)
    return [task.sample(rng, int(length), one, balanced, product) for length, one, product in zip(lengths, ones, times)]


def _per_string(
    rng: np.random.Generator, n: int, name: str, p: float | tuple[float, float] | None
) -> list[float | None]:
    """``n`` probabilities: ``p`` itself (or None) for each, or each drawn uniformly from the range ``p``."""
    if not isinstance(p, tuple):
        return [p for _ in range(n)]
    lo, hi = p
    if not 0.0 <= lo <= hi <= 1.0:
        raise ValueError(f"a {name} range must satisfy 0 <= lo <= hi <= 1, got {p}")
    return [float(value) for value in rng.uniform(lo, hi, n)]


def _uniform_symbols(alphabet: str) -> Drawer:
    def draw(rng: np.random.Generator, length: int) -> str:
        return "".join(alphabet[k] for k in rng.integers(len(alphabet), size=length))

    return draw


def _skewed_symbols(alphabet: str, rng: np.random.Generator, length: int, p_one: float) -> str:
    """``length`` independent symbols: ``alphabet[1]`` with probability ``p_one``, every other symbol with
    probability (1 - p_one) / (len(alphabet) - 1)."""
    others = alphabet[:1] + alphabet[2:]
    is_one = rng.random(length) < p_one  # (length,)
    other = rng.integers(len(others), size=length)  # (length,)
    return "".join(alphabet[1] if one else others[k] for one, k in zip(is_one, other))


def _expression(rng: np.random.Generator, length: int, p_one: float | None = None, p_times: float | None = None) -> str:
    """A modular_arithmetic input: digits and operators alternating, odd length (rounded down). Digits are
    uniform, or "1" with probability ``p_one`` and the other four sharing the rest; operators are uniform, or "*"
    with probability ``p_times`` and "+" and "-" sharing the rest."""
    count = (length + 1) // 2
    if p_one is None:
        operands = _uniform_symbols(DIGITS)(rng, count)
    else:
        operands = _skewed_symbols(DIGITS, rng, count, p_one)
    if p_times is None:
        operators = _uniform_symbols(OPERATORS)(rng, len(operands) - 1)
    else:  # "*" as the second symbol, the one _skewed_symbols skews
        operators = _skewed_symbols(OPERATORS[0] + OPERATORS[2] + OPERATORS[1], rng, len(operands) - 1, p_times)
    return "".join(digit + operator for digit, operator in zip(operands, operators)) + operands[-1]


def _induction_heads(rng: np.random.Generator, length: int, p_one: float | None = None) -> str:
    """``length - 1`` letters (uniform, or "b" with probability ``p_one``), the one at a uniformly drawn position
    before the last two replaced by "#" (the letter after it is the key), then "#"."""
    if p_one is None:
        letters = list(_uniform_symbols(INDUCTION_LETTERS)(rng, length - 1))
    else:
        letters = list(_skewed_symbols(INDUCTION_LETTERS, rng, length - 1, p_one))
    letters[rng.integers(length - 2)] = INDUCTION_MARK
    return "".join(letters) + INDUCTION_MARK


def _induction_heads_power_offset(rng: np.random.Generator, length: int) -> str:
    """As :func:`_induction_heads`, with the "#" 2**k positions before the final "#", k uniform over 1 ..
    floor(log2(length - 1)) (so the key is 2**k - 1 positions before it)."""
    letters = list(_uniform_symbols(INDUCTION_LETTERS)(rng, length - 1))
    offset = 2 ** int(rng.integers(1, int(np.log2(length - 1)) + 1))
    letters[length - 1 - offset] = INDUCTION_MARK
    return "".join(letters) + INDUCTION_MARK


def _palindrome_with_final_label(rng: np.random.Generator, length: int, label: str) -> str | None:
    """Positives mirror a uniform first half (exactly uniform); negatives are rejection-sampled, at most
    REJECTION_TRIES times (each try fails with probability at most 1/2 from length 2 on; length 1 has none)."""
    free = _uniform_symbols("01")
    if label == "1":
        half = free(rng, length // 2)
        return half + free(rng, length % 2) + half[::-1]
    for _ in range(REJECTION_TRIES):
        string = free(rng, length)
        if string != string[::-1]:
            return string
    return None


def _regular(
    name: str,
    alphabet: str,
    labels: tuple[str, ...],
    labeler: Callable[[str], list[str]],
    automaton: MooreMachine,
    train_lengths: tuple[int, int] = DELETANG_TRAIN_LENGTHS,
    hard_lengths: tuple[tuple[int, int], ...] = (HARD_LENGTHS,),
) -> Task:
    return Task(
        name,
        alphabet,
        labels,
        train_lengths,
        labeler,
        automaton,
        draw=_uniform_symbols(alphabet),
        draw_with_final_label=FinalLabelSampler(automaton).sample,
        draw_skewed=partial(_skewed_symbols, alphabet),
        hard_lengths=hard_lengths,
    )


def _word_problem(name: str, labeler: Callable[[str], list[str]], automaton: MooreMachine) -> Task:
    """A group's word problem: its labels are the group's elements (docs/api.md, Tasks)."""
    labels = tuple(sorted(set(automaton.output.values())))
    return _regular(name, automaton.alphabet, labels, labeler, automaton, hard_lengths=GROUP_HARD_LENGTHS)


def _build_tasks() -> dict[str, Task]:
    tasks = [
        _regular("parity_check", "01", BINARY_LABELS, labelers.parity_check, task_automata.parity_check()),
        _regular("even_pairs", "ab", BINARY_LABELS, labelers.even_pairs, task_automata.even_pairs()),
        _regular("cycle_navigation", "012", MOD5_LABELS, labelers.cycle_navigation, task_automata.cycle_navigation()),
        Task(
            "modular_arithmetic",
            DIGITS + OPERATORS,
            MOD5_LABELS,
            DELETANG_TRAIN_LENGTHS,
            labelers.modular_arithmetic,
            task_automata.modular_arithmetic(),
            draw=_expression,
            draw_with_final_label=None,  # conditioning would count malformed strings too
            draw_skewed=_expression,
            draw_products=_expression,
        ),
        _regular("sum_mod5", DIGITS, MOD5_LABELS, labelers.sum_mod5, task_automata.sum_mod5()),
        _regular("even_pair_mod5", DIGITS, BINARY_LABELS, labelers.even_pair_mod5, task_automata.even_pair_mod5()),
        *(
            _regular(
                f"d{depth}",
                "ab",
                BINARY_LABELS,
                labelers.dyck(depth),
                task_automata.dyck(depth),
                BHATTAMISHRA_TRAIN_LENGTHS,
            )
            for depth in (2, 3, 4, 12)
        ),
        _regular("tomita3", "01", BINARY_LABELS, labelers.tomita3, task_automata.tomita3(), BHATTAMISHRA_TRAIN_LENGTHS),
        _regular("tomita4", "01", BINARY_LABELS, labelers.tomita4, task_automata.tomita4(), BHATTAMISHRA_TRAIN_LENGTHS),
        _regular("tomita5", "01", BINARY_LABELS, labelers.tomita5, task_automata.tomita5(), BHATTAMISHRA_TRAIN_LENGTHS),
        _regular("tomita6", "01", BINARY_LABELS, labelers.tomita6, task_automata.tomita6(), BHATTAMISHRA_TRAIN_LENGTHS),
        _regular("first", "01", BINARY_LABELS, labelers.first, task_automata.first()),
        _regular("one", "01", BINARY_LABELS, labelers.one, task_automata.one()),
        Task(
            "palindrome",
            "01",
            BINARY_LABELS,
            DELETANG_TRAIN_LENGTHS,
            labelers.palindrome,
            automaton=None,
            draw=_uniform_symbols("01"),
            draw_with_final_label=_palindrome_with_final_label,
            draw_skewed=partial(_skewed_symbols, "01"),
        ),
        Task(
            "induction_heads",
            INDUCTION_LETTERS + INDUCTION_MARK,
            INDUCTION_LABELS,
            INDUCTION_TRAIN_LENGTHS,
            labelers.induction_heads,
            task_automata.induction_heads(),
            draw=_induction_heads,
            draw_with_final_label=None,
            draw_skewed=_induction_heads,
            shortest_length=3,
            draw_power_offset=_induction_heads_power_offset,
        ),
        _word_problem("s5_generators", labelers.s5_generators, task_automata.s5_generators()),
        _word_problem("a5_generators", labelers.a5_generators, task_automata.a5_generators()),
    ]
    return {task.name: task for task in tasks}


TASKS: Mapping[str, Task] = MappingProxyType(_build_tasks())
"""Every task, by name, in the order of docs/api.md's table."""


def get_task(name: str) -> Task:
    """The task called ``name``; a ValueError lists the known ones otherwise."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[name]
