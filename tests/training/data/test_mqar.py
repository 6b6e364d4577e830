"""MQAR rows (training/data/mqar.py) and ``text-train --mqar-fraction``: the layout, the scored values, the two splits
of token ids kept apart, evaluation's figures, bad flags and a corpus with no held-out text. No network."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.training.probe_models import BYTES
from training.cli.main import main
from training.data.batches import IGNORE_INDEX
from training.data.mqar import HELD_OUT, HELD_OUT_MODULUS, TRAINED, mqar_row, shortest_row, split_ids
from training.objectives.distributed import setup_distributed
from training.objectives.language_model import LanguageModelObjective, TextData

DEVICE = setup_distributed("cpu")


def test_the_splits_cover_the_ordinary_ids_once() -> None:
    trained, held_out = split_ids(BYTES, TRAINED), split_ids(BYTES, HELD_OUT)
    assert not set(trained) & set(held_out)
    assert sorted([*trained, *held_out]) == list(range(256))
    assert all(token % HELD_OUT_MODULUS == 0 for token in held_out)
    with pytest.raises(ValueError, match="unknown split 'both'"):
        split_ids(BYTES, "both")


def test_a_row_opens_with_its_pairs_and_ends_in_every_key_and_its_value() -> None:
    rng, ids = np.random.default_rng(0), split_ids(BYTES, HELD_OUT)
    text = np.full(100, 7)
    tokens, targets = mqar_row(rng, ids, 40, 3, text)
    assert tokens.shape == (40,) and targets.shape == (39,)
    pairs = dict(zip(tokens[:6:2].tolist(), tokens[1:6:2].tolist()))
    assert len(pairs) == 3 and len(set(tokens[:6].tolist())) == 6 and set(tokens[:6].tolist()) <= set(ids.tolist())
    assert torch.equal(tokens[6:34], torch.full((28,), 7))
    closing = tokens[34:].tolist()
    assert dict(zip(closing[::2], closing[1::2])) == pairs
    scored = targets != IGNORE_INDEX
    assert scored.nonzero().flatten().tolist() == [34, 36, 38]  # the predictions after each repeated key
    assert targets[scored].tolist() == closing[1::2]
    with pytest.raises(ValueError, match="a row of 3 pairs of 1-token values needs at least 13 tokens, not 12"):
        mqar_row(rng, ids, 12, 3, text)
    assert shortest_row(3) == 13


def test_a_value_of_several_tokens_is_stored_and_asked_whole() -> None:
    rng, ids = np.random.default_rng(1), split_ids(BYTES, HELD_OUT)
    tokens, targets = mqar_row(rng, ids, 40, 2, np.full(100, 7), value_tokens=4)
    opening, closing = tokens[:10].tolist(), tokens[30:].tolist()
    assert len(set(opening)) == 10 and set(opening) <= set(ids.tolist())
    assert torch.equal(tokens[10:30], torch.full((20,), 7))
    stored = {opening[0]: opening[1:5], opening[5]: opening[6:10]}
    assert {closing[0]: closing[1:5], closing[5]: closing[6:10]} == stored
    scored = targets != IGNORE_INDEX
    assert scored.nonzero().flatten().tolist() == [30, 31, 32, 33, 35, 36, 37, 38]  # after each key, its value
    assert targets[scored].tolist() == closing[1:5] + closing[6:10]
    assert shortest_row(2, 4) == 21
    with pytest.raises(ValueError, match="a row of 2 pairs of 4-token values needs at least 21 tokens, not 20"):
        mqar_row(rng, ids, 20, 2, np.full(100, 7), value_tokens=4)
    with pytest.raises(ValueError, match="needs 34 distinct ids, not 32"):
        mqar_row(rng, ids, 80, 2, np.full(100, 7), value_tokens=16)


def test_training_rows_draw_trained_ids_and_evaluation_reports_both_splits(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "novel.txt").write_text("\n\n".join(f"Chapter {n}. It was a fine day." for n in range(300)))
    data = TextData(corpus=f"text:{corpus}", tokenizer="bytes", length=64, mqar_fraction=1.0, mqar_pairs=5)
    objective = LanguageModelObjective(data, BYTES, None, 10, 8, 0, True, DEVICE)
    held_out = set(split_ids(BYTES, HELD_OUT).tolist())
    for step in range(1, 4):
        batch = objective.batch(np.random.default_rng(step), step)
        for tokens, targets in zip(batch.tokens, batch.targets):
            values = targets[targets != IGNORE_INDEX].tolist()
            assert 1 <= len(values) <= 5
            assert not set(tokens[: 2 * len(values)].tolist()) & held_out
    assert set(objective.mqar_validation) == {"mqar_accuracy", "mqar_trained_accuracy"}
    prompts, _ = objective.mqar_validation["mqar_accuracy"][64 * 16]
    assert prompts.shape == (32, 64 * 16 + 1) and set(prompts[:, :10].flatten().tolist()) <= held_out


def test_mqar_training_runs_and_refuses_bad_flags(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "novel.txt").write_text("\n\n".join(f"Chapter {n}. A fine day in the village." for n in range(300)))
    argv = ["text-train", "--arch", "lrnn", "--corpus", f"text:{corpus}", "--tokenizer", "bytes", "--length", "32"]
    argv += ["--batch-size", "2", "--warmup-steps", "1", "--no-progress", "--threads", "1", "--d-model", "16"]
    argv += ["--layers", "1", "--block-size", "4", "--num-blocks", "4", "--d-ff", "32", "--steps", "2"]
    assert main([*argv, "--mqar-fraction", "0.5", "--eval-every", "2", "--out", str(tmp_path / "a")]) == 0
    evaluations = [
        json.loads(line) for line in (tmp_path / "a" / "train.jsonl").read_text().splitlines() if '"eval"' in line
    ]
    assert {"mqar_accuracy_32", "mqar_accuracy_512", "mqar_trained_accuracy_32"} <= set(evaluations[-1])
    capsys.readouterr()
    assert main([*argv, "--mqar-fraction", "0.5", "--mqar-pairs", "65", "--out", "x"]) == 2
    assert "--mqar-pairs 65: an MQAR row holds at most 64 pairs" in capsys.readouterr().err
    assert main([*argv, "--mqar-fraction", "0.5", "--mqar-pairs", "9", "--out", "x"]) == 2
    assert "--mqar-pairs 9 and --mqar-value-tokens 1 need windows of at least 36 tokens (--length 32)" in (
        capsys.readouterr().err
    )
    assert main([*argv, "--mqar-fraction", "0.5", "--mqar-value-tokens", "17", "--out", "x"]) == 2
    assert "--mqar-value-tokens 17: an MQAR value is at most 16 tokens" in capsys.readouterr().err
    too_many = ["--mqar-pairs", "2", "--mqar-value-tokens", "16", "--length", "80"]
    assert main([*argv, "--mqar-fraction", "0.5", *too_many, "--out", "x"]) == 2
    err = capsys.readouterr().err
    assert "need 34 distinct token ids a row, and the tokenizer's held-out split has 32" in err
    value_run = ["--mqar-fraction", "1", "--mqar-pairs", "1", "--mqar-value-tokens", "3", "--eval-every", "2"]
    assert main([*argv, *value_run, "--out", str(tmp_path / "b")]) == 0
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert config["metadata"]["settings"]["mqar_value_tokens"] == 3
    (corpus / "novel.txt").write_text("A fine day in the village. " * 400)  # no paragraph break: no held-out tail
    assert main([*argv, "--mqar-fraction", "0.5", "--eval-every", "2", "--out", "x"]) == 2
    assert "holds no held-out text: each document's tail from a paragraph break" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
