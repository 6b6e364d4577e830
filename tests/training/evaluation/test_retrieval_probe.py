"""Retrieval prompts (training/data/retrieval.py), ``text-eval --probe retrieval`` and ``text-train
--recall-fraction``: prompt sizes and needle places, the two splits kept apart, exact scoring with hand-made models,
wordings files, the report, training rows scored on their answers only, and bad input. No network."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.tokenizer import Tokenizer, load_tokenizer
from tests.training.probe_models import BYTES, REPO, Answerer, save_tiny_lrnn
from training.cli.main import main
from training.data.batches import IGNORE_INDEX
from training.data.passkey import grass_filler
from training.data.retrieval import (
    CODE_SHAPES,
    HELD_OUT,
    INTRODUCTIONS,
    KEYS,
    NUMBER_DIGITS,
    PHRASE,
    QUESTIONS,
    RUN,
    SPLITS,
    STATEMENTS,
    SUBJECTS,
    TRAINED,
    WORDS,
    RetrievalBuilder,
    Vocabulary,
    first_value,
    formats_named,
    held_out_words,
    matched,
    outcome,
    split_formats,
    wordings_from_file,
)
from training.evaluation.retrieval_probe import RetrievalProbe, cell_prompts, format_retrieval_table, probe_checkpoint
from training.evaluation.text_plots import _cell, _families
from training.objectives.distributed import setup_distributed
from training.objectives.language_model import LanguageModelObjective, TextData

pytestmark = pytest.mark.usefixtures("no_network")
CPU = setup_distributed("cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_tiny_lrnn(tmp_path_factory.mktemp("tiny-lrnn"))


AUSTEN_8K = load_tokenizer("file:tokenizer.tiktoken", REPO / "checkpoints/text-lrnn")
ALL_WORDS = "|".join(word for split in SPLITS for word in WORDS[split])
VALUE = re.compile(rf"\b(\d+|[A-Z0-9]+(?:-[A-Z0-9]+)+|[A-Z0-9]*\d[A-Z0-9]*|{ALL_WORDS})\b")


def read_asked(text: str) -> str | None:
    """What a perfect retriever answers: the value the needle of the last key named (the question's) states."""
    keys = [key for split in SPLITS for key in KEYS[split]]
    named = [(m.start(), m.group(0)) for m in re.finditer(rf"\b({'|'.join(keys)})\b", text)]
    if len(named) < 2:
        return None
    key = named[-1][1]
    first = next(start for start, name in named if name == key)
    match = VALUE.search(text, first + len(key))
    return match.group(0) if match else None


def read_last(text: str) -> str | None:
    """A model that answers the last value it read before the question."""
    keys = [key for split in SPLITS for key in KEYS[split]]
    named = list(re.finditer(rf"\b({'|'.join(keys)})\b", text))
    values = VALUE.findall(text[: named[-1].start()]) if len(named) >= 2 else []
    return values[-1] if values else None


@pytest.mark.parametrize("tokenizer", [BYTES, AUSTEN_8K], ids=["bytes", "austen-8k"])
@pytest.mark.parametrize("split", SPLITS)
def test_a_prompt_is_size_tokens_and_hides_each_needle_near_its_depth(tokenizer: Tokenizer, split: str) -> None:
    builder = RetrievalBuilder(tokenizer, grass_filler(tokenizer), split)
    rng = np.random.default_rng(3)
    for fmt in split_formats(split):
        draw = builder.draw(rng, fmt, 0.3, needles=3)
        assert len(set(draw.keys)) == 3 and len(set(draw.values)) == 3
        for size in (builder.longest_fixed((fmt,), 3) + 50, 2000):
            for asked in range(3):
                prompt = builder.prompt(draw, size, asked)
                assert prompt.tokens.shape == (size,) and prompt.value == draw.values[asked]
                text = tokenizer.decode(prompt.tokens.tolist())
                assert text.endswith(draw.wording.ask(draw.keys[asked]))
                needle = tokenizer.decode(prompt.tokens[prompt.needles[asked]].tolist())
                assert needle == draw.wording.needle(draw.keys[asked], prompt.value)
                filler = size - builder.fixed_tokens(draw, asked)
                before = prompt.needles[0].start - len(builder._pieces(draw, asked)[0])
                before -= sum(s.stop - s.start for s in prompt.needles if s.start < prompt.needles[0].start)
                assert abs(before - 0.3 * filler) <= 64  # moved to a sentence's end within 64 tokens
                assert first_value(tokenizer.decode(prompt.answer.tolist())) == prompt.value


def test_the_held_out_split_shares_no_part_or_value_with_the_trained_one() -> None:
    for parts in (INTRODUCTIONS, SUBJECTS, STATEMENTS, QUESTIONS, KEYS, WORDS, NUMBER_DIGITS, CODE_SHAPES):
        assert not set(parts[TRAINED]) & set(parts[HELD_OUT])
    assert len(STATEMENTS[HELD_OUT]) * len(QUESTIONS[HELD_OUT]) * len(SUBJECTS[HELD_OUT]) >= 8
    assert {fmt.split("-")[0] for fmt in split_formats(HELD_OUT)} == {"number", "code", "word"}
    assert sorted(NUMBER_DIGITS[TRAINED] + NUMBER_DIGITS[HELD_OUT]) == list(range(1, 11))
    assert formats_named("number,word", HELD_OUT) == ("number-4", "number-7", "word")
    with pytest.raises(ValueError, match="value format 'number-4' is not in the trained split"):
        formats_named("number-4", TRAINED)


def test_first_value_is_the_first_run_of_letters_and_digits() -> None:
    assert first_value(" 4411. Remember") == "4411"
    assert first_value(' "QX7-41B", it is') == "QX7-41B"
    assert first_value(" pebble.") == "pebble"
    assert first_value(" the number 12") == "the" and first_value(" ...") is None


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("6280", "right"),
        ("62808", "ran_on"),
        ("628", "cut_short"),
        ("6279", "other"),
        (None, "no_value"),
        ("1234", "other_needle"),
        ("62801", "other_needle"),  # another needle's value before running on
    ],
)
def test_an_answer_is_right_or_says_how_it_is_wrong(answer: str | None, expected: str) -> None:
    assert outcome(answer, "6280", ("1234", "6280", "62801")) == expected


