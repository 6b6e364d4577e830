"""Language-model training and evaluation end to end on tiny models and a made corpus: ``bpe``,
``text-train`` (in-memory and streamed OpenWebText2 corpora), ``text-eval`` (report schema, plots), the
token windows, and bad input. No network."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from model.checkpoint import load_checkpoint
from model.tokenizer import load_tokenizer
from server.models.store import load_served_model
from tests.training.helpers import edit_resume_state
from training.cli.main import main
from training.data.corpus import Document
from training.data.text_batches import StreamedWindows, TokenArray, tokenize_documents
from training.objectives import loop as loop_module
from training.objectives.checkpointing import read_resume_state

pytestmark = pytest.mark.usefixtures("no_network")

TINY = ["--d-model", "16", "--d-ff", "32"]
ARCHITECTURES = {
    "regulargpt": ["--chunk-size", "4", "--thickness", "2", "--heads", "2"],
    "lrnn": ["--layers", "1", "--block-size", "4", "--num-blocks", "4"],
    "transformer": ["--position", "alibi", "--layers", "1", "--heads", "2"],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("corpus")
    words = [
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "the",
        "lazy",
        "dog",
        "while",
        "a",
        "naïve",
        "cat",
        "watches",
        "👀",
    ]
    rng = np.random.default_rng(0)
    for name in ("one", "two"):
        paragraphs = [" ".join(rng.choice(words, size=30)) for _ in range(40)]
        (folder / f"{name}.txt").write_text("\n\n".join(paragraphs))
    return folder


@pytest.fixture(scope="module")
def ranks(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tiny.tiktoken"
    assert main(["bpe", "--corpus", f"text:{corpus}", "--ranks", "300", "--out", str(path)]) == 0
    return path


def train(out, corpus_spec, ranks, architecture, *extra):
    return main(
        [
            "text-train",
            "--arch",
            architecture,
            "--corpus",
            corpus_spec,
            "--tokenizer",
            str(ranks),
            "--out",
            str(out),
            "--length",
            "16",
            "--batch-size",
            "4",
            "--steps",
            "6",
            "--warmup-steps",
            "2",
            "--eval-every",
            "3",
            "--log-every",
            "2",
            "--no-progress",
            "--threads",
            "1",
            *TINY,
            *ARCHITECTURES[architecture],
            *extra,
        ]
    )


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURES))
def test_tiny_training_run_writes_a_served_generate_checkpoint(tmp_path, corpus, ranks, architecture) -> None:
    out = tmp_path / architecture
    assert train(out, f"text:{corpus}", ranks, architecture) == 0
    loaded = load_checkpoint(out)
    assert loaded.config.kind == "generate" and loaded.config.tokenizer == "file:tokenizer.tiktoken"
    assert (out / "tokenizer.tiktoken").read_bytes() == ranks.read_bytes()
    assert loaded.config.model.vocab_size == 301 and loaded.config.metadata["train_length"] == 16
    assert loaded.config.metadata["stopped"] == "steps" and loaded.config.metadata["tokens"] == 6 * 4 * 16
    events = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["start", "train", "eval", "train", "train", "eval", "end"]
    assert all(e["tokens_per_s"] > 0 and math.isfinite(e["loss"]) for e in events if e["event"] == "train")
    assert math.isclose(events[-2]["validation_perplexity"], math.exp(events[-2]["validation_loss"]))
    served = load_served_model(out, "cpu")  # what `python -m server` does with the folder
    prompt = served.tokenizer.encode("the quick brown")
    logits = served.model.final_logits(torch.tensor([prompt]))
    assert logits.shape == (1, 301) and torch.isfinite(logits).all()


def test_training_on_streamed_owt2_shards(tmp_path, ranks) -> None:
    zstandard = pytest.importorskip("zstandard")
    shards = tmp_path / "owt2"
    shards.mkdir()
    for index in range(2):
        lines = [json.dumps({"text": f"document {index} {n} " + "the lazy dog " * 10, "meta": {}}) for n in range(5)]
        (shards / f"part{index}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("\n".join(lines).encode()))
    out = tmp_path / "owt2-model"
    assert (
        train(out, f"owt2:{shards}", ranks, "transformer", "--validation-corpus", f"owt2:{shards / 'part1.jsonl.zst'}")
        == 0
    )
    events = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert events[0]["train_tokens"] is None and any(e["event"] == "eval" for e in events)


@pytest.mark.parametrize("flag", ["--passkey-fraction", "--recall-fraction", "--mqar-fraction"])
def test_examples_on_a_streamed_corpus_exit_2(tmp_path, ranks, capsys, flag) -> None:
    """Pass-key, retrieval and MQAR rows are cut into the in-memory corpus's text: on streamed shards, exit 2 saying so."""
    zstandard = pytest.importorskip("zstandard")
    shard = tmp_path / "part0.jsonl.zst"
    shard.write_bytes(zstandard.ZstdCompressor().compress(json.dumps({"text": "the lazy dog " * 40}).encode()))
    assert (
        train(
            tmp_path / "out",
            f"owt2:{shard}",
            ranks,
            "lrnn",
            flag,
            "0.5",
            "--length",
            "512",
            "--validation-corpus",
            f"owt2:{shard}",
        )
        == 2
    )
    assert "is streamed: pass-key, retrieval and MQAR examples" in capsys.readouterr().err


