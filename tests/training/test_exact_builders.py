"""The hand-built constructions against the reference labelers, the published PALINDROME's float32 failure and the
sound variant, cross-entropy with and without layer norm, and the checkpoint folders."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint, read_config, read_weights
from training.data.tasks import get_task
from training.exact_builders import (
    CONSTRUCTIONS,
    DEFAULT_CROSS_ENTROPY,
    PUBLISHED_ZERO_TEST_TOLERANCE,
    SHIPPED,
    main,
    palindrome,
    palindrome_mirror,
    to_model,
    with_layer_norm,
    write_checkpoints,
)

TASK_OF = {"parity": "parity_check", "first": "first", "one": "one"}


def encode(strings: list[str]) -> torch.Tensor:
    """Token ids, right-padded with 0: (B, longest)."""
    longest = max(map(len, strings))
    return torch.tensor([[int(symbol) for symbol in string.ljust(longest, "0")] for string in strings])


def all_strings(length: int) -> list[str]:
    return ["".join(symbols) for symbols in itertools.product("01", repeat=length)]


def assert_labels_every_prefix(model, task_name: str, length: int = 10) -> None:
    """forward on every string of ``length`` labels every prefix, i.e. every string of length 1..length."""
    strings = all_strings(length)
    with torch.no_grad():
        predicted = model(encode(strings)).argmax(-1)  # (B, T)
    expected = torch.tensor([[int(label) for label in get_task(task_name).label(s)] for s in strings])
    assert torch.equal(predicted, expected)


def final_predictions(model, strings: list[str]) -> list[str]:
    lengths = torch.tensor([len(string) for string in strings])
    with torch.no_grad():
        return [str(label) for label in model.final_logits(encode(strings), lengths).argmax(-1).tolist()]


def one_flip(palindrome_string: str, position: int) -> str:
    flipped = "1" if palindrome_string[position] == "0" else "0"
    return palindrome_string[:position] + flipped + palindrome_string[position + 1 :]


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda shipped: shipped.task)
def test_shipped_models_label_every_string_up_to_length_10(shipped) -> None:
    assert_labels_every_prefix(shipped.build(), shipped.task)


@pytest.mark.parametrize("name", ["parity", "first", "one"])
def test_published_constructions_without_layer_norm_label_every_string_up_to_length_10(name: str) -> None:
    assert_labels_every_prefix(to_model(CONSTRUCTIONS[name]()), TASK_OF[name])


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda shipped: shipped.task)
def test_shipped_models_on_long_strings(shipped) -> None:
    task, model, rng = get_task(shipped.task), shipped.build(), np.random.default_rng(7)
    for length in (57, 300, 1000):
        strings = [task.sample(rng, length, balanced=True) for _ in range(4)]
        strings += ["0" * length, "1" + "0" * (length - 1), "0" * (length - 1) + "1", "1" * length]
        assert final_predictions(model, strings) == [task.label(string)[-1] for string in strings]


def test_shipped_parity_counts_a_long_run_of_ones() -> None:
    """In float32 the first layer's average k/n is too coarse on 1^n from n = 9225 (docs/exact_results.md)."""
    shipped = next(shipped for shipped in SHIPPED if shipped.task == "parity_check")
    assert final_predictions(shipped.build(), ["1" * 9225]) == ["1"]


def test_published_palindrome_in_float32_with_the_papers_margin_fails_from_23_symbols() -> None:
    """float32 with the published code's margin |s| <= 1e-7: right on every string up to 10 symbols; a mismatch at
    the first symbol gives |s| = 2 / (2^(m + 2) - 1) for m symbols, right at m = 22 and missed from m = 23 on
    (checked at 23, 38, 39, 45, 60); and wrong on some of 40 label-balanced strings at every m in 38..45."""
    published = to_model(palindrome(), compute_dtype="float32", zero_test_tolerance=PUBLISHED_ZERO_TEST_TOLERANCE)
    assert_labels_every_prefix(published, "palindrome", length=10)
    for length in (22, 23, 38, 39, 45, 60):
        string = one_flip("0" * length, 0)
        assert final_predictions(published, [string]) == (["0"] if length < 23 else ["1"])
    rng = np.random.default_rng(3)
    task = get_task("palindrome")
    for length in range(38, 46):
        strings = [task.sample(rng, length, balanced=True) for _ in range(40)]
        correct = np.mean([p == task.label(s)[-1] for p, s in zip(final_predictions(published, strings), strings)])
        assert correct < 1.0


def test_sound_palindrome_is_right_at_length_1000_with_its_full_margin() -> None:
    """The mismatch flags are exactly 0 on a palindrome, so its logit is exactly the margin; a single flipped
    symbol still draws CLS's attention to its two flags, so the logit is about minus the margin."""
    model = to_model(palindrome_mirror(), compute_dtype="float64")
    margin = -math.log(math.expm1(DEFAULT_CROSS_ENTROPY))
    rng = np.random.default_rng(11)
    halves = ["".join(rng.choice(["0", "1"], 500)) for _ in range(2)]
    palindromes = [half + half[::-1] for half in halves] + ["0" * 1000]
    strings = palindromes + [one_flip(p, position) for p in palindromes for position in (0, 499, 500, 999, 137)]
    with torch.no_grad():
        logits = model.final_logits(encode(strings))
    margins = (logits[:, 1] - logits[:, 0]).tolist()
    assert margins[:3] == pytest.approx([margin] * 3, abs=1e-12)
    assert max(margins[3:]) < -0.99 * margin


