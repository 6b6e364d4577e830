"""``python -m training eval``: protocols and bands, the JSON and text reports, several checkpoints, bad input."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.checkpoint import save_checkpoint
from model.config import CheckpointConfig, LRNNConfig, LSTMConfig
from model.registry import build_model
from training.cli.main import main
from training.data.tasks import get_task
from training.evaluation.evaluate import Band, draw_bands, protocol_bands, split_lengths

REPO = Path(__file__).resolve().parents[3]
BAND_KEYS = {"lengths", "p_one", "p_times", "samples", "accuracy"}
REPORT_KEYS = {"checkpoint", "task", "architecture", "protocol", "seed", "power_offsets", "bands", "overall"}


def write_transducer(folder: Path, task_name: str, seed: int = 0) -> Path:
    task = get_task(task_name)
    config = LRNNConfig(
        vocab_size=len(task.alphabet), num_labels=len(task.labels), d_model=8, block_size=2, num_blocks=2, d_ff=16
    )
    torch.manual_seed(seed)
    checkpoint = CheckpointConfig(
        architecture="lrnn", model=config, kind="transduce", task=task.name, alphabet=task.alphabet, labels=task.labels
    )
    return save_checkpoint(build_model("lrnn", config), checkpoint, folder)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return [write_transducer(root / f"seed{seed}", "parity_check", seed) for seed in range(2)]


def run_eval(capsys: pytest.CaptureFixture, *arguments: str) -> tuple[int, str, str]:
    status = main(["eval", *arguments])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_split_lengths_covers_the_range_in_contiguous_bands() -> None:
    bands = split_lengths((41, 500), 10)
    assert bands[0][0] == 41 and bands[-1][1] == 500 and len(bands) == 10
    assert all(previous[1] + 1 == following[0] for previous, following in itertools.pairwise(bands))
    assert split_lengths((5, 7), 10) == [(5, 5), (6, 6), (7, 7)]


def test_papers_protocol_uses_each_suite_s_lengths() -> None:
    for name, lengths in [
        ("parity_check", (41, 500)),
        ("modular_arithmetic", (41, 500)),
        ("d12", (51, 100)),
        ("tomita6", (51, 100)),
    ]:
        bands = protocol_bands(get_task(name), "papers", 5, 100)
        assert (bands[0].lengths[0], bands[-1].lengths[1]) == lengths
        assert {band.p_one for band in bands} == {None}


def test_hard_protocol_adds_skewed_bands() -> None:
    binary = protocol_bands(get_task("parity_check"), "hard", 3, 100)
    assert [band.p_one for band in binary] == [None] * 3 + [0.1] * 3 + [0.9] * 3
    assert binary[0] == Band((501, 1000), None) and binary[2].lengths[1] == 2000
    assert {band.p_one for band in protocol_bands(get_task("sum_mod5"), "hard", 3, 100)} == {None, 0.1, 0.9}


def test_induction_protocol_has_mamba_s_lengths_with_fewer_samples_past_2_14() -> None:
    bands = protocol_bands(get_task("induction_heads"), "induction", 10, 100)
    assert [band.lengths for band in bands] == [(2**k, 2**k) for k in range(6, 21)]
    assert [band.samples for band in bands] == [100] * 9 + [64, 32, 16, 8, 4, 4]
    few = protocol_bands(get_task("induction_heads"), "induction", 10, 5)
    assert [band.samples for band in few] == [5] * 13 + [4] * 2


def test_induction_protocol_evaluates_through_the_cache(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The first bands of the protocol (the rest is the same code at longer lengths), in chunks of 50 symbols:
    the same accuracies as final_logits over whole batches."""
    folder = write_transducer(tmp_path / "induction", "induction_heads")
    reports = []
    for chunking in ([], ["--chunk-symbols", "50"]):
        status, out, _ = run_eval(
            capsys,
            "--checkpoint",
            str(folder),
            "--bands",
            "64-64,100-130",
            "--samples",
            "6",
            "--batch-size",
            "4",
            "--json",
            *chunking,
        )
        assert status == 0
        reports.append(json.loads(out))
    assert reports[0]["bands"] == reports[1]["bands"]
    assert [band["samples"] for band in reports[0]["bands"]] == [6, 6]
    status, _, err = run_eval(capsys, "--checkpoint", str(folder), "--lengths", "2-10")
    assert status == 2 and "induction_heads strings have at least 3 symbols; length range 2-" in err