def test_matched_counts_the_characters_right_before_the_first_wrong_one() -> None:
    assert [matched(a, "6574078") for a in ("6574078", "657407", "65740789", "6574178", "9", None)] == [
        7,
        6,
        7,
        4,
        0,
        0,
    ]


@pytest.mark.parametrize(
    "read, needles, ask, expected, say",
    [
        (read_asked, 1, "one", "all", " {}."),
        (read_asked, 3, "each", "all", " {}."),
        (read_last, 3, "each", "last", " {}."),
        (read_asked, 1, "one", "ran_on", " {}9."),
    ],
)
def test_a_retriever_scores_right_and_a_last_value_reader_only_where_the_needle_is_last(
    checkpoint: Path,
    read,
    needles: int,
    ask: str,
    expected: str,
    say: str,
) -> None:
    loaded = load_checkpoint(checkpoint)
    loaded.model = Answerer(loaded.config.model, BYTES, say.format, read=read)
    probe = RetrievalProbe(
        sizes=(700, 900),
        depths=(0.0, 0.5, 1.0),
        fillers=("grass",),
        splits=SPLITS,
        needles=needles,
        ask=ask,
        trials=3,
        max_memory=2**22,
    )
    reports = probe_checkpoint(loaded, BYTES, {"grass": grass_filler(BYTES)}, probe)
    assert [report["split"] for report in reports] == list(SPLITS)
    for report in reports:
        builder = RetrievalBuilder(BYTES, grass_filler(BYTES), report["split"])
        for size, row in zip(probe.sizes, report["fillers"][0]["sizes"]):
            assert row["total"] == 9 * (needles if ask == "each" else 1)
            prompts = cell_prompts(builder, probe, "grass", size)  # the probe's own prompts, drawn again
            trials = [trial for cell in row["depths"] for trial in cell["trials"]]
            right = [trial["right"] for trial in trials]
            outcomes = {trial["outcome"] for trial in trials}
            if expected == "all":
                assert all(right) and outcomes == {"right"}
            elif expected == "ran_on":  # every value said with a digit more
                assert not any(right) and outcomes == {"ran_on"}
            else:  # right exactly where the asked needle is the last one before the question, another's elsewhere
                last = [p.needles.index(max(p.needles, key=lambda s: s.start)) for p in prompts]
                assert right == [p.asked == n for p, n in zip(prompts, last)] and 0 < sum(right) < len(right)
                assert outcomes == {"right", "other_needle"}
            assert sum(counts["total"] for counts in row["formats"].values()) == row["total"]
            for fmt, counts in row["formats"].items():
                assert sum(counts["outcomes"].values()) == counts["total"]
                assert counts["outcomes"]["right"] == counts["right"]
                of_format = [trial for trial in trials if trial["format"] == fmt]
                assert counts["characters"] == sum(len(trial["value"]) for trial in of_format)
                assert counts["matched"] == sum(trial["matched"] for trial in of_format)
                if expected != "last":  # right, or right to the value's end and on: every character matched
                    assert counts["matched"] == counts["characters"]
    table = format_retrieval_table(reports)
    assert "| model | split | filler | 700 | 900 |" in table and f"| {HELD_OUT}" in table
    header, _, *rows = table.split("\n\n")[2].splitlines()
    assert header == (
        "| model | split | format | right | other needle | ran on | cut short | no value | other "
        "| characters right before the first wrong one |"
    )
    drawn = {
        (report["split"], fmt) for report in reports for row in report["fillers"][0]["sizes"] for fmt in row["formats"]
    }
    for row in rows:  # a format no trial drew (9 trials, 10 trained formats): "-" throughout
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert (cells[1].split(",")[0], cells[2]) in drawn or set(cells[3:]) == {"-"}
    assert len(drawn) < len(rows)
    counts = [[int(cell) for cell in row.strip("|").split("|")[3:-1] if cell.strip() != "-"] for row in rows]
    assert sum(map(sum, counts)) == sum(row["total"] for report in reports for row in report["fillers"][0]["sizes"])