def cross_entropy_bits(model, task_name: str, length: int, count: int = 8) -> float:
    task, rng = get_task(task_name), np.random.default_rng(length)
    strings = [task.sample(rng, length) for _ in range(count)]
    labels = torch.tensor([int(task.label(string)[-1]) for string in strings])
    with torch.no_grad():
        logits = model.final_logits(encode(strings)).double()
    return float(torch.nn.functional.cross_entropy(logits, labels)) / math.log(2)


@pytest.mark.parametrize("name", ["parity", "first"])
def test_layer_norm_with_eps_0_keeps_cross_entropy_at_its_target_at_every_length(name: str) -> None:
    """Chiang & Cholak 2022, Fig. 2: without layer norm the cross-entropy nears 1 bit; with eps = 0 it stays put."""
    plain = to_model(CONSTRUCTIONS[name]())
    normalised = to_model(with_layer_norm(CONSTRUCTIONS[name]()), layer_norm=True, layer_norm_eps=0.0)
    target_bits = DEFAULT_CROSS_ENTROPY / math.log(2)
    for length in (10, 400):
        assert cross_entropy_bits(normalised, TASK_OF[name], length) == pytest.approx(target_bits, rel=1e-2)
    assert cross_entropy_bits(plain, TASK_OF[name], 400) > 0.99


def test_written_checkpoints_load_back_and_compute_the_same(tmp_path) -> None:
    folders = write_checkpoints(tmp_path)
    assert sorted(folder.name for folder in folders) == [
        "first-exact",
        "one-exact",
        "palindrome-exact",
        "parity_check-exact",
    ]
    strings = ["0110", "1", "10001"]
    for shipped, folder in zip(SHIPPED, folders):
        loaded = load_checkpoint(folder, device="cpu")
        assert (loaded.config.architecture, loaded.config.task) == ("exact", shipped.task)
        assert (loaded.config.alphabet, loaded.config.labels) == ("01", ("0", "1"))
        assert loaded.model.dtype == {"float32": torch.float32, "float64": torch.float64}[shipped.compute_dtype]
        tokens = encode(["10001", "01010"])
        with torch.no_grad():
            torch.testing.assert_close(loaded.model(tokens), shipped.build()(tokens), rtol=0, atol=0)
        assert final_predictions(loaded.model, strings) == [get_task(shipped.task).label(s)[-1] for s in strings]


@pytest.mark.parametrize("shipped", SHIPPED, ids=lambda shipped: shipped.task)
def test_shipped_checkpoint_folders_equal_a_fresh_build(shipped) -> None:
    """checkpoints/<task>-exact is this module's output (python -m training.exact_builders --out checkpoints/
    --overwrite)."""
    folder = Path(__file__).resolve().parents[2] / "checkpoints" / shipped.folder_name
    model, config = shipped.checkpoint()
    assert read_config(folder).to_dict() == config.to_dict()
    stored, fresh = read_weights(folder / "model.safetensors"), model.state_dict()
    assert sorted(stored) == sorted(fresh)
    for name, tensor in fresh.items():
        assert torch.equal(stored[name], tensor), name


def test_command_line_writes_the_requested_tasks(tmp_path, capsys) -> None:
    assert main(["--out", str(tmp_path), "--tasks", "first", "one"]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["first-exact", "one-exact"]
    assert "first-exact" in capsys.readouterr().out


def test_command_line_replaces_checkpoints_only_with_overwrite(tmp_path, capsys) -> None:
    assert main(["--out", str(tmp_path), "--tasks", "one"]) == 0
    weights = tmp_path / "one-exact" / "model.safetensors"
    weights.write_bytes(b"stale")
    capsys.readouterr()
    assert main(["--out", str(tmp_path), "--tasks", "first", "one"]) == 2
    captured = capsys.readouterr()
    assert (
        captured.err == f"error: {tmp_path / 'one-exact'} already holds a checkpoint; pass --overwrite to replace it\n"
    )
    assert captured.out == "" and weights.read_bytes() == b"stale" and not (tmp_path / "first-exact").exists()
    assert main(["--out", str(tmp_path), "--tasks", "first", "one", "--overwrite"]) == 0
    assert load_checkpoint(tmp_path / "one-exact", device="cpu").config.task == "one"


def test_command_line_refuses_an_out_that_is_a_file(tmp_path, capsys) -> None:
    path = tmp_path / "file"
    path.write_text("not a folder")
    assert main(["--out", str(path)]) == 2
    assert capsys.readouterr().err == f"error: --out {path} exists and is not a folder\n"
    assert main(["--out", str(path / "below"), "--tasks", "one"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write under {path / 'below'}: ") and err.count("\n") == 1
    assert path.read_text() == "not a folder"
