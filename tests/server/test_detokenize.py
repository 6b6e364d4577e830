"""Text deltas with stop strings: held back while they might start a stop string, cut at the stop."""

from __future__ import annotations

from model.tokenizer import load_tokenizer
from server.detokenize import TextAssembler

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