def test_the_report_table_and_plot(checkpoint: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "probe"
    argv = ["text-eval", "--checkpoint", str(checkpoint), "--probe", "retrieval", "--sizes", "600,700"]
    argv += ["--depths", "0,1", "--filler", "grass", "--trials", "2", "--max-new-tokens", "4", "--out", str(out)]
    assert main([*argv, "--split", "held-out", "--formats", "number,code", "--plots", "--no-progress"]) == 0
    assert sorted(path.name for path in out.iterdir()) == ["retrieval.json", "retrieval.png"]
    (report,) = json.loads((out / "retrieval.json").read_text())
    assert (report["probe"], report["split"], report["needles"], report["ask"]) == ("retrieval", HELD_OUT, 1, "one")
    assert report["formats"] == ["number-4", "number-7", "code"] and report["wordings"] == "composed"
    row = report["fillers"][0]["sizes"][0]
    assert set(row) == {"size", "skipped", "right", "total", "accuracy", "formats", "depths"}
    assert row["total"] == 4 and row["right"] == 0  # an untrained model finds nothing
    trial = row["depths"][0]["trials"][0]
    assert set(trial) == {"key", "value", "format", "wording", "asked", "completion", "right", "outcome", "matched"}
    assert trial["key"] in KEYS[HELD_OUT] and trial["format"] in report["formats"]
    assert "| lrnn (" in capsys.readouterr().out
    assert _families(report) == ["number", "code"]  # the heat map's panels of this filler
    for size in report["fillers"][0]["sizes"]:
        for d, cell in enumerate(size["depths"]):
            by_family = [_cell(size, d, family) for family in ("number", "code")]
            assert [total for _, total in by_family] == ([2, 0] if d == 0 else [1, 1])  # formats in turn
            assert _cell(size, d, None) == (cell["right"], cell["total"]) == (0, 2)


def test_a_wordings_file_replaces_the_composed_wordings(checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "wordings.json"
    path.write_text(json.dumps([{"needle": "The vault of {key} opens with {value}.", "question": "The {key} vault:"}]))
    (wording,) = wordings_from_file(path)
    builder = RetrievalBuilder(BYTES, grass_filler(BYTES), HELD_OUT, [wording])
    prompt = builder.prompt(builder.draw(np.random.default_rng(0), "word", 0.5, needles=2), 800)
    text = BYTES.decode(prompt.tokens.tolist())
    assert f"opens with {prompt.value}." in text and text.endswith(f" The {prompt.key} vault:")
    out = tmp_path / "probe"
    argv = ["text-eval", "--checkpoint", str(checkpoint), "--probe", "retrieval", "--sizes", "600", "--depths", "0.5"]
    argv += ["--filler", "grass", "--trials", "1", "--wordings", str(path), "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    reports = json.loads((out / "retrieval.json").read_text())
    assert [r["wordings"] for r in reports] == [str(path)] * 2
    assert reports[0]["fillers"][0]["sizes"][0]["depths"][0]["trials"][0]["wording"] == "wordings.json#0"


@pytest.mark.parametrize(
    "entries, message",
    [
        ([{"needle": "The code is 5.", "question": "The code is"}], "has no {value} placeholder"),
        ([{"needle": "{value}", "question": "It is {value}"}], "must not hold {value}"),
        ([{"needle": "{key} is {value}", "question": "It is"}], "{key} must be in both"),
        ([{"needle": "{name} is {value}", "question": "It is"}], "unknown placeholder {name}"),
        ([{"needle": "{value"}], "needs the strings 'needle' and 'question'"),
        ([{"needle": "{value", "question": "?"}], "'{value'"),
        ({"needle": "x"}, "expected a non-empty JSON list"),
        ("not json", "wordings file"),
    ],
)
def test_bad_wordings_files_exit_2_naming_what_is_wrong(
    checkpoint: Path,
    tmp_path: Path,
    capsys,
    entries,
    message: str,
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(entries if isinstance(entries, str) else json.dumps(entries))
    argv = ["text-eval", "--checkpoint", str(checkpoint), "--probe", "retrieval", "--filler", "grass"]
    assert main([*argv, "--wordings", str(path), "--no-progress"]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sizes", "100"], "--sizes 100: a retrieval prompt of the trained split"),
        (["--sizes", "1k,32M"], "a probe's prompts have at most 16777216 tokens"),
        (["--needles", "17"], "--needles 17: a prompt holds at most 16 needles"),
        (["--needles", "0"], "argument --needles: must be a positive integer"),
        (["--ask", "all"], "argument --ask: invalid choice: 'all'"),
        (["--split", "test"], "argument --split: invalid choice: 'test'"),
        (["--formats", "number-4"], "value format 'number-4' is not in the trained split"),
        (["--formats", "emoji"], "value format 'emoji' is not in the trained split"),
        (["--depths", "0,2"], "argument --depths: must be a probability in [0, 1], got 2"),
        (["--distractors", "2"], "--distractors does not apply to --probe retrieval"),
        (["--wordings", "missing.json"], "wordings file missing.json"),
    ],
)
def test_bad_retrieval_flags_exit_2_with_one_line(
    checkpoint: Path,
    flags,
    message: str,
    capsys,
    tmp_path: Path,
    monkeypatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = ["text-eval", "--checkpoint", str(checkpoint), "--probe", "retrieval", "--filler", "grass"]
    assert main([*argv, "--no-progress", *flags]) == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error
    assert not (tmp_path / "runs").exists()


def recall_objective(tmp_path: Path, **data: Any) -> LanguageModelObjective:
    """A bytes-tokenizer objective of retrieval rows alone, windows of 700, evaluation on, over a made-up novel in
    ``tmp_path``; ``data``: more ``TextData`` fields."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "novel.txt").write_text(
        "\n\n".join(f"Chapter {n}. It was a fine day in the village." for n in range(400))
    )
    settings = TextData(corpus=f"text:{corpus}", tokenizer="bytes", length=700, recall_fraction=1.0, **data)
    return LanguageModelObjective(settings, BYTES, None, 10, 8, 0, True, CPU)


def test_recall_rows_are_scored_on_their_answers_only_and_draw_from_the_trained_split(tmp_path: Path) -> None:
    objective = recall_objective(tmp_path, recall_needles=4)
    held_out = [*KEYS[HELD_OUT], *WORDS[HELD_OUT], *(s.split("{")[0] for s in SUBJECTS[HELD_OUT])]
    rng, asked_several = np.random.default_rng(0), 0
    for step in range(1, 6):
        batch = objective.batch(rng, step)
        assert batch.tokens.shape == (8, 700) and batch.targets.shape == (8, 700)
        for tokens, targets in zip(batch.tokens, batch.targets):
            scored = targets != IGNORE_INDEX
            assert torch.equal(targets[scored], torch.cat([tokens[1:], targets[-1:]])[scored])
            text = BYTES.decode(tokens.tolist())
            answers = re.findall(r" ([^ ]+)\.", BYTES.decode(targets[scored].tolist()))
            assert 1 <= len(answers) <= 4 and text.endswith(f" {answers[-1]}")
            for answer in answers[:-1]:  # each answer also stands in a needle before its question
                assert text.count(f" {answer}.") >= 2, (answer, text)
            asked_several += len(answers) > 1
            assert not any(re.search(rf"\b{re.escape(word)}\b", text) for word in held_out if word.strip())
    assert asked_several > 0
    assert set(objective.recall_validation) == {"recall_accuracy", "recall_pair_accuracy"}
    assert all(set(prompts) == {700, 700 * 16} for prompts in objective.recall_validation.values())


def test_a_spanning_retrieval_example_hides_its_needles_in_one_window_and_asks_windows_later(tmp_path: Path) -> None:
    """``recall_span``: an example opens at the end of a row's window (its needles, unscored, then one text token),
    the row reads on through its text, and a later window of the same row ends in the question (unscored) for one
    of those needles and its value (scored); spans cover 1 to recall_span windows, the longest growing over the
    run; the open examples are kept with the data state."""
    span = 4
    objective = recall_objective(tmp_path, recall_needles=3, state_passing=True, recall_span=span)
    rng, opened, lengths = np.random.default_rng(0), {}, set()
    previous = None
    for step in range(1, 25):
        before = list(objective.spans or [None] * 8)
        batch = objective.batch(rng, step)
        scored = batch.targets != IGNORE_INDEX
        for row in range(8):
            tokens, example = batch.tokens[row].tolist(), objective.spans[row]
            if before[row] is None and example is not None:  # opened here
                answer = BYTES.decode(example.answer)
                assert re.fullmatch(r" \S+\.", answer) and answer[:-1] in BYTES.decode(tokens)
                assert not scored[row, -40:].any()  # the needles and the text token after them
                opened[row] = (example, step)
            elif before[row] is not None and example is None:  # closed here
                started, first = opened.pop(row, (None, None))
                tail = before[row].question + before[row].answer
                assert [*tokens, int(batch.targets[row, -1])][-len(tail) :] == tail
                assert not scored[row, -len(tail) : -len(before[row].answer)].any()
                assert scored[row, -len(before[row].answer) :].all()
                if first is not None:
                    assert started.answer == before[row].answer
                    assert step - first + 1 <= objective.longest_span(first, span)
                    lengths.add(step - first + 1)
            elif example is not None and previous.targets[row, -1] != IGNORE_INDEX:  # inside: the text goes on
                assert int(batch.tokens[row, 0]) == int(previous.targets[row, -1])
        previous = batch
    assert max(lengths) > 2 and max(lengths) <= span
    assert [objective.longest_span(step, span) for step in (1, 10)] == [1, span]
    state = json.loads(json.dumps(objective.data_state()))
    (tmp_path / "again").mkdir()
    resumed = recall_objective(tmp_path / "again", recall_needles=3, state_passing=True, recall_span=span)
    resumed.load_data_state(state)
    assert resumed.spans == objective.spans and any(example is not None for example in resumed.spans)


def test_pair_validation_prompts_hold_two_trained_needles_and_ask_the_one_at_the_rows_depth(tmp_path: Path) -> None:
    objective = recall_objective(tmp_path, recall_needles=3)
    data = objective.data
    tokens, targets = objective.recall_validation["recall_pair_accuracy"][700]
    firsts = []
    for row, scored_targets in zip(tokens, targets):
        scored = scored_targets != IGNORE_INDEX
        text, answer = BYTES.decode(row.tolist()), BYTES.decode(scored_targets[scored].tolist())
        assert text.endswith(answer) and re.fullmatch(r" \S+\.", answer), answer
        keys = [match for key in KEYS[TRAINED] for match in re.finditer(rf"\b{re.escape(key)}\b", text)]
        assert len({match[0] for match in keys}) == 2, text  # two needles, each with its key
        asked = max(keys, key=lambda match: match.start())[0]  # the question, at the end, names it
        other = next(match[0] for match in keys if match[0] != asked)
        value = text.index(answer)  # the asked value stands once before the answer: in its needle
        assert value < len(text) - len(answer) and text.count(answer) == 2
        assert min(keys, key=lambda match: abs(match.start() - value))[0] == asked
        firsts.append(text.index(asked) < text.index(other))
    assert 0 < sum(firsts) < len(firsts)  # the asked needle is now the first, now the second

    one = dataclasses.replace(data, recall_needles=1)
    assert set(LanguageModelObjective(one, BYTES, None, 10, 8, 0, True, CPU).recall_validation) == {"recall_accuracy"}
    objective.data = dataclasses.replace(data, length=60)  # windows too short for two needles
    with pytest.raises(ValueError, match="2 needles of the number-1 format do not fit 60 tokens"):
        objective._recall_split_prompts(0, 5, TRAINED, 2)
    objective.data, single = data, objective._recall_split_prompts

    def pairs_refused(seed: int, stream: int, split: str, needles: int) -> dict:
        if needles > 1:
            raise ValueError("too short")
        return single(seed, stream, split, needles)

    objective._recall_split_prompts = pairs_refused  # type: ignore[method-assign]
    assert set(objective._recall_prompts(0)) == {"recall_accuracy"}


MADE_UP_WORDS = [
    start + end for start in ("ka", "lo", "mi", "ne", "pu", "ra") for end in ("tor", "vin", "sel", "dam", "gix", "bur")
]


def made_up_corpus(folder: Path) -> str:
    """A text corpus of 400 short paragraphs naming the 36 made-up words of ``MADE_UP_WORDS`` and the held-out
    keys; its ``--corpus`` value."""
    folder.mkdir()
    words = [*MADE_UP_WORDS, *KEYS[HELD_OUT]]
    (folder / "novel.txt").write_text(
        "\n\n".join(f"Chapter {n}. A fine {words[n % len(words)]} in the village." for n in range(400))
    )
    return f"text:{folder}"


def test_varied_draws_take_keys_subjects_and_phrases_from_the_text_never_held_out_words(tmp_path: Path) -> None:
    made_up_corpus(tmp_path / "corpus")
    filler = np.asarray(AUSTEN_8K.encode((tmp_path / "corpus" / "novel.txt").read_text()))
    vocabulary = Vocabulary(AUSTEN_8K, filler)
    assert set(vocabulary.words) == {*MADE_UP_WORDS, "fine", "village"}  # "Chapter" is not lower-case
    builder = RetrievalBuilder(AUSTEN_8K, filler, TRAINED, varied=1.0)
    assert builder.formats() == (*split_formats(TRAINED), PHRASE, RUN)
    rng, runs = np.random.default_rng(0), []
    for index in range(60):
        fmt = builder.formats()[index % len(builder.formats())]
        draw = builder.draw(rng, fmt, 0.5, needles=3)
        assert set(draw.keys) <= set(vocabulary.words) and len(set(draw.keys)) == 3
        subject_words = re.findall(r"[a-z]+", draw.wording.subject.replace("{key}", ""))
        assert subject_words[0] == "the" and set(subject_words[1:-1]) <= set(vocabulary.words)
        if fmt == PHRASE:
            assert all(set(value.split()) <= set(vocabulary.words) for value in draw.values)
        if fmt == RUN:  # a lower-case letter and a digit: never a number, a code or a word of either split
            assert all(re.fullmatch(r"(?=.*[a-z])(?=.*[0-9])[A-Za-z0-9]{2,12}", value) for value in draw.values)
            runs.extend(draw.values)
        prompt = builder.prompt(draw, 300)
        text = AUSTEN_8K.decode(prompt.tokens.tolist())
        assert f" {draw.values[0]}." in text and text.endswith(draw.wording.ask(draw.keys[0]))
    assert any(re.search("[A-Z]", value) for value in runs)  # upper-case letters are copied too
    assert not set(vocabulary.words) & (held_out_words() | set(KEYS[HELD_OUT]))
    for fmt in (PHRASE, RUN):
        with pytest.raises(ValueError, match="needs varied draws"):
            RetrievalBuilder(AUSTEN_8K, filler, TRAINED).draw(rng, fmt, 0.5)
    with pytest.raises(ValueError, match="varied draws are of the trained split"):
        RetrievalBuilder(AUSTEN_8K, filler, HELD_OUT, varied=0.5)
    with pytest.raises(ValueError, match="holds 2 different lower-case words of 4-12 letters: varied"):
        Vocabulary(AUSTEN_8K, np.asarray(AUSTEN_8K.encode("A fine day in the village. " * 20)))


def test_example_rows_carry_the_example_weight_and_text_rows_one(tmp_path: Path) -> None:
    corpus = made_up_corpus(tmp_path / "corpus")
    weighted = TextData(corpus=corpus, tokenizer="bytes", length=700, recall_fraction=0.5, example_weight=8.0)
    objective = LanguageModelObjective(weighted, BYTES, None, 10, 16, 0, False, CPU)
    batch = objective.batch(np.random.default_rng(0), 1)
    assert batch.weights is not None
    examples = (batch.targets != IGNORE_INDEX).sum(dim=1) < 100  # a retrieval row scores its answers only
    assert 0 < int(examples.sum()) < 16
    assert torch.equal(batch.weights, torch.where(examples, 8.0, 1.0))
    plain = LanguageModelObjective(
        dataclasses.replace(weighted, example_weight=1.0), BYTES, None, 10, 16, 0, False, CPU
    )
    assert plain.batch(np.random.default_rng(0), 1).weights is None


def test_recall_training_runs_and_refuses_short_windows_and_too_many_needles(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    corpus = made_up_corpus(tmp_path / "corpus")
    argv = ["text-train", "--arch", "lrnn", "--corpus", corpus, "--tokenizer", "bytes", "--length", "400"]
    argv += ["--batch-size", "2", "--warmup-steps", "1", "--eval-every", "0", "--no-progress", "--threads", "1"]
    argv += ["--d-model", "16", "--layers", "1", "--block-size", "4", "--num-blocks", "4", "--d-ff", "32"]
    argv += ["--recall-fraction", "0.5", "--state-passing", "--passkey-fresh"]
    assert main([*argv, "--steps", "2", "--out", str(tmp_path / "a")]) == 0
    assert json.loads((tmp_path / "a" / "config.json").read_text())["metadata"]["settings"]["recall_fraction"] == 0.5
    capsys.readouterr()
    assert main([*argv[:7], "--length", "64", "--recall-fraction", "0.5", "--steps", "1", "--out", "x"]) == 2
    assert "retrieval examples need windows of at least" in capsys.readouterr().err
    assert main([*argv, "--recall-needles", "17", "--steps", "1", "--out", "x"]) == 2
    assert "--recall-needles 17: an example holds at most 16 needles" in capsys.readouterr().err
    assert main([*argv[:7], "--length", "400", "--example-weight", "4", "--steps", "1", "--out", "x"]) == 2
    assert "--example-weight needs --passkey-fraction, --recall-fraction or --mqar-fraction" in capsys.readouterr().err
    few_words = [*argv[:4], f"text:{tmp_path / 'few'}", *argv[5:]]
    (tmp_path / "few").mkdir()
    (tmp_path / "few" / "novel.txt").write_text("A fine day in the village. " * 2000)
    assert main([*few_words, "--steps", "1", "--out", "x"]) == 2
    assert "varied retrieval draws need at least 32" in capsys.readouterr().err
    assert main([*few_words, "--recall-varied", "0", "--steps", "1", "--out", str(tmp_path / "b")]) == 0
    assert not (tmp_path / "x").exists()