def test_time_budget_stops_training(tmp_path, corpus, ranks) -> None:
    out = tmp_path / "timed"
    assert (
        main(
            [
                "text-train",
                "--arch",
                "lstm",
                "--corpus",
                f"text:{corpus}",
                "--tokenizer",
                str(ranks),
                "--out",
                str(out),
                "--length",
                "8",
                "--steps",
                "100000",
                "--time-budget",
                "0.5",
                "--eval-every",
                "0",
                "--no-progress",
                "--d-model",
                "8",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    assert load_checkpoint(out).config.metadata["stopped"] == "time"


def test_text_train_retried_with_resume_appended_goes_on(tmp_path, corpus, ranks, capsys) -> None:
    """The same flags with --resume are accepted (as typed, or in the ``train --corpus`` spelling); a flag that
    differs, or another subcommand's, is refused with what the run started with."""
    out = tmp_path / "requeued"
    assert train(out, f"text:{corpus}", ranks, "lrnn", "--time-budget", "0.001") == 0
    assert load_checkpoint(out).config.metadata["stopped"] == "time"
    capsys.readouterr()
    assert train(out, f"text:{corpus}", ranks, "lrnn", "--resume", "--length", "8") == 2
    assert "--length is 8 here but was 16 when the run started" in capsys.readouterr().err
    assert main(["train", "--task", "parity_check", "--out", str(out), "--resume"]) == 2
    assert "was started by 'text-train', not 'train'" in capsys.readouterr().err
    spec_spelling = ["train", "--corpus", f"text:{corpus}", "--tokenizer", str(ranks), "--arch", "lrnn"]
    assert main([*spec_spelling, "--out", str(out), "--resume", "--time-budget", "0.001", "--no-progress"]) == 0
    assert train(out, f"text:{corpus}", ranks, "lrnn", "--resume") == 0
    assert load_checkpoint(out).config.metadata["steps"] == 6


def test_a_run_killed_before_its_first_checkpoint_resumes(tmp_path, corpus, ranks, monkeypatch) -> None:
    """A run killed after its first resume save and before any checkpoint (no config.json, no model.safetensors)
    still holds the tokenizer that --resume reads: it is written when the run starts."""
    out = tmp_path / "killed"

    def killed(*args, **kwargs) -> None:
        raise SystemExit("killed")

    monkeypatch.setattr("training.objectives.loop.save_run_checkpoint", killed)
    with pytest.raises(SystemExit, match="killed"):  # at step 3's evaluation, just after resume.safetensors
        train(out, f"text:{corpus}", ranks, "lrnn")
    assert not (out / "config.json").exists() and (out / "resume.safetensors").exists()
    assert (out / "tokenizer.tiktoken").read_bytes() == ranks.read_bytes()
    monkeypatch.undo()
    assert main(["text-train", "--resume", "--out", str(out), "--no-progress"]) == 0
    assert load_checkpoint(out).config.metadata["steps"] == 6


def test_text_train_resume_with_nothing_saved_yet_starts_the_run_from_step_0(
    tmp_path, corpus, ranks, monkeypatch, capsys
) -> None:
    """A run killed before its first save left its log and tokenizer copy only, nothing to resume: its command again
    with --resume appended starts it anew and says so in one line on stderr (so on an empty folder too); without
    the flags a new run needs, that is refused."""
    out = tmp_path / "killed"

    def killed(*args, **kwargs) -> None:
        raise SystemExit("killed")

    with monkeypatch.context() as patch:
        patch.setattr("training.objectives.loop.save_resume", killed)
        with pytest.raises(SystemExit, match="killed"):  # at step 3, before its evaluation's save
            train(out, f"text:{corpus}", ranks, "lrnn")
    assert {path.name for path in out.iterdir()} == {"train.jsonl", "tokenizer.tiktoken"}
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["text-train", "--resume", "--out", str(empty)]) == 2
    assert "(no resume.safetensors), and a new run needs --arch and --tokenizer" in capsys.readouterr().err
    for folder in (out, empty):
        assert train(folder, f"text:{corpus}", ranks, "lrnn", "--resume") == 0
        note = f"nothing to resume in {folder} (no resume.safetensors): starting the run from step 0\n"
        assert note in capsys.readouterr().err
        assert load_checkpoint(folder).config.metadata["steps"] == 6
        events = [json.loads(line)["event"] for line in (folder / "train.jsonl").read_text().splitlines()]
        assert events.count("start") == 1 and "resume" not in events and events[-1] == "end"


def test_export_writes_a_runs_weights_as_of_its_last_resume_save(tmp_path, corpus, ranks, monkeypatch, capsys) -> None:
    """``export``: a run killed at its second evaluation (step 6) holds step 3's checkpoint and step 6's resume save;
    the exported folder has step 6's weights, the run's config and tokenizer, and serves. Bad input exits 2 with what
    is wrong, and the run still resumes."""
    out, exported = tmp_path / "killed", tmp_path / "six"
    saved, save = [], loop_module.save_run_checkpoint

    def killed_at_the_second(*args, **kwargs) -> None:
        saved.append(1)
        if len(saved) == 2:
            raise SystemExit("killed")
        save(*args, **kwargs)

    monkeypatch.setattr(loop_module, "save_run_checkpoint", killed_at_the_second)
    with pytest.raises(SystemExit, match="killed"):
        train(out, f"text:{corpus}", ranks, "lrnn")
    monkeypatch.undo()
    assert main(["export", str(out), "--out", str(exported)]) == 0
    assert f"wrote {exported}: the current weights of {out} at step 6" in capsys.readouterr().out
    at_three, at_six = load_checkpoint(out), load_checkpoint(exported)
    assert at_three.config.metadata["steps"] == 3 and at_six.config.metadata["steps"] == 6
    assert at_six.config.metadata["exported"] == {"from": str(out), "best": False}
    _, tensors = read_resume_state(out)
    six = at_six.model.state_dict()
    assert all(torch.equal(tensor, tensors[f"model.{name}"]) for name, tensor in six.items())
    assert not all(torch.equal(tensor, six[name]) for name, tensor in at_three.model.state_dict().items())
    assert (exported / "tokenizer.tiktoken").read_bytes() == ranks.read_bytes()
    assert load_served_model(exported, "cpu").config.kind == "generate"
    for argv, message in [
        (["export", str(out), "--out", str(tmp_path / "best"), "--best"], "holds no best weights"),
        (["export", str(out), "--out", str(out)], "is the run's own folder"),
        (["export", str(tmp_path / "none"), "--out", str(tmp_path / "x")], "missing; there is no run to resume"),
    ]:
        assert main(argv) == 2
        assert message in capsys.readouterr().err
    ranks_copy = (out / "tokenizer.tiktoken").read_bytes()
    (out / "tokenizer.tiktoken").unlink()
    assert main(["export", str(out), "--out", str(tmp_path / "w")]) == 2
    assert "tokenizer.tiktoken is missing" in capsys.readouterr().err and not (tmp_path / "w").exists()
    (out / "tokenizer.tiktoken").write_bytes(ranks_copy)
    config = (out / "config.json").read_text()
    other = json.loads(config)
    other["model"]["d_model"] = 24
    (out / "config.json").write_text(json.dumps(other))
    assert main(["export", str(out), "--out", str(tmp_path / "z")]) == 2
    assert "resume.safetensors: its weights do not fit" in capsys.readouterr().err
    (out / "config.json").unlink()
    assert main(["export", str(out), "--out", str(tmp_path / "y")]) == 2
    assert "has no config.json yet (a run writes it at its first evaluation)" in capsys.readouterr().err
    (out / "config.json").write_text(config)
    assert main(["text-train", "--resume", "--out", str(out), "--no-progress"]) == 0
    assert load_checkpoint(out).config.metadata["steps"] == 6


def test_the_progress_bar_counts_to_the_time_budget_when_it_ends_first_and_shows_tokens_per_s(
    tmp_path, corpus, ranks, capsys
) -> None:
    out = tmp_path / "timed"
    assert (
        train(
            out,
            f"text:{corpus}",
            ranks,
            "lrnn",
            "--steps",
            "100000",
            "--time-budget",
            "1",
            "--eval-every",
            "0",
            "--log-every",
            "1",
            "--progress",
        )
        == 0
    )
    steps = load_checkpoint(out).config.metadata["steps"]
    bar = capsys.readouterr().err
    assert "/100000" not in bar
    last = bar.strip().split("\r")[-1]
    assert f" {steps}/{steps} [" in last and "tokens/s=" in last, last


def test_text_eval_report_schema_and_plots(tmp_path, corpus, ranks, capsys) -> None:
    out = tmp_path / "model"
    assert train(out, f"text:{corpus}", ranks, "regulargpt") == 0
    folder = tmp_path / "eval"
    assert (
        main(
            [
                "text-eval",
                "--checkpoint",
                str(out),
                "--checkpoint",
                str(out),
                "--multiples",
                "1,2,4",
                "--targets",
                "10",
                "--receptive-field",
                "3",
                "--receptive-multiple",
                "2",
                "--out",
                str(folder),
                "--plots",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    assert "| longest: NLL - the first's (paired) | - | +0.000 ± 0.000 |" in capsys.readouterr().out
    assert sorted(path.name for path in folder.iterdir()) == ["eval.json", "perplexity.png", "receptive_field.png"]
    report_path, plot, field_plot = folder / "eval.json", folder / "perplexity.png", folder / "receptive_field.png"
    reports = json.loads(report_path.read_text())
    assert len(reports) == 2 and reports[0]["perplexity"] == reports[1]["perplexity"]
    report = reports[0]
    assert set(report) == {
        "checkpoint",
        "architecture",
        "train_length",
        "corpus",
        "targets",
        "target_digest",
        "perplexity",
        "ratio_16x",
        "log_ratio_stderr",
        "receptive_field",
        "context_gain",
        "wall_time_s",
    }
    assert report["architecture"] == "regulargpt C=4 K=2" and report["train_length"] == 16
    assert [row["length"] for row in report["perplexity"]] == [16, 32, 64]
    for row in report["perplexity"]:
        assert set(row) == {"length", "multiple", "perplexity", "nll", "nll_stderr", "nll_per_target"}
        assert len(row["nll_per_target"]) == 10
        assert math.isclose(np.mean(row["nll_per_target"]), row["nll"], rel_tol=1e-6)
        assert math.isclose(row["perplexity"], math.exp(row["nll"])) and 1 < row["perplexity"] < 302
    assert math.isclose(
        report["ratio_16x"], report["perplexity"][-1]["perplexity"] / report["perplexity"][0]["perplexity"]
    )
    gain = report["context_gain"]  # the two parts together are every target, their NLLs the rows' means
    assert gain["near"] == 16 and gain["far"] == 64
    parts = [gain["seen_only_far"], gain["other"]]
    assert sum(part["targets"] for part in parts) == 10
    for key, row in (("nll_near", report["perplexity"][0]), ("nll_far", report["perplexity"][-1])):
        total = sum(part[key] * part["targets"] for part in parts if part["targets"])
        assert math.isclose(total / 10, row["nll"], rel_tol=1e-5)
    field = report["receptive_field"]
    assert field["length"] == 32 and field["windows"] == 3 and len(field["cumulative"]) == 32
    assert math.isclose(field["cumulative"][0], 1.0, rel_tol=1e-5)
    assert all(a >= b - 1e-6 for a, b in zip(field["cumulative"], field["cumulative"][1:]))  # non-increasing
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and field_plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    fast_path = tmp_path / "fast"  # another attention implementation: the same figures
    assert (
        main(
            [
                "text-eval",
                "--checkpoint",
                str(out),
                "--multiples",
                "1,2,4",
                "--targets",
                "10",
                "--attention-impl",
                "fast",
                "--out",
                str(fast_path),
                "--no-progress",
            ]
        )
        == 0
    )
    fast = json.loads((fast_path / "eval.json").read_text())[0]
    for row, fast_row in zip(report["perplexity"], fast["perplexity"]):
        assert math.isclose(row["nll"], fast_row["nll"], rel_tol=1e-4)


def test_spec_spelling_train_corpus_and_eval_of_a_text_checkpoint(tmp_path, corpus, ranks, capsys, monkeypatch) -> None:
    """docs/api.md, Command line: ``train --corpus PATH`` trains a text model; ``eval`` of one prints perplexity by
    length and writes its report into runs/text-eval/<checkpoint name>, not the working directory."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "spec"
    assert (
        main(
            [
                "train",
                "--arch",
                "lstm",
                "--corpus",
                f"text:{corpus}",
                "--tokenizer",
                str(ranks),
                "--out",
                str(out),
                "--length",
                "8",
                "--steps",
                "2",
                "--eval-every",
                "0",
                "--no-progress",
                "--d-model",
                "8",
            ]
        )
        == 0
    )
    assert load_checkpoint(out).config.kind == "generate"
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(out), "--multiples", "1,2", "--targets", "4", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "| 8 (1x) |" in captured.out and "| 16 (2x) |" in captured.out  # one row of last-token perplexity per length
    assert sorted(path.name for path in tmp_path.iterdir()) == ["runs", "spec"]
    assert json.loads((tmp_path / "runs" / "text-eval" / "spec" / "eval.json").read_text())[0]["train_length"] == 8
    assert f"wrote {Path('runs', 'text-eval', 'spec', 'eval.json')}" in captured.err
    assert main(["eval", "--checkpoint", str(out), "--protocol", "hard"]) == 2  # a transducer flag: refused
    assert "--protocol" in capsys.readouterr().err


def test_token_windows(ranks) -> None:
    tokenizer = load_tokenizer(f"file:{ranks.name}", ranks.parent)
    tokens = tokenize_documents(["the dog", "the fox"], tokenizer)
    assert tokenizer.eot_token in tokens.tolist() and tokenizer.decode(tokens.tolist()) == "the dog<|endoftext|>the fox"
    batch = TokenArray(np.arange(100)).batch(np.random.default_rng(0), 5, 9)  # (5, 10) consecutive runs
    assert batch.shape == (5, 10) and (batch[:, 1:] - batch[:, :-1] == 1).all()
    documents = [Document(f"document {n} " + "the lazy dog " * 5, source=str(n)) for n in range(3)]
    windows = StreamedWindows(lambda: iter(documents), tokenizer, buffer_windows=4)
    rows = [windows.batch(np.random.default_rng(1), 3, 7) for _ in range(10)]  # several passes
    assert all(row.shape == (3, 8) for row in rows)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["text-train", "--arch", "exact", "--tokenizer", "bytes", "--out", "X", "--steps", "1"], "built by hand"),
        (
            ["text-train", "--arch", "lrnn", "--tokenizer", "bytes", "--out", "X", "--steps", "1", "--heads", "2"],
            "does not apply",
        ),
        (["text-train", "--arch", "lrnn", "--tokenizer", "nope", "--out", "X", "--steps", "1"], "unknown tokenizer"),
        (
            ["text-train", "--arch", "lrnn", "--tokenizer", "bytes", "--corpus", "web", "--out", "X", "--steps", "1"],
            "unknown corpus",
        ),
        (["text-eval", "--checkpoint", "missing-folder"], "missing"),
        (
            [
                "text-train",
                "--arch",
                "regulargpt",
                "--tokenizer",
                "bytes",
                "--out",
                "X",
                "--steps",
                "1",
                "--state-passing",
            ],
            "--state-passing needs a recurrent model",
        ),
        (
            [
                "text-train",
                "--arch",
                "lrnn",
                "--tokenizer",
                "bytes",
                "--out",
                "X",
                "--steps",
                "1",
                "--length",
                "64",
                "--passkey-fraction",
                "0.5",
            ],
            "pass-key examples need windows of at least",
        ),
        (
            [
                "text-train",
                "--arch",
                "lrnn",
                "--tokenizer",
                "bytes",
                "--out",
                "X",
                "--steps",
                "1",
                "--passkey-fraction",
                "1.5",
            ],
            "--passkey-fraction",
        ),
        (
            [
                "text-train",
                "--arch",
                "lrnn",
                "--tokenizer",
                "bytes",
                "--out",
                "X",
                "--steps",
                "1",
                "--passkey-fraction-final",
                "0.5",
            ],
            "--passkey-fraction-final needs --passkey-fraction",
        ),
        (
            [
                "text-train",
                "--arch",
                "lrnn",
                "--tokenizer",
                "bytes",
                "--out",
                "X",
                "--steps",
                "1",
                "--passkey-fraction",
                "1",
                "--passkey-distractors",
                "-1",
            ],
            "--passkey-distractors",
        ),
        (
            [
                "text-train",
                "--arch",
                "lrnn",
                "--tokenizer",
                "bytes",
                "--out",
                "X",
                "--steps",
                "1",
                "--length",
                "320",
                "--passkey-fraction",
                "0.5",
                "--passkey-span",
                "8",
            ],
            "--passkey-span needs --state-passing",
        ),
        (
            [
                "text-train",
                "--arch",
                "lrnn",
                "--tokenizer",
                "bytes",
                "--out",
                "X",
                "--steps",
                "1",
                "--state-passing",
                "--passkey-span",
                "0",
            ],
            "--passkey-span",
        ),
        (
            [
                "text-train",
                "--arch",
                "lrnn",
                "--tokenizer",
                "bytes",
                "--out",
                "X",
                "--steps",
                "1",
                "--state-reset",
                "0.5",
            ],
            "--state-reset needs --state-passing",
        ),
        (
            [
                "text-train",
                "--arch",
                "lrnn",
                "--tokenizer",
                "bytes",
                "--out",
                "X",
                "--steps",
                "1",
                "--state-passing",
                "--state-reset",
                "2",
            ],
            "--state-reset",
        ),
        (
            [
                "text-train",
                "--arch",
                "lrnn",
                "--tokenizer",
                "bytes",
                "--out",
                "X",
                "--steps",
                "1",
                "--length",
                "320",
                "--passkey-fraction",
                "0.5",
                "--state-passing",
                "--passkey-span",
                "4",
                "--state-reset",
                "0.5",
            ],
            "--state-reset with --passkey-span",
        ),
        (
            ["text-train", "--arch", "lrnn", "--tokenizer", "bytes", "--out", "X", "--steps", "1"]
            + ["--length", "320", "--recall-fraction", "0.5", "--recall-span", "4"],
            "--recall-span needs --state-passing",
        ),
        (
            ["text-train", "--arch", "lrnn", "--tokenizer", "bytes", "--out", "X", "--steps", "1", "--length", "320"]
            + ["--recall-fraction", "0.5", "--state-passing", "--recall-span", "4", "--state-reset", "0.5"],
            "--state-reset with --recall-span",
        ),
        (
            [
                "text-train",
                "--arch",
                "lrnn",
                "--tokenizer",
                "bytes",
                "--out",
                "X",
                "--steps",
                "1",
                "--length",
                "320",
                "--passkey-fraction",
                "0.5",
                "--passkey-fresh",
            ],
            "--passkey-fresh needs --state-passing",
        ),
        (
            [
                "text-train",
                "--arch",
                "lrnn",
                "--tokenizer",
                "bytes",
                "--out",
                "X",
                "--steps",
                "1",
                "--state-passing",
                "--passkey-fresh",
            ],
            "--passkey-fresh needs --state-passing and --passkey-fraction",
        ),
    ],
)
def test_bad_input_exits_2(argv, message, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_init_from_starts_a_new_run_from_a_checkpoints_weights(tmp_path, corpus, ranks, capsys) -> None:
    """--init-from: the new run's first weights are the checkpoint's (a learning rate of ~0 leaves them there), not
    the seed's; another model's checkpoint is refused, naming what differs."""
    first = tmp_path / "first"
    assert train(first, f"text:{corpus}", ranks, "lrnn") == 0
    weights = load_checkpoint(first).model.state_dict()
    for name, init in (("from-first", ["--init-from", str(first)]), ("from-seed", [])):
        assert (
            train(
                tmp_path / name, f"text:{corpus}", ranks, "lrnn", "--steps", "1", "--lr", "1e-30", "--seed", "7", *init
            )
            == 0
        )
    started = load_checkpoint(tmp_path / "from-first").model.state_dict()
    seeded = load_checkpoint(tmp_path / "from-seed").model.state_dict()
    assert all(torch.allclose(started[name], weights[name]) for name in weights)
    assert not all(torch.allclose(seeded[name], weights[name]) for name in weights)
    capsys.readouterr()
    assert train(tmp_path / "wider", f"text:{corpus}", ranks, "lrnn", "--init-from", str(first), "--d-model", "24") == 2
    assert "holds another model: d_model 16 there, 24 here" in capsys.readouterr().err
    assert train(tmp_path / "other", f"text:{corpus}", ranks, "transformer", "--init-from", str(first)) == 2
    assert "is a lrnn checkpoint, not transformer" in capsys.readouterr().err


def test_init_from_an_lrnn_with_fewer_blocks_grows_it(tmp_path, corpus, ranks, capsys) -> None:
    """--init-from an LRNN checkpoint with fewer blocks than --num-blocks: the run starts from the checkpoint's model
    grown (the same logits), with the run's blocks; fewer blocks than the checkpoint's are refused."""
    first = tmp_path / "first"
    assert train(first, f"text:{corpus}", ranks, "lrnn") == 0  # 4 blocks
    assert (
        train(
            tmp_path / "grown",
            f"text:{corpus}",
            ranks,
            "lrnn",
            "--num-blocks",
            "6",
            "--steps",
            "1",
            "--lr",
            "1e-30",
            "--init-from",
            str(first),
        )
        == 0
    )
    small, grown = load_checkpoint(first).model, load_checkpoint(tmp_path / "grown").model
    assert grown.config.num_blocks == 6
    tokens = torch.randint(0, 301, (2, 40))
    with torch.no_grad():
        assert torch.allclose(grown(tokens), small(tokens), atol=1e-5)
    capsys.readouterr()
    assert (
        train(
            tmp_path / "fewer",
            f"text:{corpus}",
            ranks,
            "lrnn",
            "--num-blocks",
            "2",
            "--init-from",
            str(tmp_path / "grown"),
        )
        == 2
    )
    assert "holds another model: num_blocks 6 there, 2 here" in capsys.readouterr().err


def test_init_from_a_delta_lrnn_with_fewer_heads_exits_2(tmp_path, corpus, ranks, capsys) -> None:
    """A delta-rule LRNN does not grow: more heads than its checkpoint's is a usage error, not a traceback."""
    delta = ["--transition-norm", "delta"]
    assert train(tmp_path / "first", f"text:{corpus}", ranks, "lrnn", *delta) == 0
    capsys.readouterr()
    more = ["--num-blocks", "6", "--init-from", str(tmp_path / "first")]
    assert train(tmp_path / "grown", f"text:{corpus}", ranks, "lrnn", *delta, *more) == 2
    err = capsys.readouterr().err
    assert "a delta-rule LRNN does not grow" in err and err.count("\n") == 1


def test_a_run_saved_with_passkey_steps_resumes(tmp_path, corpus, ranks) -> None:
    """Resume files written from 72ac6b1 to a9c80e3 hold ``passkey_steps`` (the pass-key schedule's length, now the
    run's --steps) and, like every one before abf47e5, no ``passkey_span`` (nor, before b65b28a,
    ``mqar_value_tokens``): such a run resumes, on the schedule it started with, its examples within one window."""
    out = tmp_path / "older"
    flags = ["--length", "320", "--batch-size", "2", "--passkey-fraction", "1.0", "--passkey-fraction-final", "0.5"]
    assert train(out, f"text:{corpus}", ranks, "lrnn", *flags, "--time-budget", "0.001") == 0

    def older(state: dict) -> None:
        state["objective"]["passkey_steps"] = 6
        del state["objective"]["passkey_span"]
        del state["objective"]["mqar_value_tokens"]

    edit_resume_state(out, older)
    assert train(out, f"text:{corpus}", ranks, "lrnn", *flags, "--resume") == 0
    assert load_checkpoint(out).config.metadata["steps"] == 6


def train_records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]


def test_a_teacher_teaches_the_text_rows_and_a_run_with_one_resumes_bitwise(tmp_path, corpus, ranks) -> None:
    """--teacher: a model that is its own teacher (--init-from it, weight 1) takes no gradient from its text rows
    (softmax less the teacher's distribution: 0), where at weight 0.5 it does; and a state-passing run with a
    teacher, cut after one step and resumed, ends with the weights of the run never cut (the teacher's carried
    states are saved with the run's own)."""
    teacher = tmp_path / "teacher"
    assert train(teacher, f"text:{corpus}", ranks, "lrnn") == 0
    norms = {}
    for weight in ("1", "0.5"):
        out = tmp_path / f"self-{weight}"
        assert (
            train(
                out,
                f"text:{corpus}",
                ranks,
                "lrnn",
                "--init-from",
                str(teacher),
                "--teacher",
                str(teacher),
                "--teacher-weight",
                weight,
                "--steps",
                "1",
                "--log-every",
                "1",
                "--state-passing",
            )
            == 0
        )
        norms[weight] = next(r["grad_norm"] for r in train_records(out) if r["event"] == "train")
    assert norms["1"] < 1e-4 and norms["0.5"] > 1e-2
    taught = ["--teacher", str(teacher), "--state-passing", "--save-every", "1"]
    assert train(tmp_path / "whole", f"text:{corpus}", ranks, "lrnn", *taught) == 0
    assert train(tmp_path / "cut", f"text:{corpus}", ranks, "lrnn", *taught, "--time-budget", "0.001") == 0
    assert load_checkpoint(tmp_path / "cut").config.metadata["steps"] == 1
    assert main(["text-train", "--resume", "--out", str(tmp_path / "cut"), "--no-progress"]) == 0
    whole, cut = (load_checkpoint(tmp_path / name).model.state_dict() for name in ("whole", "cut"))
    assert all(torch.equal(whole[name], cut[name]) for name in whole)
    untaught = tmp_path / "untaught"
    assert train(untaught, f"text:{corpus}", ranks, "lrnn", "--state-passing") == 0
    plain = load_checkpoint(untaught).model.state_dict()
    assert not all(torch.equal(whole[name], plain[name]) for name in whole)  # the teacher reached the model


def test_a_teacher_that_cannot_teach_the_run_exits_2(tmp_path, corpus, ranks, capsys) -> None:
    """Refused with what is wrong: --teacher-weight without --teacher or at 0, a folder that holds no checkpoint, a
    teacher of another tokenizer, a transducer, and with --state-passing a teacher whose cache grows."""
    attention = tmp_path / "attention"
    assert train(attention, f"text:{corpus}", ranks, "transformer", "--steps", "1", "--eval-every", "0") == 0
    transducer = tmp_path / "transducer"
    assert (
        main(
            [
                "train",
                "--task",
                "parity_check",
                "--arch",
                "lrnn",
                "--out",
                str(transducer),
                "--steps",
                "1",
                "--eval-every",
                "0",
                "--no-progress",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    other = tmp_path / "bytes-teacher"
    assert (
        main(
            [
                "text-train",
                "--arch",
                "lrnn",
                "--corpus",
                f"text:{corpus}",
                "--tokenizer",
                "bytes",
                "--out",
                str(other),
                "--length",
                "16",
                "--batch-size",
                "2",
                "--steps",
                "1",
                "--eval-every",
                "0",
                "--no-progress",
                "--threads",
                "1",
                *TINY,
                *ARCHITECTURES["lrnn"],
            ]
        )
        == 0
    )
    capsys.readouterr()
    for extra, message in [
        (["--teacher-weight", "0.5"], "--teacher-weight needs --teacher"),
        (["--teacher", str(other), "--teacher-weight", "0"], "--teacher-weight 0 would learn nothing"),
        (["--teacher", str(tmp_path / "nowhere")], f"--teacher {tmp_path / 'nowhere'}: "),
        (
            ["--teacher", str(other)],
            "uses another tokenizer (bytes, 256 tokens) than this run (file:tiny.tiktoken, 301)",
        ),
        (["--teacher", str(transducer)], "is a transduce checkpoint, not a language model"),
        (["--teacher", str(attention), "--state-passing"], "cache grows with the context"),
    ]:
        assert train(tmp_path / "student", f"text:{corpus}", ranks, "lrnn", *extra) == 2, extra
        assert message in capsys.readouterr().err, extra


def test_seen_only_far_asks_for_the_token_in_the_far_part_and_not_in_the_near_one() -> None:
    from training.evaluation.text_eval import seen_only_far

    tokens = np.array([7, 1, 2, 3, 7, 4, 5, 6, 7, 8])
    #                  0  1  2  3  4  5  6  7  8  9   targets at 8 (token 7) and 9 (token 8)
    documents = [tokens]
    assert seen_only_far(documents, [(0, 8)], near=3, far=8).tolist() == [True]  # 7 at 0 and 4, not in 5..7
    assert seen_only_far(documents, [(0, 8)], near=4, far=8).tolist() == [False]  # 7 at 4 is near
    assert seen_only_far(documents, [(0, 8)], near=3, far=4).tolist() == [True]  # far part 4..4
    assert seen_only_far(documents, [(0, 8)], near=3, far=3).tolist() == [False]  # no far part
    assert seen_only_far(documents, [(0, 9)], near=2, far=9).tolist() == [False]  # 8 never before


def test_the_paired_row_compares_only_reports_on_the_same_targets() -> None:
    from training.evaluation.text_eval import format_text_table

    def report(name: str, digest: str, nlls: list[float]) -> dict:
        rows = [
            {
                "length": 8,
                "multiple": 1,
                "perplexity": math.exp(np.mean(nlls)),
                "nll": float(np.mean(nlls)),
                "nll_stderr": 0.0,
                "nll_per_target": nlls,
            }
        ]
        return {
            "checkpoint": name,
            "architecture": "lrnn",
            "perplexity": rows,
            "ratio_16x": None,
            "log_ratio_stderr": None,
            "context_gain": None,
            "target_digest": digest,
        }

    table = format_text_table(
        [report("a", "x", [1.0, 2.0, 3.0]), report("b", "x", [1.5, 2.0, 3.5]), report("c", "y", [0.0, 0.0, 0.0])]
    )
    paired = table.splitlines()[-1]
    assert paired == "| longest: NLL - the first's (paired) | - | +0.333 ± 0.167 | other targets |", paired
