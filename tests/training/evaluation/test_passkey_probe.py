"""``text-eval --probe passkey`` (training/evaluation/passkey_probe.py) on tiny models with the bytes tokenizer: the prompts'
size and needle depth, the report's shape and plot, exact scoring with hand-made models that always or never
answer the key, the cached chunked prefill against the parallel pass, and bad flags. No network."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.tokenizer import Tokenizer, load_tokenizer
from tests.training.probe_models import BYTES, REPO, TINY, Answerer, save_tiny_lrnn, tiny_model
from training.cli.main import main
from training.data.passkey import INTRODUCTION, NEEDLE, PassKeyBuilder, grass_filler
from training.evaluation.passkey_probe import (
    PassKeyProbe,
    cell_prompts,
    format_passkey_table,
    greedy_completions,
    probe_checkpoint,
)

pytestmark = pytest.mark.usefixtures("no_network")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny untrained LRNN language model with the bytes tokenizer, as text-train would write it."""
    return save_tiny_lrnn(tmp_path_factory.mktemp("tiny-lrnn"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "novel.txt").write_text("\n\n".join(f"Chapter {n}. It was a fine day in the village." for n in range(60)))
    return folder


@pytest.mark.parametrize(
    "tokenizer",
    [BYTES, load_tokenizer("file:tokenizer.tiktoken", REPO / "checkpoints/text-lrnn")],
    ids=["bytes", "austen-8k"],
)
def test_a_prompt_is_size_tokens_with_the_needle_at_its_depth(tokenizer: Tokenizer) -> None:
    builder = PassKeyBuilder(tokenizer, grass_filler(tokenizer))
    introduction = len(tokenizer.encode(INTRODUCTION))
    probe = PassKeyProbe(sizes=(), depths=(0.0, 0.3, 0.5, 1.0), fillers=("grass",), trials=3, seed=4)
    for size in (builder.shortest() + 40, 1000):
        prompts = cell_prompts(builder, probe, "grass", size)
        assert [prompt.depth for prompt in prompts] == [depth for depth in probe.depths for _ in range(3)]
        assert len({prompt.key for prompt in prompts}) > 1  # a key per trial
        for prompt in prompts:
            assert prompt.tokens.shape == (size,)
            needle = tokenizer.encode(NEEDLE.format(key=prompt.key))
            starts = [i for i in range(size - len(needle) + 1) if prompt.tokens[i : i + len(needle)].tolist() == needle]
            filler = size - builder.fixed_tokens - len(needle)
            assert starts == [introduction + round(prompt.depth * filler)]
        again = cell_prompts(builder, probe, "grass", size)  # the same seed, filler and size: the same prompts
        assert all((a.tokens == b.tokens).all() for a, b in zip(prompts, again))


@pytest.mark.parametrize(
    "tokenizer",
    [BYTES, load_tokenizer("file:tokenizer.tiktoken", REPO / "checkpoints/text-lrnn")],
    ids=["bytes", "austen-8k"],
)
def test_distractors_are_other_numbers_in_the_filler_and_keep_the_size(tokenizer: Tokenizer) -> None:
    """``distractors`` numbers other than the key, before and after the needle; the prompt keeps its size and
    its needle; the grass filler has no digits of its own."""
    builder = PassKeyBuilder(tokenizer, grass_filler(tokenizer))
    rng = np.random.default_rng(0)
    sides = set()
    for trial in range(20):
        prompt = builder.prompt(400, 0.5, rng, distractors=3)
        assert prompt.tokens.shape == (400,)
        needle = tokenizer.decode(prompt.tokens[prompt.needle].tolist())
        assert needle == NEEDLE.format(key=prompt.key)
        head = tokenizer.decode(prompt.tokens[: prompt.needle.start].tolist())
        tail = tokenizer.decode(prompt.tokens[prompt.needle.stop :].tolist())
        numbers = re.findall(r"\d+", head) + re.findall(r"\d+", tail)
        assert len(numbers) == 3 and prompt.key not in numbers
        sides.add((len(re.findall(r"\d+", head)), len(re.findall(r"\d+", tail))))
    assert len(sides) > 1  # on either side of the needle
    plain = builder.prompt(400, 0.5, np.random.default_rng(0))
    assert not re.findall(r"\d+", tokenizer.decode(plain.tokens[plain.needle.stop :].tolist()))
    tight = builder.prompt(builder.shortest(plain.key) + 2, 0.0, rng, key=plain.key, distractors=5)
    assert tight.tokens.shape == (builder.shortest(plain.key) + 2,)  # fewer numbers when the filler is short


def test_number_forms_put_numbers_as_prose_has_them_never_the_key() -> None:
    """``number_forms``: the distractors take every form of ``NUMBER_FORMS`` ("CHAPTER 31", "in 1797-98", ...),
    none holds the key's digits, the prompt keeps its size and needle; without it, plain numbers only."""
    tokenizer = load_tokenizer("file:tokenizer.tiktoken", REPO / "checkpoints/text-lrnn")
    builder = PassKeyBuilder(tokenizer, grass_filler(tokenizer), number_forms=True)
    rng = np.random.default_rng(0)
    texts = []
    for _ in range(60):
        prompt = builder.prompt(300, 0.5, rng, key="12345" if not texts else None, distractors=4)
        assert prompt.tokens.shape == (300,)
        assert tokenizer.decode(prompt.tokens[prompt.needle].tolist()) == NEEDLE.format(key=prompt.key)
        filler = np.concatenate([prompt.tokens[: prompt.needle.start], prompt.tokens[prompt.needle.stop :]])
        text = tokenizer.decode(filler.tolist())
        assert prompt.key not in re.findall(r"\d+", text)
        texts.append(text)
    joined = "".join(texts)
    for pattern in [
        r"CHAPTER \d+\n",
        r" in 1[5-9]\d\d\b",
        r" in \d{4}-\d\d",
        r" No\. \d",
        r"£\d",
        r"\d,\d\d0\b",
        r" \d+-\d\d",
    ]:
        assert re.search(pattern, joined), pattern
    builder._number = lambda rng: " No. 12345-98"  # a form that holds the key: the key's first four digits instead
    text = tokenizer.decode(builder.with_numbers(grass_filler(tokenizer)[:100], 2, "12345", rng).tolist())
    assert re.findall(r"\d+", text) == ["1234", "1234"]
    plain = PassKeyBuilder(tokenizer, grass_filler(tokenizer))
    numbers = tokenizer.decode(plain.prompt(300, 0.5, np.random.default_rng(0), distractors=30).tokens.tolist())
    assert "CHAPTER" not in numbers and "No." not in numbers and "£" not in numbers and "-" not in numbers


@pytest.mark.parametrize("architecture", sorted(TINY))
def test_cached_chunked_prefill_decodes_as_the_parallel_pass(architecture: str) -> None:
    model = tiny_model(architecture)
    prompts = torch.randint(0, BYTES.vocab_size, (3, 61), generator=torch.Generator().manual_seed(1))
    cached = greedy_completions(model, prompts, max_new_tokens=6, chunk_tokens=7)  # 8 chunks, the last of 5
    tokens = prompts
    with torch.no_grad():
        for _ in range(6):  # the whole sequence again for every new token
            tokens = torch.cat([tokens, model(tokens)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, tokens[:, 61:])
    assert len(set(cached.flatten().tolist())) > 1  # not one token over and over


def test_passkey_report_plot_and_table(checkpoint: Path, corpus: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "probe"
    assert (
        main(
            [
                "text-eval",
                "--checkpoint",
                str(checkpoint),
                "--checkpoint",
                str(checkpoint),
                "--probe",
                "passkey",
                "--sizes",
                "300,400",
                "--depths",
                "0,0.5,1",
                "--filler",
                "grass",
                "--filler",
                f"text:{corpus}",
                "--trials",
                "2",
                "--max-new-tokens",
                "4",
                "--out",
                str(out),
                "--plots",
                "--no-progress",
            ]
        )
        == 0
    )
    assert sorted(path.name for path in out.iterdir()) == ["passkey.json", "passkey.png"]
    assert (out / "passkey.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    reports = json.loads((out / "passkey.json").read_text())
    assert len(reports) == 2 and reports[0]["fillers"] == reports[1]["fillers"]  # same prompts, same model
    report = reports[0]
    assert set(report) == {
        "checkpoint",
        "architecture",
        "probe",
        "trials",
        "seed",
        "max_new_tokens",
        "distractors",
        "distractors_at",
        "number_forms",
        "fillers",
        "wall_time_s",
    }
    assert (report["distractors"], report["distractors_at"], report["number_forms"]) == (0, "either", False)
    assert (report["architecture"], report["probe"], report["trials"], report["seed"]) == ("lrnn", "passkey", 2, 0)
    assert [filler["filler"] for filler in report["fillers"]] == ["grass", f"text:{corpus}"]
    for filler in report["fillers"]:
        assert set(filler) == {"filler", "filler_tokens", "sizes"} and filler["filler_tokens"] > 0
        assert [row["size"] for row in filler["sizes"]] == [300, 400]
        for row in filler["sizes"]:
            assert set(row) == {"size", "skipped", "right", "total", "accuracy", "depths"}
            assert row["skipped"] is None and row["total"] == 6 and row["accuracy"] == row["right"] / 6
            assert [cell["depth"] for cell in row["depths"]] == [0, 0.5, 1]
            for cell in row["depths"]:
                assert set(cell) == {"depth", "right", "total", "trials"} and cell["total"] == 2
                for trial in cell["trials"]:
                    assert set(trial) == {"key", "completion", "right"} and len(trial["key"]) == 5
                    assert trial["right"] is False  # an untrained model does not find the key
    table = capsys.readouterr().out
    assert "| model | filler | 300 | 400 |" in table and "| lrnn (" in table and "| 0/6 | 0/6 |" in table


@pytest.mark.parametrize(
    "answer, right",
    [
        (lambda key: f" {key}.", True),
        (lambda key: f" {int(key) + 1}.", False),
        (lambda key: f" {key}0", False),
        (lambda key: " It is", False),
    ],
)
def test_the_key_scores_right_and_any_other_answer_wrong(checkpoint: Path, answer, right: bool) -> None:
    loaded = load_checkpoint(checkpoint)
    loaded.model = Answerer(loaded.config.model, BYTES, answer)
    probe = PassKeyProbe(
        sizes=(300, 500), depths=(0.0, 0.5, 1.0), fillers=("grass",), trials=2, max_memory=2**20
    )  # the logits of 168 tokens of 6 rows and their caches
    report = probe_checkpoint(loaded, BYTES, {"grass": grass_filler(BYTES)}, probe)
    sizes = report["fillers"][0]["sizes"]
    assert [(row["right"], row["total"]) for row in sizes] == [(6 if right else 0, 6)] * 2
    assert all(
        trial["completion"].startswith(answer(trial["key"]))
        for row in sizes
        for cell in row["depths"]
        for trial in cell["trials"]
    )
    assert max(loaded.model.chunks) < 300 and sum(loaded.model.chunks) == 300 + 500


def test_distractors_tell_the_key_from_the_last_number_read(checkpoint: Path) -> None:
    """``distractors``: a model that answers the number the needle names stays right; one that answers the last
    number it read is right exactly on the prompts where no distractor follows the needle."""
    probe = PassKeyProbe(
        sizes=(300, 500), depths=(0.0, 0.5, 1.0), fillers=("grass",), trials=4, max_memory=2**20, distractors=3
    )
    builder = PassKeyBuilder(BYTES, grass_filler(BYTES))
    loaded = load_checkpoint(checkpoint)
    loaded.model = Answerer(loaded.config.model, BYTES, lambda key: f" {key}.")
    report = probe_checkpoint(loaded, BYTES, {"grass": grass_filler(BYTES)}, probe)
    assert report["distractors"] == 3 and "| grass + 3 numbers | 12/12 | 12/12 |" in format_passkey_table([report])
    assert [(row["right"], row["total"]) for row in report["fillers"][0]["sizes"]] == [(12, 12)] * 2
    last = Answerer(
        loaded.config.model, BYTES, lambda key: f" {key}.", read=lambda text: (re.findall(r"\d+", text) or [None])[-1]
    )
    loaded.model = last
    for distractors in (0, 3):
        probe = PassKeyProbe(**{**vars(probe), "distractors": distractors})
        sizes = probe_checkpoint(loaded, BYTES, {"grass": grass_filler(BYTES)}, probe)["fillers"][0]["sizes"]
        for size, row in zip(probe.sizes, sizes):
            prompts = cell_prompts(builder, probe, "grass", size)  # the probe's own prompts, drawn again
            clear = [
                not re.search(r"\d", BYTES.decode(prompt.tokens[prompt.needle.stop :].tolist())) for prompt in prompts
            ]
            assert [trial["right"] for cell in row["depths"] for trial in cell["trials"]] == clear
            assert all(clear) if distractors == 0 else 0 < sum(clear) < len(clear)
    # all before the needle, the last number read is the key (right on every prompt); all after it, never (but at
    # depth 1, where no filler follows the needle); in prose forms as well
    for place, forms in (("before", False), ("after", False), ("after", True)):
        probe = PassKeyProbe(**{**vars(probe), "distractors": 3, "distractors_at": place, "number_forms": forms})
        report = probe_checkpoint(loaded, BYTES, {"grass": grass_filler(BYTES)}, probe)
        label = f"grass + 3 numbers{' in prose forms' if forms else ''} {place} the needle"
        assert f"| {label} |" in format_passkey_table([report])
        for row in report["fillers"][0]["sizes"]:
            right = [trial["right"] for cell in row["depths"] for trial in cell["trials"]]
            assert right == ([True] * 12 if place == "before" else [False] * 8 + [True] * 4), (place, forms)


def test_a_size_whose_cache_does_not_fit_is_skipped(checkpoint: Path) -> None:
    loaded = load_checkpoint(checkpoint)
    loaded.model = Answerer(loaded.config.model, BYTES, lambda key: f" {key}.", cache_bytes_per_token=2**12)
    probe = PassKeyProbe(sizes=(300, 600), depths=(0.5,), fillers=("grass",), trials=2, max_memory=2**21)
    sizes = probe_checkpoint(loaded, BYTES, {"grass": grass_filler(BYTES)}, probe)["fillers"][0]["sizes"]
    assert (sizes[0]["right"], sizes[0]["total"], sizes[0]["skipped"]) == (2, 2, None)  # 1.2 MB a row: one at a time
    assert (sizes[1]["total"], sizes[1]["accuracy"]) == (0, None)
    assert sizes[1]["skipped"] == (
        "one row at 600 tokens needs 0.00229 GiB (its cache and a one-token prefill), over --max-memory 0.00195 GiB"
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sizes", "100"], "--sizes 100: a pass-key prompt takes at least"),
        (["--sizes", "8x"], "argument --sizes: expected token counts like 1k,8k,64k,1M"),
        (["--sizes", "8k,1k"], "token counts must increase"),
        (["--depths", "0,1.5"], "argument --depths: must be a probability in [0, 1], got 1.5"),
        (["--trials", "0"], "argument --trials: must be a positive integer, got 0"),
        (["--max-new-tokens", "0"], "argument --max-new-tokens: must be a positive integer"),
        (["--distractors", "-1"], "argument --distractors: must be 0 or more"),
        (["--distractors-at", "after"], "give --distractors N (N > 0)"),
        (["--number-forms"], "give --distractors N (N > 0)"),
        (["--distractors", "2", "--distractors-at", "middle"], "argument --distractors-at: invalid choice: 'middle'"),
        (["--filler", "grass,web"], "unknown filler 'web': use 'austen', 'grass', 'text:PATH' or 'owt2:PATH'"),
        (["--filler", "text:missing-folder"], "missing-folder"),
        (["--multiples", "1,2"], "--multiples does not apply to --probe passkey"),
    ],
)
def test_bad_probe_flags_exit_2_with_one_line(checkpoint: Path, flags, message, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert (
        main(
            [
                "text-eval",
                "--checkpoint",
                str(checkpoint),
                "--probe",
                "passkey",
                "--filler",
                "grass",
                "--no-progress",
                *flags,
            ]
        )
        == 2
    )
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error
    assert not (tmp_path / "runs").exists()


def test_probe_flags_without_the_probe_and_the_probe_of_a_transducer_exit_2(checkpoint: Path, capsys) -> None:
    assert main(["text-eval", "--checkpoint", str(checkpoint), "--sizes", "1k", "--trials", "3"]) == 2
    assert "--sizes, --trials do not apply to --probe perplexity" in capsys.readouterr().err
    transducer = REPO / "checkpoints" / "parity_check-lrnn"
    assert main(["text-eval", "--checkpoint", str(transducer), "--probe", "passkey", "--sizes", "1k"]) == 2
    assert "is a transducer (kind 'transduce'); text-eval measures text models" in capsys.readouterr().err


def test_without_filler_the_probe_reads_austen_and_grass(checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    """No --filler: the default fillers, Austen's held-out text and the grass text, each read as one filler name.
    Austen's text is not installed here: its stream is stood in for by the grass text."""
    monkeypatch.setattr("training.cli.text.filler_tokens", lambda name, tokenizer, fraction: grass_filler(tokenizer))
    out = tmp_path / "probe"
    assert (
        main(
            [
                "text-eval",
                "--checkpoint",
                str(checkpoint),
                "--probe",
                "passkey",
                "--sizes",
                "300",
                "--depths",
                "0.5",
                "--trials",
                "1",
                "--max-new-tokens",
                "2",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    report = json.loads((out / "passkey.json").read_text())[0]
    assert [filler["filler"] for filler in report["fillers"]] == ["austen", "grass"]