def test_power_offsets_draw_the_mark_a_power_of_two_before_the_end(tmp_path: Path, capsys) -> None:
    """``--power-offsets``: every string of every band has its "#" 2**k before the final one (k >= 1); the report
    says so; other tasks, or --p-one beside it, exit 2."""
    task = get_task("induction_heads")
    bands = [Band((3, 40)), Band((64, 64)), Band((1000, 1000))]
    for examples in draw_bands(task, bands, 30, seed=1, power_offsets=True):
        offsets = {len(string) - 1 - string.index("#") for string in examples.strings}
        assert all(offset >= 2 and offset & (offset - 1) == 0 for offset in offsets), offsets
        assert all(string.count("#") == 2 and string.endswith("#") for string in examples.strings)
    uniform = draw_bands(task, bands[1:2], 30, seed=1)[0].strings
    assert any((offset := len(string) - 1 - string.index("#")) & (offset - 1) for string in uniform)
    folder = write_transducer(tmp_path / "induction", "induction_heads")
    status, out, _ = run_eval(
        capsys, "--checkpoint", str(folder), "--bands", "64-64", "--samples", "4", "--json", "--power-offsets"
    )
    assert status == 0 and json.loads(out)["power_offsets"] is True
    status, out, _ = run_eval(
        capsys, "--checkpoint", str(folder), "--bands", "64-64", "--samples", "4", "--power-offsets"
    )
    assert status == 0 and out.splitlines()[0].endswith("strings: the mark a power of two before the end")
    for arguments, message in [
        (
            ["--checkpoint", str(write_transducer(tmp_path / "parity", "parity_check"))],
            "--power-offsets: parity_check has no such strings (only induction_heads has)",
        ),
        (["--checkpoint", str(folder), "--lengths", "64-80", "--p-one", "0.5"], "cannot be combined with --p-one"),
    ]:
        status, out, err = run_eval(capsys, *arguments, "--power-offsets")
        assert status == 2 and message in err and out == "", err


def test_json_report_schema(checkpoints: list[Path], capsys: pytest.CaptureFixture) -> None:
    status, out, _ = run_eval(
        capsys,
        "--checkpoint",
        str(checkpoints[0]),
        "--lengths",
        "41-60",
        "--bands",
        "2",
        "--samples",
        "5",
        "--p-one",
        "0.9",
        "--json",
    )
    assert status == 0
    report = json.loads(out)
    assert set(report) == REPORT_KEYS
    assert (report["task"], report["architecture"], report["protocol"]) == ("parity_check", "lrnn", "custom")
    assert [band["lengths"] for band in report["bands"]] == [[41, 50], [51, 60]]
    assert all(set(band) == BAND_KEYS and band["p_one"] == 0.9 and band["samples"] == 5 for band in report["bands"])
    assert report["overall"] == pytest.approx(sum(band["accuracy"] for band in report["bands"]) / 2)


