"""Text deltas with stop strings: held back while they might start a stop string, cut at the stop."""

from __future__ import annotations

import random

from model.tokenizer import load_tokenizer
from server.execution.detokenize import TextAssembler, stop_strings

TOKENIZER = load_tokenizer("bytes", ".")


def run(text: str, stop: list[str]) -> tuple[list[str], bool, str]:
    assembler = TextAssembler(TOKENIZER, stop)
    deltas = []
    for token in TOKENIZER.encode(text):
        delta, stopped = assembler.push(token)
        deltas.append(delta)
        if stopped:
            return deltas, True, ""
    return deltas, False, assembler.finish()


def test_no_stop_strings_release_every_character_at_once() -> None:
    deltas, stopped, rest = run("ab👋", [])
    assert deltas == ["a", "b", "", "", "", "👋"] and not stopped and rest == ""


def test_stop_string_across_tokens_is_cut() -> None:
    deltas, stopped, _ = run("hello\n\nworld", ["\n\n"])
    assert stopped and "".join(deltas) == "hello"
    assert deltas[:5] == ["h", "e", "l", "l", "o"]  # nothing held back before the first "\n"


def test_partial_match_is_released_when_it_fails() -> None:
    deltas, stopped, rest = run("ab\ncd", ["\n\n"])
    assert not stopped and "".join(deltas) + rest == "ab\ncd"
    assert deltas[2] == ""  # "\n" waited for the next token


def test_earliest_of_several_stop_strings_wins() -> None:
    deltas, stopped, _ = run("xxENDyySTOP", ["STOP", "END"])
    assert stopped and "".join(deltas) == "xx"


def test_multibyte_stop_string() -> None:
    deltas, stopped, _ = run("a€b👋c", ["👋"])
    assert stopped and "".join(deltas) == "a€b"


def test_many_tokens_at_once_decode_as_one_by_one() -> None:
    """A whole answer's text decoded at its end equals its deltas joined, a character split across tokens and a cut
    one (U+FFFD at the end) included; a final end-of-text token adds nothing."""
    for token_bytes in ("héllo wörld 👋".encode(), "ab👋".encode()[:-1], b"\xff\xfeok"):
        tokens = list(token_bytes)  # the bytes tokenizer: id = byte
        one_by_one = TextAssembler(TOKENIZER, [])
        expected = "".join(one_by_one.push(token)[0] for token in tokens) + one_by_one.finish()
        at_once = TextAssembler(TOKENIZER, [])
        assert at_once.whole_answer(tokens) == expected == token_bytes.decode(errors="replace")
        assert TextAssembler(TOKENIZER, []).whole_answer([*tokens, TOKENIZER.eot_token]) == expected


def test_the_automaton_stops_where_a_search_of_the_text_would() -> None:
    """Against a plain search: the first stop string to end (the longest of those ending there) is cut, and what is
    held back is the longest tail that begins some stop string, for random strings over a small alphabet."""
    rng = random.Random(0)
    for _ in range(2000):
        stops = sorted({"".join(rng.choice("ab") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 4))})
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 12)))
        assembler = TextAssembler(TOKENIZER, stops)
        released = ""
        for end in range(1, len(text) + 1):
            delta, stopped = assembler.push(TOKENIZER.encode(text[end - 1])[0])
            released += delta
            ending = [stop for stop in stops if text[:end].endswith(stop)]
            if ending:
                assert stopped and released == text[: end - max(map(len, ending))]
                break
            held = max(
                size for size in range(end + 1) if size == 0 or any(s.startswith(text[end - size : end]) for s in stops)
            )
            assert not stopped and released == text[: end - held]


def test_many_stop_strings_cost_no_more_per_character() -> None:
    """The automaton is stepped once per character, whatever the number of strings (a count, not a timing)."""
    stops = [f"{i:05d}!" for i in range(5000)]
    automaton = stop_strings(tuple(stops))
    steps = 0
    original = automaton.step

    def counted(state: int, char: str) -> int:
        nonlocal steps
        steps += 1
        return original(state, char)

    automaton.step = counted
    try:
        _, stopped, _ = run("no stop in this text, 12345 but not followed by the mark", stops)
    finally:
        del automaton.step
    assert not stopped and steps == len("no stop in this text, 12345 but not followed by the mark")
