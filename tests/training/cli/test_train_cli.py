"""``python -m training train``: a tiny run's checkpoint and log, bad input, the entry point, torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

from model.checkpoint import load_checkpoint
from tests.training.helpers import TINY_LRNN, TINY_RUN, edit_resume_state, read_log, run_module
from training.cli.main import main
from training.objectives.checkpointing import LOG_FILE, RESUME_FILE, weights_digest

TRAIN_RECORD_KEYS = {
    "event",
    "step",
    "loss",
    "accuracy",
    "max_length",
    "lr",
    "grad_norm",
    "elapsed_s",
    "tokens",
    "tokens_per_s",
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "parity"
    argv = [
        "train",
        "--task",
        "parity_check",
        "--steps",
        "5",
        "--out",
        str(out),
        "--eval-every",
        "2",
        "--log-every",
        "2",
        *TINY_LRNN,
        *TINY_RUN,
    ]
    assert main(argv) == 0
    return out


def test_tiny_run_writes_a_checkpoint_that_loads_beside_its_log(tiny_run: Path) -> None:
    assert sorted(path.name for path in tiny_run.iterdir()) == [
        "config.json",
        "model.safetensors",
        RESUME_FILE,
        LOG_FILE,
    ]
    loaded = load_checkpoint(tiny_run, device="cpu")  # train.jsonl is not read
    config = loaded.config
    assert (config.kind, config.task, config.architecture) == ("transduce", "parity_check", "lrnn")
    assert (config.alphabet, config.labels) == ("01", ("0", "1"))
    assert (config.model.d_model, config.model.block_size, config.model.num_blocks) == (8, 2, 2)


def test_export_best_writes_the_weights_the_checkpoint_holds(tiny_run: Path, tmp_path: Path) -> None:
    """A task run keeps its best weights: ``export --best`` writes those (its checkpoint's), ``export`` the last
    saved step's, each a checkpoint that loads."""
    assert main(["export", str(tiny_run), "--out", str(tmp_path / "best"), "--best"]) == 0
    assert main(["export", str(tiny_run), "--out", str(tmp_path / "last")]) == 0
    checkpoint, best, last = (
        load_checkpoint(folder, device="cpu") for folder in (tiny_run, tmp_path / "best", tmp_path / "last")
    )
    assert weights_digest(best.model) == weights_digest(checkpoint.model)
    assert best.config.metadata["steps"] == last.config.metadata["steps"] == 5
    assert (best.config.task, last.config.metadata["exported"]["best"]) == ("parity_check", False)


def test_metadata_records_the_command_and_the_run(tiny_run: Path) -> None:
    metadata = load_checkpoint(tiny_run, device="cpu").config.metadata
    assert metadata["command"].startswith("python -m training train --task parity_check --steps 5 --out ")
    assert metadata["steps"] == 5 and metadata["stopped"] == "steps" and metadata["world_size"] == 1
    assert metadata["wall_time_s"] > 0
    best = metadata["best_eval"]
    assert best["lengths"] == [41, 60] and best["samples"] == 6 and 0.0 <= best["accuracy"] <= 1.0
    assert best["step"] in (2, 4, 5)
    assert metadata["settings"]["train_lengths"] == [1, 40] and metadata["settings"]["batch_size"] == 4


def test_log_has_one_record_per_logging_step(tiny_run: Path) -> None:
    records = read_log(tiny_run)
    events = [record["event"] for record in records]
    assert events[0] == "start" and events[-1] == "end"
    train_records = [record for record in records if record["event"] == "train"]
    assert [record["step"] for record in train_records] == [2, 4, 5]  # every 2 steps and the last
    assert all(set(record) == TRAIN_RECORD_KEYS for record in train_records)
    assert all(record["loss"] > 0 and 0 <= record["accuracy"] <= 1 for record in train_records)
    assert [record["step"] for record in records if record["event"] == "eval"] == [2, 4, 5]
    end = records[-1]
    assert end["step"] == 5 and end["best_step"] in (2, 4, 5) and len(end["param_sha256"]) == 1
    evals = [record for record in records if record["event"] == "eval"]
    best = max(record["accuracy"] for record in evals)  # a tie keeps the later weights
    assert end["best_step"] == max(record["step"] for record in evals if record["accuracy"] == best)


def test_early_stopping_at_the_target_accuracy(tmp_path: Path) -> None:
    argv = [
        "train",
        "--task",
        "parity_check",
        "--steps",
        "50",
        "--out",
        str(tmp_path / "run"),
        "--eval-every",
        "1",
        "--target-accuracy",
        "0",
        *TINY_LRNN,
        *TINY_RUN,
    ]
    assert main(argv) == 0
    metadata = load_checkpoint(tmp_path / "run", device="cpu").config.metadata
    assert (metadata["steps"], metadata["stopped"]) == (1, "target")


# Each case is appended to a valid command; argparse keeps a repeated flag's last value.
VALID_TRAIN = ["train", "--task", "parity_check", "--arch", "lrnn", "--steps", "3"]
BAD_TRAIN = {
    "unknown task": (["--task", "nope"], "unknown task 'nope'; known tasks: parity_check, even_pairs"),
    "unknown arch": (["--arch", "gru"], "architecture 'gru' is unknown; trainable: regulargpt, lrnn"),
    "zero steps": (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    "negative steps": (["--steps=-3"], "argument --steps: must be a positive integer, got -3"),
    "train lengths": (["--train-lengths", "9-3"], "invalid length range '9-3': 9 > 3"),
    "foreign flag": (["--chunk-size", "2"], "--chunk-size does not apply to --arch lrnn"),
    "out_of_range on lrnn": (["--out-of-range", "null"], "--out-of-range does not apply to --arch lrnn"),
    "out_of_range choice": (["--arch", "regulargpt", "--out-of-range", "pad"], "invalid choice: 'pad'"),
    "bad config": (["--arch", "regulargpt", "--d-model", "10", "--heads", "3"], "must be divisible by n_heads"),
    "p_one and balanced": (
        ["--task", "d2", "--p-one", "0.2", "--balanced"],
        "--balanced and --p-one cannot be combined",
    ),
    "p_times elsewhere": (["--p-times", "0.5"], "--p-times: parity_check has no operators"),
    "p_times and balanced": (
        ["--task", "modular_arithmetic", "--p-times", "0.2-0.9", "--balanced"],
        "--balanced and --p-times cannot be combined",
    ),
    "p_times range order": (["--task", "modular_arithmetic", "--p-times", "0.9-0.1"], "0.9 > 0.1"),
    "p_one range order": (["--p-one", "0.9-0.1"], "invalid probability range '0.9-0.1': 0.9 > 0.1"),
    "p_one range bounds": (["--p-one", "0.1-1.5"], "must be a probability in [0, 1], got 1.5"),
    "stopping without eval": (["--eval-every", "0", "--patience", "2"], "need evaluations: set --eval-every above 0"),
    "unknown flag": (["--bogus"], "unrecognized arguments: --bogus"),
    "too short for the task": (
        ["--task", "induction_heads", "--train-lengths", "1-256"],
        "induction_heads strings have at least 3 symbols; length range 1-256 starts below",
    ),
    "power offsets elsewhere": (
        ["--power-offset-fraction", "0.5"],
        "--power-offset-fraction: parity_check has no such strings",
    ),
    "power offsets and p_one": (
        ["--task", "induction_heads", "--power-offset-fraction", "0.5", "--p-one", "0.2"],
        "it cannot be combined with --p-one, --p-times or --balanced",
    ),
    "power offsets out of range": (["--power-offset-fraction", "1.5"], "must be a probability in [0, 1], got 1.5"),
}


@pytest.mark.parametrize("case", sorted(BAD_TRAIN))
def test_bad_train_input_exits_2_with_one_line(case: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    arguments, message = BAD_TRAIN[case]
    assert main([*VALID_TRAIN, "--out", str(tmp_path / "out"), *arguments]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_regulargpt_trains_with_null_out_of_range_slots(tmp_path: Path) -> None:
    argv = [
        "train",
        "--task",
        "parity_check",
        "--arch",
        "regulargpt",
        "--out-of-range",
        "null",
        "--d-model",
        "8",
        "--heads",
        "2",
        "--d-ff",
        "8",
        "--steps",
        "2",
        "--out",
        str(tmp_path / "run"),
        *TINY_RUN,
    ]
    assert main(argv) == 0
    model = load_checkpoint(tmp_path / "run", device="cpu").config.model
    assert model.out_of_range == "null"


def test_an_existing_checkpoint_is_kept_without_overwrite(tiny_run: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["train", "--task", "parity_check", "--steps", "1", "--out", str(tiny_run), *TINY_LRNN, *TINY_RUN]
    assert main(argv) == 2
    assert "already holds a checkpoint; pass --overwrite" in capsys.readouterr().err


def test_entry_point_exits_2_without_a_traceback() -> None:
    result = run_module(
        "-m", "training", "train", "--task", "parity_check", "--arch", "lrnn", "--steps", "0", "--out", "unused"
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: python -m training train: argument --steps: must be a positive integer, got 0"
    ]


def test_top_level_help_has_a_summary_per_command_and_says_where_its_flags_are(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    assert "python -m training <command> --help lists a command's flags" in text
    for name in ("train", "eval", "compile", "upgrade", "export", "bpe", "text-train", "text-eval"):
        (line,) = [line for line in text.splitlines() if line.split()[:1] == [name]]
        assert len(line.split()) >= 5, line  # the name and its summary on one line
    with pytest.raises(SystemExit):
        main(["text-train", "--help"])
    text = capsys.readouterr().out
    assert text.startswith("usage: python -m training text-train ") and "--time-budget" in text


@pytest.mark.slow
def test_torchrun_two_processes_agree_and_write_once(tmp_path: Path) -> None:
    out = tmp_path / "ddp"
    result = run_module(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "training",
        "train",
        "--task",
        "parity_check",
        "--steps",
        "4",
        "--out",
        str(out),
        "--eval-every",
        "2",
        "--log-every",
        "1",
        "--device",
        "cpu",
        *TINY_LRNN,
        *TINY_RUN,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors", RESUME_FILE, LOG_FILE]
    records = read_log(out)
    assert [record["event"] for record in records].count("start") == 1  # rank 0 alone writes
    assert [record["step"] for record in records if record["event"] == "train"] == [1, 2, 3, 4]
    assert records[0]["world_size"] == 2
    digests = records[-1]["param_sha256"]
    assert len(digests) == 2 and digests[0] == digests[1]  # DDP kept the weights identical
    loaded = load_checkpoint(out, device="cpu")
    assert weights_digest(loaded.model) == digests[0]  # the one checkpoint holds the weights both ranks agree on
    metadata = loaded.config.metadata
    assert metadata["world_size"] == 2
    assert metadata["command"].startswith("torchrun --nproc_per_node=2 -m training train --task parity_check")
    assert result.stdout.count("wrote ") == 1


GROUP_LIFETIME = """
import os, sys
sys.path.insert(0, os.getcwd())  # the repository (run_module's working directory)
import torch
from training.objectives.distributed import setup_distributed
dist = setup_distributed("cpu")
model = dist.wrap(torch.nn.Linear(3, 3))
model(torch.ones(2, 3)).sum().backward()
cycle = [model]
cycle.append(cycle)  # the training loop's wrapper is held in reference cycles too: only a collection frees it
del model, cycle
dist.close()
print(sorted(open(f"/proc/self/task/{task}/comm").read().strip() for task in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads thread names from /proc")
def test_closing_the_group_stops_its_threads_before_exit(tmp_path: Path) -> None:
    """After ``Distributed.close`` no gloo thread is left alive to abort the process at interpreter exit."""
    script = tmp_path / "group_lifetime.py"
    script.write_text(GROUP_LIFETIME)
    result = run_module("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", str(script))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "gloo" not in result.stdout and "python" in result.stdout


def test_power_offsets_and_final_only_change_the_run_and_a_run_saved_before_them_resumes(tmp_path: Path) -> None:
    """--power-offset-fraction and --final-only reach the batches (other runs than without them, saved for resume);
    a resume file without their keys (every run before them) resumes as a run without them."""
    flags = [
        "train",
        "--task",
        "induction_heads",
        "--train-lengths",
        "3-40",
        "--eval-lengths",
        "50-60",
        "--steps",
        "4",
        "--eval-every",
        "2",
        "--log-every",
        "2",
        "--threads",
        "1",
        *TINY_LRNN,
        *TINY_RUN,
    ]
    digests = {}
    for name, extra in {"plain": [], "powers": ["--power-offset-fraction", "1"], "final": ["--final-only"]}.items():
        assert main([*flags, "--out", str(tmp_path / name), *extra]) == 0
        digests[name] = read_log(tmp_path / name)[-1]["param_sha256"]
    assert len({tuple(digest) for digest in digests.values()}) == 3
    out = tmp_path / "older"
    assert main([*flags, "--out", str(out), "--time-budget", "0.001"]) == 0

    def drop(state: dict) -> None:
        assert state["objective"].pop("power_offset_fraction") == 0.0
        assert state["objective"].pop("final_only") is False

    edit_resume_state(out, drop)
    assert main([*flags, "--out", str(out), "--resume"]) == 0
    assert read_log(out)[-1]["param_sha256"] == digests["plain"]


def test_a_regulargpt_run_saved_before_level_codes_resumes_as_it_ran(tmp_path: Path) -> None:
    """A resume file whose model config lacks a key a later format added (level_codes, format 5) resumes with that
    key as older files meant it, to the weights of the uncut run; a model config the build cannot read exits 2."""
    flags = ["train", "--task", "parity_check", "--steps", "4", "--eval-every", "2", "--threads", "1"]
    flags += ["--arch", "regulargpt", "--d-model", "8", "--heads", "2", "--d-ff", "16", *TINY_RUN]
    assert main([*flags, "--out", str(tmp_path / "uncut")]) == 0
    out = tmp_path / "older"
    assert main([*flags, "--out", str(out), "--time-budget", "0.001"]) == 0
    edit_resume_state(out, lambda state: state["model"].pop("level_codes"))
    assert main([*flags, "--out", str(out), "--resume"]) == 0
    assert read_log(out)[-1]["param_sha256"] == read_log(tmp_path / "uncut")[-1]["param_sha256"]
    broken = tmp_path / "broken"
    assert main([*flags, "--out", str(broken), "--time-budget", "0.001"]) == 0
    edit_resume_state(broken, lambda state: state["model"].update(d_ff="wide"))
    assert main([*flags, "--out", str(broken), "--resume"]) == 2