def test_p_times_bands_for_modular_arithmetic(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """One set of bands per --p-times value, each with every --p-one; the table shows the column then only."""
    folder = str(write_transducer(tmp_path / "modular", "modular_arithmetic"))
    arguments = ["--checkpoint", folder, "--bands", "5-9,11-15", "--samples", "3"]
    status, out, _ = run_eval(capsys, *arguments, "--p-times", "0.9", "--p-times", "1", "--p-one", "0.5", "--json")
    assert status == 0
    bands = json.loads(out)["bands"]
    assert [(band["lengths"], band["p_one"], band["p_times"]) for band in bands] == [
        ([5, 9], 0.5, 0.9),
        ([11, 15], 0.5, 0.9),
        ([5, 9], 0.5, 1.0),
        ([11, 15], 0.5, 1.0),
    ]
    status, out, _ = run_eval(capsys, *arguments, "--p-times", "1")
    assert (
        status == 0
        and "\nlengths       p_one p_times  samples" in out
        and "\n11-15             -       1        3" in out
    )
    status, out, _ = run_eval(capsys, *arguments)
    assert status == 0 and "\nlengths       p_one  samples" in out
    times = draw_bands(get_task("modular_arithmetic"), [Band((39, 39), p_times=1.0)], 4, seed=0)[0]
    assert all(set(string[1::2]) == {"*"} for string in times.strings)


def test_several_checkpoints_give_max_and_mean(checkpoints: list[Path], capsys: pytest.CaptureFixture) -> None:
    arguments = [item for path in checkpoints for item in ("--checkpoint", str(path))]
    status, out, _ = run_eval(capsys, *arguments, "--bands", "41-45,46-50", "--samples", "4", "--json")
    assert status == 0
    combined = json.loads(out)
    assert set(combined) == {"task", "protocol", "seed", "power_offsets", "checkpoints", "bands", "max", "mean"}
    assert [set(report) for report in combined["checkpoints"]] == [REPORT_KEYS] * 2
    overall = [report["overall"] for report in combined["checkpoints"]]
    assert combined["max"] == max(overall) and combined["mean"] == pytest.approx(sum(overall) / 2)
    first_band = [report["bands"][0]["accuracy"] for report in combined["checkpoints"]]
    assert combined["bands"][0]["max"] == max(first_band)
    assert combined["bands"][0]["mean"] == pytest.approx(sum(first_band) / 2)


def test_text_report_and_plot(checkpoints: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plot = tmp_path / "accuracy.png"
    status, out, _ = run_eval(
        capsys,
        "--checkpoint",
        str(checkpoints[0]),
        "--checkpoint",
        str(checkpoints[1]),
        "--lengths",
        "41-50",
        "--bands",
        "2",
        "--samples",
        "3",
        "--plot",
        str(plot),
    )
    assert status == 0
    lines = out.splitlines()
    assert lines[0] == "task parity_check  protocol custom  seed 0"
    assert lines[3].split() == ["lengths", "p_one", "samples", "[1]", "[2]", "max", "mean"]
    assert lines[4].split()[:3] == ["41-45", "-", "3"] and lines[-1].startswith("overall")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def write_text_model(folder: Path) -> Path:
    config = LSTMConfig(vocab_size=5, d_model=8, hidden_size=8)
    checkpoint = CheckpointConfig(architecture="lstm", model=config, kind="generate", tokenizer="bytes")
    return save_checkpoint(build_model("lstm", config), checkpoint, folder)


def test_bad_eval_input_exits_2_with_one_line(
    checkpoints: list[Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    good = str(checkpoints[0])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    text_model = str(write_text_model(tmp_path / "text"))
    cases = {
        "invalid length range '41': expected A-B": ["--checkpoint", good, "--lengths", "41"],
        "invalid length range '500-41': 500 > 41": ["--checkpoint", good, "--lengths", "500-41"],
        "invalid length range '0-10': lengths start at 1": ["--checkpoint", good, "--lengths", "0-10"],
        "config.json: missing": ["--checkpoint", str(tmp_path / "nowhere")],
        "config.json: not valid JSON": ["--checkpoint", str(broken)],
        "is a text model (kind 'generate')": ["--checkpoint", good, "--checkpoint", str(text_model)],
        "no train_length in its metadata; give --train-length": ["--checkpoint", str(text_model)],  # text-eval
        "the checkpoints are of different tasks": [
            "--checkpoint",
            good,
            "--checkpoint",
            str(write_transducer(tmp_path / "sum", "sum_mod5")),
        ],
        "not allowed with argument --protocol": ["--checkpoint", good, "--protocol", "hard", "--lengths", "41-50"],
        "--p-one goes with --lengths": ["--checkpoint", good, "--protocol", "hard", "--p-one", "0.1"],
        "--p-one goes with --lengths or": ["--checkpoint", good, "--p-one", "0.1"],
        "--p-times goes with --lengths or": ["--checkpoint", good, "--p-times", "0.1"],
        "--p-times: parity_check has no operators": ["--checkpoint", good, "--lengths", "5-9", "--p-times", "0.1"],
        "unrecognized arguments: --bogus": ["--checkpoint", good, "--bogus"],
    }
    for message, arguments in cases.items():
        status, out, err = run_eval(capsys, *arguments)
        assert status == 2, message
        assert message in err and err.count("\n") == 1 and out == "", (message, err)


def test_entry_point_runs_eval(checkpoints: list[Path]) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "eval",
            "--checkpoint",
            str(checkpoints[0]),
            "--lengths",
            "41-50",
            "--bands",
            "1",
            "--samples",
            "2",
            "--json",
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["bands"][0]["samples"] == 2
