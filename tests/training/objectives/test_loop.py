"""The one training loop: resumed runs end bitwise-equal to runs never stopped (cut by a hook, by SIGTERM, by the
time budget), gradient accumulation, weight decay on matrices only, the schedule, and the resume flags."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import load_checkpoint, save_checkpoint
from model.config import CheckpointConfig, LRNNConfig, RegularGPTConfig
from model.registry import build_model
from model.regulargpt.model import RegularGPT
from model.serving import Cost
from training.cli.main import main
from training.data.batches import IGNORE_INDEX, Batch
from training.data.passkey import QUESTION, PassKeyBuilder, first_number
from training.data.text_batches import TokenArray
from training.objectives import checkpointing, loop, losses, optim
from training.objectives.carried import new_carried_state
from training.objectives.checkpointing import LOG_FILE, RESUME_FILE
from training.objectives.distributed import setup_distributed
from training.objectives.language_model import LanguageModelObjective, TextData, check_passkey_length
from training.objectives.loop import train
from training.objectives.optim import decayed_parameter_names, lr_factor
from training.objectives.run import RunState, TrainSettings
from training.objectives.transduction import TaskData, TransductionObjective

REPO = Path(__file__).resolve().parents[3]
TIMING = {"elapsed_s", "tokens_per_s", "wall_time_s", "command", "threads"}  # fields that differ between runs
TINY_LRNN = ["--arch", "lrnn", "--d-model", "8", "--block-size", "2", "--num-blocks", "2", "--d-ff", "16"]


def task_run(
    out: Path,
    steps: int,
    stop_at: int | None = None,
    resume: bool = False,
    transition_norm: str = "column",
    regulargpt: bool = False,
    layers: int = 1,
    stop_requested: Callable[[], bool] | None = None,
    **overrides,
) -> dict:
    """A parity_check run of a tiny LRNN (or ``regulargpt``) with dropout (so the torch random stream matters too)
    through the API; ``stop_at`` cuts it after that many steps of this invocation, as a signal would
    (``stop_requested``: the loop's hook itself instead)."""
    architecture = "regulargpt" if regulargpt else "lrnn"
    settings = TrainSettings(
        **{
            "architecture": architecture,
            "steps": steps,
            "batch_size": 6,
            "lr": 3e-3,
            "optimizer": "adamw",
            "weight_decay": 0.1,
            "schedule": "cosine",
            "warmup_steps": 3,
            "eval_every": 4,
            "save_every": 5,
            "log_every": 3,
            **overrides,
        }
    )
    config = (
        RegularGPTConfig(vocab_size=2, num_labels=2, d_model=8, n_heads=2, d_ff=16, chunk_size=2, dropout=0.1)
        if regulargpt
        else LRNNConfig(
            vocab_size=2,
            num_labels=2,
            d_model=8,
            block_size=2,
            num_blocks=2,
            d_ff=16,
            dropout=0.1,
            transition_norm=transition_norm,
            n_layers=layers,
        )
    )
    data = TaskData(
        task="parity_check",
        train_lengths=(1, 12),
        eval_lengths=(20, 30),
        curriculum="growing",
        curriculum_start=4,
        eval_samples=8,
        eval_batch_size=4,
    )
    dist = setup_distributed("cpu")
    objective = TransductionObjective(data, settings.steps, settings.batch_size, settings.seed, dist)
    return train(
        settings,
        objective,
        config,
        out,
        "test",
        dist,
        resume="test resume" if resume else None,
        stop_requested=stop_requested or stop_after(stop_at),
    )


def stop_after(steps: int | None):
    """A stop hook that asks to stop after ``steps`` steps of this invocation (None: never)."""
    calls = [0]

    def hook() -> bool:
        calls[0] += 1
        return steps is not None and calls[0] >= steps

    return hook


def step_in_log(out: Path) -> int:
    """The last train record's step (0 before the first)."""
    records = log_records(out)
    steps = [record["step"] for record in records if record["event"] == "train"]
    return steps[-1] if steps else 0


def log_records(out: Path) -> list[dict]:
    path = out / LOG_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def without_timing(records: list[dict]) -> list[dict]:
    return [
        {key: value for key, value in record.items() if key not in TIMING}
        for record in records
        if record["event"] != "resume"
    ]


def final_tensors(out: Path) -> dict[str, torch.Tensor]:
    return {
        **load_file(str(out / "model.safetensors")),
        **{f"resume.{name}": tensor for name, tensor in load_file(str(out / RESUME_FILE)).items()},
    }


def assert_same_run(one: Path, other: Path) -> None:
    first, second = final_tensors(one), final_tensors(other)
    assert first.keys() == second.keys()
    for name in first:
        assert torch.equal(first[name], second[name]), name
    assert without_timing(log_records(one)) == without_timing(log_records(other))


def test_a_resumed_run_ends_bitwise_equal_to_one_never_stopped(tmp_path: Path) -> None:
    whole = task_run(tmp_path / "whole", steps=13)
    cut = task_run(tmp_path / "cut", steps=13, stop_at=6)  # between saves (5, 10), evaluations (4, 8), logs
    assert cut["stopped"] == "signal" and cut["steps"] == 6
    assert load_checkpoint(tmp_path / "cut", device="cpu").config.metadata["stopped"] == "signal"  # loadable
    resumed = task_run(tmp_path / "cut", steps=13, resume=True)
    assert resumed["stopped"] == whole["stopped"] == "steps"
    assert resumed["best_eval"] == whole["best_eval"] and resumed["tokens"] == whole["tokens"]
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    events = [record["event"] for record in log_records(tmp_path / "cut")]
    assert events.count("resume") == 1 and events.count("end") == 1  # the cut run's end record was cut back
    train_steps = [record["step"] for record in log_records(tmp_path / "cut") if record["event"] == "train"]
    assert train_steps == sorted(set(train_steps))  # no step logged twice


def test_a_run_cut_twice_resumes_to_the_same_end(tmp_path: Path) -> None:
    task_run(tmp_path / "whole", steps=14)
    task_run(tmp_path / "cut", steps=14, stop_at=2)
    task_run(tmp_path / "cut", steps=14, stop_at=7, resume=True)  # to step 9
    task_run(tmp_path / "cut", steps=14, resume=True)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")


@pytest.mark.parametrize("dies_at", [8, 12])  # between saves (5, 10), and the last step's evaluation
def test_an_evaluation_that_dies_loses_no_steps_and_the_resumed_run_evaluates_first(
    dies_at: int,
    tmp_path: Path,
    monkeypatch,
) -> None:
    task_run(tmp_path / "whole", steps=12)
    evaluate, calls = TransductionObjective.evaluate, [0]

    def dying(self, model, dist):
        calls[0] += 1
        if calls[0] == dies_at // 4:  # the evaluations are at steps 4, 8, 12
            raise MemoryError("killed by the OOM killer")
        return evaluate(self, model, dist)

    monkeypatch.setattr(TransductionObjective, "evaluate", dying)
    with pytest.raises(MemoryError):
        task_run(tmp_path / "cut", steps=12)
    monkeypatch.undo()
    state, _ = checkpointing.read_resume_state(tmp_path / "cut", with_tensors=False)
    assert state["run"]["step"] == dies_at and state["run"]["evaluation_pending"]
    task_run(tmp_path / "cut", steps=12, resume=True)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    evaluations = [record["step"] for record in log_records(tmp_path / "cut") if record["event"] == "eval"]
    assert evaluations == [4, 8, 12]


def test_a_step_that_evaluates_is_saved_once_before_its_evaluation_which_a_resume_repeats(
    tmp_path: Path,
    monkeypatch,
) -> None:
    task_run(tmp_path / "whole", steps=9, save_every=4)
    monkeypatch.setattr(loop, "_stop_signals", lambda: contextlib.nullcontext(crash_at_step(6)))
    with pytest.raises(RuntimeError):
        task_run(tmp_path / "cut", steps=9, save_every=4)  # evaluation and save both due at step 4
    monkeypatch.undo()
    state, _ = checkpointing.read_resume_state(tmp_path / "cut", with_tensors=False)
    assert state["run"]["step"] == 4 and state["run"]["evaluation_pending"]  # the save before it, no second one
    task_run(tmp_path / "cut", steps=9, save_every=4, resume=True)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    evaluations = [record["step"] for record in log_records(tmp_path / "cut") if record["event"] == "eval"]
    assert evaluations == [4, 8, 9]


def crash_at_step(step: int):
    """A signal check that raises (the process dies) where :func:`stop_after` would first ask to stop."""
    stop = stop_after(step)

    def signalled() -> bool:
        if stop():
            raise RuntimeError("killed")
        return False

    return signalled


def recorded_softness(monkeypatch) -> list[float]:
    """The softness the loop sets at each step, recorded as it goes on to set it."""
    phases: list[float] = []
    switch = loop.set_softness

    def recorded(model: torch.nn.Module, softness: float, track_impurity: bool = False) -> None:
        phases.append(softness)
        switch(model, softness, track_impurity)

    monkeypatch.setattr(loop, "set_softness", recorded)
    return phases


def recorded_penalty(monkeypatch, name: str) -> list[float]:
    """The values the loop's penalty ``name`` (``loop.impurity`` or ``loop.writes``) takes, recorded as it goes on."""
    taken: list[float] = []
    penalty = getattr(loop, name)

    def recorded(model: torch.nn.Module) -> torch.Tensor | float:
        value = penalty(model)
        taken.append(float(value.detach()))
        return value

    monkeypatch.setattr(loop, name, recorded)
    return taken


def test_a_stochastic_lrnn_trains_soft_then_sparse_and_resumes_across_the_switch(tmp_path: Path, monkeypatch) -> None:
    phases = recorded_softness(monkeypatch)
    task_run(tmp_path / "whole", steps=9, transition_norm="stochastic", soft_transition_steps=5)
    assert phases == [1.0] * 5 + [0.0] * 4
    task_run(tmp_path / "cut", steps=9, stop_at=3, transition_norm="stochastic", soft_transition_steps=5)
    task_run(tmp_path / "cut", steps=9, resume=True, transition_norm="stochastic", soft_transition_steps=5)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    model = load_checkpoint(tmp_path / "whole", device="cpu").model.train()
    assert not any(getattr(module, "softness", 0.0) for module in model.modules())  # served: sparsemax


def test_hardening_blends_the_columns_into_sparsemax_step_by_step_and_resumes(tmp_path: Path, monkeypatch) -> None:
    settings = TrainSettings(
        architecture="lrnn", steps=9, batch_size=6, lr=1e-3, soft_transition_steps=2, harden_steps=4
    )
    assert [losses.softness(settings, step) for step in range(1, 9)] == [1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0]
    phases = recorded_softness(monkeypatch)
    hardened = {"transition_norm": "stochastic", "soft_transition_steps": 2, "harden_steps": 4}
    task_run(tmp_path / "whole", steps=9, **hardened)
    assert phases == [1.0, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0]
    task_run(tmp_path / "cut", steps=9, stop_at=4, **hardened)
    task_run(tmp_path / "cut", steps=9, resume=True, **hardened)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    task_run(tmp_path / "abrupt", steps=9, transition_norm="stochastic", soft_transition_steps=2)
    digest = log_records(tmp_path / "whole")[-1]["param_sha256"]
    assert log_records(tmp_path / "abrupt")[-1]["param_sha256"] != digest  # the blend reached the gradient


def test_the_determinism_weight_rises_over_the_soft_phase_changes_the_run_and_resumes(
    tmp_path: Path, monkeypatch
) -> None:
    settings = TrainSettings(
        architecture="lrnn", steps=9, batch_size=6, lr=1e-3, soft_transition_steps=4, determinism_weight=2.0
    )
    assert [losses.determinism_weight(settings, step) for step in range(1, 7)] == [0.5, 1.0, 1.5, 2.0, 0.0, 0.0]
    taken = recorded_penalty(monkeypatch, "impurity")
    stochastic = {"transition_norm": "stochastic", "soft_transition_steps": 5}
    task_run(tmp_path / "whole", steps=9, determinism_weight=2.0, **stochastic)
    assert len(taken) == 5 and all(value > 0 for value in taken)  # each soft step, none after
    task_run(tmp_path / "cut", steps=9, stop_at=3, determinism_weight=2.0, **stochastic)
    task_run(tmp_path / "cut", steps=9, resume=True, determinism_weight=2.0, **stochastic)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    task_run(tmp_path / "plain", steps=9, **stochastic)
    digest = log_records(tmp_path / "whole")[-1]["param_sha256"]
    assert log_records(tmp_path / "plain")[-1]["param_sha256"] != digest  # the term reached the gradient


def test_the_write_weight_penalises_a_delta_lrnns_write_gates_every_step_and_resumes(
    tmp_path: Path, monkeypatch
) -> None:
    """Every step takes the layers' kept mean gate (one per layer, in (0, 1] at the start); the term reaches the
    gradient and closes gates; a run cut and resumed equals the whole."""
    taken = recorded_penalty(monkeypatch, "writes")
    task_run(tmp_path / "whole", steps=9, transition_norm="delta", write_weight=50.0)
    assert len(taken) == 9 and 0 < taken[0] <= 1  # the one layer's mean gate
    assert taken[-1] < taken[0]  # the penalty closes gates
    task_run(tmp_path / "cut", steps=9, stop_at=3, transition_norm="delta", write_weight=50.0)
    task_run(tmp_path / "cut", steps=9, resume=True, transition_norm="delta", write_weight=50.0)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    task_run(tmp_path / "plain", steps=9, transition_norm="delta")
    digest = log_records(tmp_path / "whole")[-1]["param_sha256"]
    assert log_records(tmp_path / "plain")[-1]["param_sha256"] != digest  # the term reached the gradient


def test_write_layers_count_only_the_named_layers_gates(tmp_path: Path, monkeypatch) -> None:
    """With ``write_layers`` the penalty takes only those layers' means (one layer: in [0, 1]); the others keep none,
    and the run differs from one that counts every layer."""
    taken = recorded_penalty(monkeypatch, "writes")
    delta = {"transition_norm": "delta", "layers": 2, "write_weight": 50.0}
    task_run(tmp_path / "second", steps=3, write_layers=(1,), **delta)
    assert len(taken) == 3 and 0 < taken[0] <= 1
    config = LRNNConfig(vocab_size=2, num_labels=2, d_model=8, block_size=2, num_blocks=2, d_ff=16, n_layers=2)
    model = build_model("lrnn", dataclasses.replace(config, transition_norm="delta")).train()
    losses.track_writes(model, (1,))
    model(torch.zeros(1, 4, dtype=torch.long))
    first, second = (block.recurrence for block in model.blocks)
    assert first.writes is None and second.writes is not None
    task_run(tmp_path / "all", steps=3, **delta)
    digest = log_records(tmp_path / "all")[-1]["param_sha256"]
    assert log_records(tmp_path / "second")[-1]["param_sha256"] != digest


def test_the_write_weight_belongs_to_the_delta_lrnn(tmp_path: Path, capsys) -> None:
    assert main(cli_run(tmp_path / "stochastic", 6, "--transition-norm", "stochastic", "--write-weight", "1")) == 2
    assert capsys.readouterr().err == "error: --write-weight applies to --arch lrnn --transition-norm delta only\n"
    assert main(cli_run(tmp_path / "delta", 3, "--transition-norm", "delta", "--write-weight", "0.5")) == 0
    assert load_checkpoint(tmp_path / "delta").config.metadata["settings"]["write_weight"] == 0.5
    delta = ("--transition-norm", "delta", "--layers", "2")
    assert main(cli_run(tmp_path / "layers", 3, *delta, "--write-layers", "1")) == 2
    assert capsys.readouterr().err == "error: --write-layers needs --write-weight\n"
    assert main(cli_run(tmp_path / "layers", 3, *delta, "--write-weight", "1", "--write-layers", "2")) == 2
    assert capsys.readouterr().err == "error: --write-layers: the model's layers are 0-1, not 2\n"
    assert main(cli_run(tmp_path / "layers", 3, *delta, "--write-weight", "1", "--write-layers", "1", "1")) == 0
    assert load_checkpoint(tmp_path / "layers").config.metadata["settings"]["write_layers"] == [1]


def test_a_delta_lrnn_gets_the_short_convolution_unless_told_otherwise(tmp_path: Path, capsys) -> None:
    assert main(cli_run(tmp_path / "default", 2, "--transition-norm", "delta")) == 0
    assert load_checkpoint(tmp_path / "default").config.model.short_conv == 4
    assert main(cli_run(tmp_path / "none", 2, "--transition-norm", "delta", "--short-conv", "0")) == 0
    assert load_checkpoint(tmp_path / "none").config.model.short_conv == 0
    assert main(cli_run(tmp_path / "column", 2, "--short-conv", "4")) == 2
    assert capsys.readouterr().err.endswith("short_conv applies to transition_norm 'delta' only\n")


def test_regulargpt_extra_levels_are_drawn_per_step_reach_the_model_and_resume(tmp_path: Path, monkeypatch) -> None:
    settings = TrainSettings(architecture="regulargpt", steps=9, batch_size=6, lr=1e-3, extra_levels=3)
    draws = [optim.extra_levels(settings, step) for step in range(1, 101)]
    assert set(draws) == {0, 1, 2, 3} and draws == [optim.extra_levels(settings, step) for step in range(1, 101)]
    assert draws != [optim.extra_levels(dataclasses.replace(settings, seed=1), step) for step in range(1, 101)]
    seen: list[int] = []
    forward = RegularGPT.forward

    def recorded(model, tokens, cache=None):
        if model.training:
            seen.append(model.extra_levels)
        return forward(model, tokens, cache)

    monkeypatch.setattr(RegularGPT, "forward", recorded)
    task_run(tmp_path / "whole", steps=9, regulargpt=True, extra_levels=3)
    assert seen == draws[:9]
    task_run(tmp_path / "cut", steps=9, stop_at=3, regulargpt=True, extra_levels=3)
    task_run(tmp_path / "cut", steps=9, resume=True, regulargpt=True, extra_levels=3)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    task_run(tmp_path / "plain", steps=9, regulargpt=True)
    digest = log_records(tmp_path / "whole")[-1]["param_sha256"]
    assert log_records(tmp_path / "plain")[-1]["param_sha256"] != digest  # the extra layers reached the gradient


def test_frozen_embeddings_keep_their_start_values_across_a_resume_and_the_rest_trains(
    tmp_path: Path, monkeypatch
) -> None:
    started: list[dict[str, torch.Tensor]] = []
    build_optimizer = loop.build_optimizer

    def recorded(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.Optimizer:
        started.append({name: tensor.detach().clone() for name, tensor in model.state_dict().items()})
        return build_optimizer(model, settings)

    monkeypatch.setattr(loop, "build_optimizer", recorded)
    task_run(tmp_path / "whole", steps=9, freeze_embedding=True)
    task_run(tmp_path / "cut", steps=9, stop_at=4, freeze_embedding=True)
    task_run(tmp_path / "cut", steps=9, resume=True, freeze_embedding=True)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")  # the resumed part froze it too
    start, end = started[0], load_file(str(tmp_path / "whole" / "model.safetensors"))
    assert torch.equal(end["embedding.embed.weight"], start["embedding.embed.weight"])
    assert not torch.equal(end["embedding.label_head.weight"], start["embedding.label_head.weight"])
    task_run(tmp_path / "free", steps=9)
    free = load_file(str(tmp_path / "free" / "model.safetensors"))
    assert not torch.equal(free["embedding.embed.weight"], start["embedding.embed.weight"])


def test_freeze_embeddings_is_saved_with_the_run(tmp_path: Path) -> None:
    assert main(cli_run(tmp_path / "run", 3, "--freeze-embeddings")) == 0
    assert load_checkpoint(tmp_path / "run").config.metadata["settings"]["freeze_embedding"] is True
    assert main(cli_run(tmp_path / "plain", 3)) == 0
    assert load_checkpoint(tmp_path / "plain").config.metadata["settings"]["freeze_embedding"] is False


def test_a_run_saved_before_freeze_embeddings_resumes_unfrozen(tmp_path: Path) -> None:
    assert main(cli_run(tmp_path / "run", 3)) == 0
    path = tmp_path / "run" / RESUME_FILE
    state, tensors = checkpointing.read_resume_state(tmp_path / "run")
    del state["settings"]["freeze_embedding"]
    save_file(tensors, str(path), metadata={"state": json.dumps(state)})
    assert main(["train", "--resume", "--out", str(tmp_path / "run"), "--steps", "5", "--no-progress"]) == 0
    assert load_checkpoint(tmp_path / "run").config.metadata["settings"]["freeze_embedding"] is False


def test_extra_levels_belong_to_regulargpt(tmp_path: Path, capsys) -> None:
    assert main(cli_run(tmp_path / "run", 6, "--extra-levels", "2")) == 2
    err = capsys.readouterr().err
    assert err == "error: --extra-levels applies to --arch regulargpt only\n"


def test_soft_and_harden_steps_default_to_a_half_and_a_quarter_for_the_stochastic_lrnn_none_for_delta(
    tmp_path: Path, capsys
) -> None:
    stochastic = ("--transition-norm", "stochastic")
    assert main(cli_run(tmp_path / "run", 9, *stochastic)) == 0
    settings = load_checkpoint(tmp_path / "run").config.metadata["settings"]
    assert (settings["soft_transition_steps"], settings["harden_steps"]) == (4, 2)  # half, then half of the rest
    delta = ("--transition-norm", "delta")
    assert main(cli_run(tmp_path / "delta", 9, *delta)) == 0
    settings = load_checkpoint(tmp_path / "delta").config.metadata["settings"]
    assert (settings["soft_transition_steps"], settings["harden_steps"]) == (0, 0)  # hard gates from the start
    assert main(cli_run(tmp_path / "soft-delta", 9, *delta, "--soft-transition-steps", "4")) == 0
    settings = load_checkpoint(tmp_path / "soft-delta").config.metadata["settings"]
    assert (settings["soft_transition_steps"], settings["harden_steps"]) == (4, 2)
    assert main(cli_run(tmp_path / "hard", 6, *stochastic, "--soft-transition-steps", "0")) == 0
    assert load_checkpoint(tmp_path / "hard").config.metadata["settings"]["harden_steps"] == 0  # hard from the start
    assert main(cli_run(tmp_path / "other", 6, "--soft-transition-steps", "2")) == 2
    err = capsys.readouterr().err
    assert "--soft-transition-steps applies to --arch lrnn --transition-norm stochastic or delta only" in err
    assert err.count("\n") == 1
    assert main(cli_run(tmp_path / "third", 6, "--determinism-weight", "1")) == 2
    assert (
        main(cli_run(tmp_path / "fourth", 6, *stochastic, "--soft-transition-steps", "0", "--determinism-weight", "1"))
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("--determinism-weight applies to the soft steps of --arch lrnn --transition-norm stochastic") == 2
    assert main(cli_run(tmp_path / "fifth", 6, "--harden-steps", "2")) == 2
    assert (
        capsys.readouterr().err
        == "error: --harden-steps applies to --arch lrnn --transition-norm stochastic or delta only\n"
    )


def test_extending_a_finished_constant_rate_run_equals_running_it_longer(tmp_path: Path) -> None:
    """--steps on resume goes on past the planned end; with a constant rate nothing else depends on it."""
    _constant_run(tmp_path / "whole", 10)
    _constant_run(tmp_path / "parts", 6)
    _constant_run(tmp_path / "parts", 10, resume=True)
    first, second = final_tensors(tmp_path / "whole"), final_tensors(tmp_path / "parts")
    for name in first:
        assert torch.equal(first[name], second[name]), name


def _constant_run(out: Path, steps: int, resume: bool = False) -> dict:
    settings = TrainSettings(
        architecture="regulargpt", steps=steps, batch_size=4, lr=1e-3, eval_every=5, save_every=3, log_every=2
    )
    config = RegularGPTConfig(vocab_size=2, num_labels=2, d_model=8, n_heads=2, d_ff=8, dropout=0.1)
    data = TaskData(task="parity_check", train_lengths=(1, 10), eval_lengths=(12, 16), eval_samples=4)
    dist = setup_distributed("cpu")
    objective = TransductionObjective(data, settings.steps, settings.batch_size, settings.seed, dist)
    return train(settings, objective, config, out, "test", dist, resume="resume" if resume else None)


def text_objective(
    length: int = 12,
    batch_size: int = 4,
    state_passing: bool = False,
    passkey_fraction: float = 0.0,
    steps: int = 9,
    **passkey: Any,
) -> LanguageModelObjective:
    """A language model's objective on a made token array (in memory, no tokenizer file needed for the loop)."""
    from model.tokenizer import load_tokenizer

    objective = LanguageModelObjective.__new__(LanguageModelObjective)
    objective.data = TextData(
        corpus="made",
        tokenizer="bytes",
        length=length,
        validation_windows=4,
        passkey_fraction=passkey_fraction,
        state_passing=state_passing,
        **passkey,
    )
    objective.tokenizer, objective.ranks_file, objective.batch_size = load_tokenizer("bytes", "."), None, batch_size
    objective.steps = steps
    tokens = np.random.default_rng(5).integers(0, 257, size=2000)
    if passkey_fraction:  # text the byte tokenizer decodes (token 256 is its end of text)
        tokens = np.asarray(objective.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 50))
    objective.windows, objective.train_tokens = TokenArray(tokens), len(tokens)
    objective.validation = TokenArray(tokens).batch(np.random.default_rng(1), 4, length)
    objective.carries_state, objective.cursors, objective.spans = state_passing, None, None
    objective.passkey = PassKeyBuilder(objective.tokenizer, tokens) if passkey_fraction else None
    if passkey_fraction:
        objective.shortest_passkey_row = check_passkey_length(objective.tokenizer, length)
    objective.passkey_validation = {}
    objective.recall, objective.recall_validation = None, {}
    objective.mqar_ids, objective.mqar_validation = None, {}
    return objective


class Oracle(torch.nn.Module):
    """A hand-made language model for the pass-key validation: at every position it predicts the row's next token
    (it looks the row up among ``rows``, the prompts with their answers), except on the rows in ``wrong``, whose
    predictions are all off by one. ``selects_positions`` as asked; ``calls``: each call's rows and logits rows."""

    def __init__(self, rows: torch.Tensor, wrong: set[int], selects_positions: bool) -> None:
        super().__init__()
        self.rows, self.wrong, self.selects_positions, self.calls = rows, wrong, selects_positions, []

    def forward(self, tokens: torch.Tensor, cache=None, positions: torch.Tensor | None = None) -> torch.Tensor:
        assert cache is None and (positions is None or self.selects_positions)
        index = [
            next((i for i, row in enumerate(self.rows) if torch.equal(row[:-1], prompt)), None) for prompt in tokens
        ]  # None: a validation window of text
        if None in index:
            logits = torch.zeros(*tokens.shape, 257)  # (b, T, V)
        else:
            picks = self.rows[index, 1:] + torch.tensor([[int(i in self.wrong)] for i in index])  # (b, T)
            logits = torch.nn.functional.one_hot(picks % 257, 257).float()  # (b, T, V)
        logits = logits if positions is None else logits[positions]  # (N, V)
        self.calls.append((len(tokens), logits.numel() // 257))
        return logits

    def cost(self, path: str, rows: int, length: int, context: int = 0):
        return Cost(flops=0.0, nbytes=rows * length * 257 * 4)


@pytest.mark.parametrize("selects_positions", [True, False])
def test_passkey_validation_counts_a_row_right_only_when_its_whole_answer_is(selects_positions, monkeypatch) -> None:
    """The pass-key accuracy through the scored positions alone (``selects_positions``: the head on the answer,
    not on 32k-token prompts) or through every position's logits, in calls of as many rows as the memory bound
    lets: the same figure, counting a row only when every answer token is right."""
    objective = text_objective(length=300, passkey_fraction=1.0)
    builder, rng = objective.passkey, np.random.default_rng(0)
    rows = [objective._passkey_row(builder, 321, depth, rng) for depth in np.linspace(0, 1, 6)]
    tokens, targets = torch.stack([row for row, _ in rows]), torch.stack([target for _, target in rows])
    objective.passkey_validation = {"passkey_accuracy": {320: (tokens, targets)}}
    for memory, per_call in [(2**30, 6), (2 * 320 * 257 * 4, 2)]:
        monkeypatch.setattr("training.objectives.language_model.EVALUATION_MEMORY", memory)
        model = Oracle(tokens, wrong={1, 4}, selects_positions=selects_positions)
        figures = objective.evaluate(model, setup_distributed("cpu")).figures
        assert figures["passkey_accuracy_320"] == 4 / 6
        assert [rows for rows, _ in model.calls[-6 // per_call :]] == [per_call] * (6 // per_call)
        answers = [int((target != IGNORE_INDEX).sum()) for target in targets]
        logits_rows = [count for _, count in model.calls[-6 // per_call :]]
        if selects_positions:  # the answer's positions only
            assert logits_rows == [sum(answers[i : i + per_call]) for i in range(0, 6, per_call)]
        else:
            assert logits_rows == [per_call * 320] * (6 // per_call)


def text_run(
    out: Path,
    steps: int,
    stop_at: int | None = None,
    resume: bool = False,
    accumulation: int = 1,
    state_passing: bool = False,
    transition_norm: str = "column",
    state_reset: float = 0.0,
) -> dict:
    settings = TrainSettings(
        architecture="lrnn",
        steps=steps,
        batch_size=4,
        lr=1e-3,
        optimizer="adamw",
        beta2=0.95,
        weight_decay=0.1,
        schedule="cosine",
        warmup_steps=2,
        min_lr_fraction=0.1,
        eval_every=3,
        save_every=4,
        log_every=2,
        grad_accumulation=accumulation,
    )
    config = LRNNConfig(
        vocab_size=257, num_labels=0, d_model=8, block_size=2, num_blocks=2, d_ff=16, transition_norm=transition_norm
    )
    dist = setup_distributed("cpu")
    objective = text_objective(state_passing=state_passing, state_reset=state_reset)
    return train(
        settings,
        objective,
        config,
        out,
        "test",
        dist,
        resume="resume" if resume else None,
        stop_requested=stop_after(stop_at),
    )


def test_a_resumed_language_model_run_is_bitwise_equal_too(tmp_path: Path) -> None:
    text_run(tmp_path / "whole", steps=9)
    text_run(tmp_path / "cut", steps=9, stop_at=5)
    text_run(tmp_path / "cut", steps=9, resume=True)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")


@pytest.mark.parametrize("transition_norm", ["column", "stochastic"])
def test_a_resumed_state_passing_run_is_bitwise_equal_and_carries_its_states(tmp_path: Path, transition_norm) -> None:
    """The carried states and the rows' text positions are saved with the run: cut and resumed, it ends where the
    whole one does; and carrying the states changes the run (they reach the model)."""
    text_run(tmp_path / "whole", steps=9, state_passing=True, transition_norm=transition_norm)
    text_run(tmp_path / "cut", steps=9, stop_at=5, state_passing=True, transition_norm=transition_norm)
    text_run(tmp_path / "cut", steps=9, resume=True, state_passing=True, transition_norm=transition_norm)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    text_run(tmp_path / "plain", steps=9, transition_norm=transition_norm)
    plain, passed = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("plain", "whole"))
    assert any(not torch.equal(plain[name], passed[name]) for name in plain)


def test_a_resumed_run_with_state_resets_is_bitwise_equal_and_the_resets_change_it(tmp_path: Path) -> None:
    """--state-reset draws its rows from the run's random stream (saved with the run): cut and resumed, the run ends
    where the whole one does; and the resets reach the model."""
    text_run(tmp_path / "whole", steps=9, state_passing=True, state_reset=0.5)
    text_run(tmp_path / "cut", steps=9, stop_at=5, state_passing=True, state_reset=0.5)
    text_run(tmp_path / "cut", steps=9, resume=True, state_passing=True, state_reset=0.5)
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    text_run(tmp_path / "carried", steps=9, state_passing=True)
    carried, reset = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("carried", "whole"))
    assert any(not torch.equal(carried[name], reset[name]) for name in carried)


def test_state_reset_starts_the_drawn_rows_from_the_initial_state() -> None:
    """With --state-reset a batch names its fresh rows (about that share of them; none drawn without the option, and
    the batches are then the same as before it existed); a step starts those from the model's initial state and the
    others from their carried one, in 1 or 2 micro-batches."""
    plain, reset = text_objective(state_passing=True), text_objective(state_passing=True, state_reset=0.5)
    plain_batch = plain.batch(np.random.default_rng(3), 1)
    assert plain_batch.fresh is None
    rng = np.random.default_rng(3)
    first = reset.batch(rng, 1)
    assert torch.equal(first.tokens, plain_batch.tokens)
    draws = torch.cat([reset.batch(rng, step).fresh for step in range(2, 60)])
    assert draws.dtype == torch.bool and 0.35 < float(draws.float().mean()) < 0.65
    second = reset.batch(rng, 60)
    second = Batch(second.tokens, second.targets, second.lengths, torch.tensor([True, False, True, False]))
    model, carried = carried_after(first)
    with torch.no_grad():
        initial = model.new_cache(4)
    start = type(carried).stack([initial.select([0]), carried.select([1]), initial.select([2]), carried.select([3])])
    assert_step_from(model, second, carried, start)


def test_passkey_fresh_starts_exactly_the_rows_given_an_example_from_the_initial_state() -> None:
    """With --passkey-fresh a batch's fresh rows are those given a pass-key example this step (the needle and the
    question in their window), the text rows carry theirs; with --state-reset too, the drawn rows are added; the
    windows are those drawn without the option."""
    plain = text_objective(length=320, batch_size=16, passkey_fraction=0.3, state_passing=True)
    fresh = text_objective(length=320, batch_size=16, passkey_fraction=0.3, state_passing=True, passkey_fresh=True)
    both = text_objective(
        length=320, batch_size=16, passkey_fraction=0.3, state_passing=True, passkey_fresh=True, state_reset=0.5
    )
    rngs = [np.random.default_rng(4) for _ in range(3)]
    examples_seen = extra_resets = 0
    for step in range(1, 13):
        batches = [objective.batch(rng, step) for objective, rng in zip((plain, fresh, both), rngs)]
        assert batches[0].fresh is None and torch.equal(batches[0].tokens, batches[1].tokens)
        given, given_both = (
            torch.tensor([QUESTION in plain.tokenizer.decode(row.tolist()) for row in batch.tokens])
            for batch in batches[1:]
        )
        assert torch.equal(batches[1].fresh, given)
        assert bool((batches[2].fresh | ~given_both).all())  # with --state-reset: the drawn rows are added
        examples_seen += int(given.sum())
        extra_resets += int((batches[2].fresh & ~given_both).sum())
    assert examples_seen > 20 and extra_resets > 20


def test_state_passing_starts_each_row_from_the_state_its_last_window_ended_in() -> None:
    """One step with the carried states: each row's loss is the model's on its window read after its last one,
    and the states returned are those the model ends the window in, detached; the same in 1 or 2 micro-batches."""
    objective = text_objective(state_passing=True)
    rng = np.random.default_rng(3)
    first, second = objective.batch(rng, 1), objective.batch(rng, 2)
    assert torch.equal(second.tokens[:, 0], first.targets[:, -1])  # row i reads on where its last window ended
    model, carried = carried_after(first)
    assert_step_from(model, second, carried, carried)


def carried_after(first: Batch) -> tuple[torch.nn.Module, Any]:
    """A tiny LRNN (training mode) and the states its 4 rows end ``first``'s windows in, from the initial ones."""
    torch.manual_seed(0)
    model = build_model(
        "lrnn", LRNNConfig(vocab_size=257, num_labels=0, d_model=8, block_size=2, num_blocks=2, d_ff=16)
    ).train()
    carried = new_carried_state(model, 4)
    with torch.no_grad():
        model(first.tokens, carried)
    return model, carried


def assert_step_from(model: torch.nn.Module, batch: Batch, carried: Any, start: Any) -> None:
    """A step over ``batch`` given the carried states ``carried`` (4 rows) has the model's loss from the states
    ``start`` and returns the states it ends its windows in from there, detached; in 1 or 2 micro-batches."""
    expected = start.select(range(4))
    with torch.no_grad():
        logits = model(batch.tokens, expected)  # expected: the states the rows end in
    loss, _ = losses.masked_loss(logits, batch.targets)
    for parts in (1, 2):
        settings = TrainSettings(architecture="lrnn", steps=1, batch_size=4, lr=0.0, grad_accumulation=parts)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        run = RunState(step=1)
        _, _, ended = loop._train_step(
            model, optimizer, batch, settings, run, setup_distributed("cpu"), False, carried.select(range(4))
        )
        assert run.window[0] == pytest.approx(float(loss), rel=1e-5)
        for got, want in zip(ended.step_state(), expected.step_state()):
            torch.testing.assert_close(got, want)
            assert not got.requires_grad


def test_passkey_rows_are_prompts_scored_on_their_needle_and_answer() -> None:
    """A pass-key row: the row's own text, then a prompt of its own length ending the window; the scored targets
    are the needle's tokens after its first and the answer " {key}."."""
    objective = text_objective(length=320, batch_size=64, passkey_fraction=0.5)
    batch = objective.batch(np.random.default_rng(0), 1)
    scored = batch.targets != IGNORE_INDEX
    passkey_rows = [row for row in range(64) if not scored[row].all()]
    assert 16 < len(passkey_rows) < 48
    decode = objective.tokenizer.decode
    starts = set()
    for row in passkey_rows:
        text = decode(batch.tokens[row].tolist() + [int(batch.targets[row, -1])])  # the whole row
        key = first_number(text[text.index("The pass key is") :])
        assert text.endswith(f"{QUESTION} {key}.") and len(key) == 5
        start = text.index("There is an important info")
        starts.add(start)
        needle = f" The pass key is {key}. Remember it. {key} is the pass key."
        after_first = decode(objective.tokenizer.encode(needle)[1:])
        assert decode(batch.targets[row][scored[row]].tolist()) == after_first + f" {key}."
    assert len(starts) > 5 and min(starts) < 10  # prompts of many lengths, up to the whole window


def test_the_passkey_fraction_falls_linearly_to_its_final_value_and_rows_hold_distractors() -> None:
    """``passkey_fraction_final``: the share of pass-key rows moves from the first fraction at step 1 to the final
    one at the run's last step and stays there; the rows' filler holds other numbers than the key."""
    objective = text_objective(
        length=320, batch_size=64, passkey_fraction=1.0, passkey_fraction_final=0.25, steps=101, passkey_distractors=3
    )
    assert [objective.passkey_fraction(step) for step in (1, 51, 101, 500)] == [1.0, 0.625, 0.25, 0.25]
    rng = np.random.default_rng(0)
    shares = {}
    for step in (1, 101):
        batch = objective.batch(rng, step)
        passkey_rows = [row for row in range(64) if not (batch.targets[row] != IGNORE_INDEX).all()]
        shares[step] = len(passkey_rows) / 64
    assert shares[1] == 1.0 and 0.05 < shares[101] < 0.5
    counts = []
    batch = objective.batch(rng, 1)
    for row in range(64):  # the row's own text has no digits: every number but the key is a distractor
        text = objective.tokenizer.decode(batch.tokens[row].tolist())
        key = first_number(text[text.index("The pass key is") :])
        counts.append(sum(number != key for number in re.findall(r"\d+", text)))
    assert set(counts) == {0, 1, 2, 3}  # 0 to passkey_distractors a row
    assert text_objective(length=320, passkey_fraction=0.5).passkey_fraction(1000) == 0.5  # no final: constant


def test_a_spanning_passkey_example_puts_the_needle_in_one_window_and_asks_for_it_windows_later() -> None:
    """``passkey_span``: an example opens in a row's window (the introduction and needle put into its text), the
    row then reads on through its text, and a later window of the same row ends in the question and that key; the
    spans cover 1 to passkey_span windows, the longest growing over the run; the text is scored but for the introduction, the needle's first token,
    the token after it and the question; the open examples are kept with the data state (also as older runs kept them)."""
    span, rows = 6, 32
    objective = text_objective(
        length=320, batch_size=rows, passkey_fraction=0.3, state_passing=True, passkey_span=span, steps=21
    )
    assert [objective.longest_span(step, span) for step in (1, 6, 11, 16, 21, 40)] == [
        1,
        2,
        2,
        4,
        6,
        6,
    ]  # 6 ** progress
    text = objective.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 9000)
    objective.windows = TokenArray(np.asarray(text))  # no row runs out of text (and starts anew elsewhere)
    decode, rng = objective.tokenizer.decode, np.random.default_rng(0)
    opened: dict[int, tuple[str, int]] = {}  # row: (key, step the needle was read)
    lengths, answered, text_scored = set(), 0, 0
    previous = None
    for step in range(1, 40):
        batch = objective.batch(rng, step)
        scored = batch.targets != IGNORE_INDEX
        for row in range(rows):
            last = [int(batch.targets[row, -1])] if scored[row, -1] else []  # unscored: the text after a needle
            text = decode(batch.tokens[row].tolist() + last)
            needles = re.findall(r"The pass key is (\d+)\. Remember it\. (\d+) is the pass key\.", text)
            ask = re.search(re.escape(QUESTION) + r" (\d+)\.$", text)
            if row in opened:
                assert not needles  # no other example opens in a row with one open
                if ask:
                    key, start = opened.pop(row)
                    assert ask.group(1) == key and step - start + 1 <= objective.longest_span(start, span)
                    lengths.add(step - start + 1)
                    answered += 1
                    question = len(objective.tokenizer.encode(f"{QUESTION} {key}."))
                    answer = len(objective.passkey.answer(key))
                    tail = scored[row, -question:]
                    assert not tail[: question - answer].any() and tail[question - answer :].all()
                    text_scored += int(scored[row, :-question].sum())
                elif previous.targets[row, -1] != IGNORE_INDEX:  # inside the span: the row's text goes on
                    assert int(batch.tokens[row, 0]) == int(previous.targets[row, -1])
            elif needles and ask:  # within one window, as without a span
                lengths.add(1)
            elif needles:
                assert len(needles) == 1 and needles[0][0] == needles[0][1] and not ask
                opened[row] = (needles[0][0], step)
                intro = text.index("There is an important info")
                assert not scored[row, max(intro - 1, 0) : intro + 100].any()
                assert scored[row, text.index("Remember it") : text.index(" is the pass key")].all()
            else:
                assert not ask
        previous = batch
    assert answered > 10 and text_scored > 0
    assert lengths >= {1, 2} and max(lengths) > 3 and max(lengths) <= span
    state = objective.data_state()
    assert sum(open_span is not None for open_span in state["spans"]) == len(opened)
    resumed = text_objective(
        length=320, batch_size=rows, passkey_fraction=0.3, state_passing=True, passkey_span=span, steps=21
    )
    resumed.windows = objective.windows
    resumed.load_data_state(json.loads(json.dumps(state)))
    assert resumed.spans == objective.spans
    older = dict(state, spans=[None if saved is None else [saved["key"], saved["left"]] for saved in state["spans"]])
    resumed.load_data_state(older)  # as runs saved before retrieval spans wrote them
    assert resumed.spans == objective.spans
    again = [np.random.default_rng(9) for _ in range(2)]
    assert torch.equal(objective.batch(again[0], 40).tokens, resumed.batch(again[1], 40).tokens)


def test_gradient_accumulation_gives_the_same_step(tmp_path: Path) -> None:
    """The same batch in 1 or 3 micro-batches: the same gradients up to float rounding."""
    text_run(tmp_path / "one", steps=3)
    text_run(tmp_path / "three", steps=3, accumulation=3)
    one, three = (
        load_file(str(tmp_path / "one" / "model.safetensors")),
        load_file(str(tmp_path / "three" / "model.safetensors")),
    )
    for name in one:
        torch.testing.assert_close(one[name], three[name], rtol=1e-4, atol=1e-5)


def test_weight_decay_is_only_on_the_matrices_of_linear_maps() -> None:
    lrnn = build_model("lrnn", LRNNConfig(vocab_size=4, num_labels=2, d_model=8, block_size=2, num_blocks=2))
    decayed = decayed_parameter_names(lrnn)
    assert "blocks.0.recurrence.transition.weight" in decayed and "blocks.0.mlp.c_fc.weight" in decayed
    assert "embedding.embed.weight" in decayed
    assert not {"blocks.0.recurrence.transition.bias", "blocks.0.ln_1.weight", "ln_f.bias"} & decayed
    assert all(name.endswith("weight") for name in decayed)
    regulargpt = build_model("regulargpt", RegularGPTConfig(vocab_size=4, num_labels=2, d_model=8, n_heads=2))
    decayed = decayed_parameter_names(regulargpt)
    assert not {"blocks.0.attention.relative_bias", "blocks.0.attention.null_key"} & decayed
    assert "blocks.0.attention.heads.c_attn.weight" in decayed


def test_the_progress_bar_counts_to_the_step_the_time_budget_ends_at_when_it_comes_first() -> None:
    assert loop.progress_total(100_000, 10, seconds_per_step=0.5, seconds_left=60.0) == 130
    assert loop.progress_total(100, 10, seconds_per_step=0.5, seconds_left=60.0) == 100
    assert loop.progress_total(100_000, 10, seconds_per_step=0.5, seconds_left=-1.0) == 10  # spent: the bar is full
    assert loop.progress_total(100_000, 10, seconds_per_step=0.0, seconds_left=1.0) == 100_000


def test_the_schedule() -> None:
    settings = TrainSettings(
        architecture="lrnn", steps=10, batch_size=1, lr=1.0, schedule="cosine", warmup_steps=2, min_lr_fraction=0.1
    )
    factors = [lr_factor(settings, step) for step in range(1, 11)]
    assert factors[:2] == [0.5, 1.0] and factors[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(factors[1:]))  # from the end of the warm-up


# ---------------------------------------------------------------- the command line


def run_module(*arguments: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "training", *arguments],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def cli_run(out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train",
        "--task",
        "parity_check",
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--batch-size",
        "4",
        "--eval-lengths",
        "20-30",
        "--eval-samples",
        "6",
        "--eval-every",
        "40",
        "--log-every",
        "5",
        "--threads",
        "1",
        "--no-progress",
        "--dropout",
        "0.1",
        *TINY_LRNN,
        *extra,
    ]


@pytest.mark.slow
def test_sigterm_saves_and_exits_0_and_the_run_resumes_to_the_same_end(tmp_path: Path) -> None:
    assert main(cli_run(tmp_path / "whole", 400)) == 0
    process = run_module(*cli_run(tmp_path / "cut", 400))
    deadline = time.monotonic() + 60
    while step_in_log(tmp_path / "cut") < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    _, err = process.communicate(timeout=30)
    assert process.returncode == 0, err
    assert time.monotonic() - sent < 5
    state = json.loads(load_file_metadata(tmp_path / "cut" / RESUME_FILE)["state"])
    assert state["run"]["stopped"] == "signal" and 10 <= state["run"]["step"] < 400
    assert main(["train", "--resume", "--out", str(tmp_path / "cut"), "--threads", "1", "--no-progress"]) == 0
    assert_same_run(tmp_path / "whole", tmp_path / "cut")


def load_file_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata()


def test_the_time_budget_stops_within_a_step_and_saves(tmp_path: Path, capsys) -> None:
    started = time.perf_counter()
    assert main(cli_run(tmp_path / "run", 100_000, "--time-budget", "1")) == 0
    assert time.perf_counter() - started < 10
    metadata = load_checkpoint(tmp_path / "run").config.metadata
    assert metadata["stopped"] == "time" and 0 < metadata["steps"] < 100_000
    assert "stopped: time" in capsys.readouterr().out
    assert (
        main(
            [
                "train",
                "--resume",
                "--out",
                str(tmp_path / "run"),
                "--time-budget",
                "0.5",
                "--threads",
                "1",
                "--no-progress",
            ]
        )
        == 0
    )
    assert load_checkpoint(tmp_path / "run").config.metadata["steps"] > metadata["steps"]


def killed_at_rename(source: Any, destination: Any) -> None:
    """``os.replace`` in a process SIGKILLed between writing a save's temporary file and renaming it into place."""
    raise SystemExit("killed")


ANOTHER_FORMAT = b"another format"  # made into a readable resume file of a format this build does not read
RUN_FLAGS = ["--task", "parity_check", "--steps", "3", *TINY_LRNN]
NEEDS_FLAGS = "(no resume.safetensors), and a new run needs --task and --arch"
BAD_RESUME = {  # the folder's files (None: no folder), the flags after --resume --out, what stderr says
    "nothing saved, no flags to start a run": (None, [], NEEDS_FLAGS),
    "nothing saved, a setting but no task": ({LOG_FILE: b""}, ["--lr", "0.1"], NEEDS_FLAGS),
    "a corrupt resume file": ({RESUME_FILE: b"not safetensors"}, [], "not a readable resume file (truncated or"),
    "a corrupt resume file, the run's flags": ({RESUME_FILE: b"\0" * 64}, RUN_FLAGS, "not a readable resume file"),
    "a resume file of another format": ({RESUME_FILE: ANOTHER_FORMAT}, RUN_FLAGS, "resume format 999; this build"),
    "a checkpoint without its resume file": ({"config.json": b"{}"}, RUN_FLAGS, "resume.safetensors: missing; there"),
}


@pytest.mark.parametrize("case", sorted(BAD_RESUME))
def test_bad_resume_exits_2_with_one_line_and_changes_nothing(case: str, tmp_path: Path, capsys) -> None:
    """--resume refuses a save that does not load (never starting over it); on a folder with nothing saved it
    starts the run anew, which needs the flags of a new run."""
    files, extra, message = BAD_RESUME[case]
    out = tmp_path / "run"
    if files is not None:
        out.mkdir()
        for name, content in files.items():
            if content == ANOTHER_FORMAT:
                save_file({"x": torch.zeros(1)}, str(out / name), metadata={"state": json.dumps({"format": 999})})
            else:
                (out / name).write_bytes(content)
    before = {path.name: path.read_bytes() for path in out.iterdir()} if files is not None else None
    assert main(["train", "--resume", "--out", str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert ({path.name: path.read_bytes() for path in out.iterdir()} if out.exists() else None) == before


def test_resume_with_nothing_saved_yet_starts_the_run_from_step_0(tmp_path: Path, monkeypatch, capsys) -> None:
    """A run killed in its first save (its log's start record and the save's temporary file are all it left) has
    nothing to resume: its command again with --resume appended starts it anew, says so in one line on stderr,
    and ends as the run never killed does."""
    assert main(cli_run(tmp_path / "whole", 3)) == 0
    out = tmp_path / "killed"
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", killed_at_rename)
        with pytest.raises(SystemExit, match="killed"):
            main(cli_run(out, 3))
    assert {path.name for path in out.iterdir()} == {LOG_FILE, f".{RESUME_FILE}.tmp"}
    capsys.readouterr()
    assert main(cli_run(out, 3, "--resume")) == 0
    err = capsys.readouterr().err
    assert f"nothing to resume in {out} (no {RESUME_FILE}): starting the run from step 0\n" in err
    assert [record["event"] for record in log_records(out)].count("start") == 1
    assert_same_run(tmp_path / "whole", out)


def test_a_run_starts_by_removing_the_temporary_files_of_saves_killed_midway_and_nothing_else(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """A save killed between writing its temporary file and renaming it leaves that file (the resume file's, the
    checkpoint's two); the next run on the folder, new or resumed, deletes exactly those names before it trains
    and says so on stderr. A file of any other name stays, however close its name."""
    out = tmp_path / "run"
    config = LRNNConfig(vocab_size=2, num_labels=2, d_model=8, block_size=2, num_blocks=2, d_ff=16)
    checkpoint = CheckpointConfig(
        architecture="lrnn", model=config, kind="transduce", task="parity_check", alphabet="01", labels=("0", "1")
    )
    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", killed_at_rename)
        with pytest.raises(SystemExit, match="killed"):
            task_run(out, steps=4)  # in its first save: the resume file's, before step 4's evaluation
        with pytest.raises(SystemExit, match="killed"):
            save_checkpoint(build_model("lrnn", config), checkpoint, out)
    stale = {path.name for path in out.iterdir()} - {LOG_FILE}
    assert stale == {".resume.safetensors.tmp", ".model.safetensors.tmp", ".config.json.tmp"}
    others = {".tmpk2x9q1", "notes.tmp", ".resume.safetensors.tmp.bak", "resume.safetensors.tmp", ".config.json.tmp~"}
    for name in others:
        (out / name).write_text("not a save's")
    seen: list[set[str]] = []

    def look() -> bool:  # after each step: the first one's comes before the run's first save
        seen.append({path.name for path in out.iterdir()})
        return False

    capsys.readouterr()
    for resume, steps in ((False, 4), (True, 6)):  # new, then resumed after more killed saves
        for name in stale:
            (out / name).write_bytes(b"half a save")
        seen.clear()
        task_run(out, steps=steps, resume=resume, stop_requested=look)
        assert stale.isdisjoint(seen[0]) and others <= seen[0], seen[0]
        assert (
            f"removed 3 temporary file(s) of saves killed before their rename from {out}: "
            ".resume.safetensors.tmp, .model.safetensors.tmp, .config.json.tmp\n"
        ) in capsys.readouterr().err
    assert all((out / name).read_text() == "not a save's" for name in others)
    assert [record["event"] for record in log_records(out)].count("resume") == 1


def test_a_run_retried_with_resume_appended_goes_on_and_a_differing_flag_is_named(tmp_path: Path, capsys) -> None:
    """What a cluster scheduler does on requeue: the job's command again, with --resume appended."""
    run = tmp_path / "run"
    assert main(cli_run(run, 6, "--time-budget", "0.001")) == 0
    cut = load_checkpoint(run).config.metadata["steps"]
    assert cut < 6
    capsys.readouterr()
    differing = cli_run(run, 6, "--resume", "--lr", "0.1", "--dropout", "0.2", "--balanced", "--eval-lengths=20-31")
    assert main(differing) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    for named in (
        "--balanced is given here but was not given when the run started",
        "--dropout is 0.2 here but was 0.1 when the run started",
        "--eval-lengths is 20-31 here but was 20-30 when the run started",
        "--lr is 0.1 here but was 0.0003 when the run started",
    ):
        assert named in err, err
    assert main(cli_run(run, 6, "--resume", "--task", "even_pairs")) == 2
    assert "--task is even_pairs here but was parity_check when the run started" in capsys.readouterr().err
    assert load_checkpoint(run).config.metadata["steps"] == cut  # refused before anything ran
    assert main(cli_run(run, 6, "--time-budget", "60", "--resume")) == 0
    assert load_checkpoint(run).config.metadata["steps"] == 6
    events = [record["event"] for record in log_records(run)]
    assert events.count("resume") == 1 and events[-1] == "end"


def test_the_arguments_of_a_recorded_command_are_found_in_either_launcher_form() -> None:
    from training.cli.train import _training_arguments, command_line

    for world_size, local_world_size in ((1, 1), (2, 2), (4, 2)):
        recorded = command_line(
            ["train", "--task", "parity_check", "--corpus", "text:a b"], world_size, local_world_size
        )
        assert _training_arguments(recorded) == ["train", "--task", "parity_check", "--corpus", "text:a b"]


def test_a_finished_run_needs_more_steps_to_resume(tmp_path: Path, capsys) -> None:
    assert main(cli_run(tmp_path / "run", 3)) == 0
    assert main(["train", "--resume", "--out", str(tmp_path / "run")]) == 2
    assert "is at step 3 of 3 (stopped: steps); give --steps above 3" in capsys.readouterr().err
    assert main(["train", "--resume", "--out", str(tmp_path / "run"), "--steps", "5", "--no-progress"]) == 0
    assert load_checkpoint(tmp_path / "run").config.metadata["steps"] == 5


def test_a_run_whose_last_evaluation_died_resumes_without_more_steps(tmp_path: Path, monkeypatch) -> None:
    def dying(self, model, dist):
        raise MemoryError("killed by the OOM killer")

    with monkeypatch.context() as patch:
        patch.setattr(TransductionObjective, "evaluate", dying)
        with pytest.raises(MemoryError):
            main(cli_run(tmp_path / "run", 3))
    assert main(["train", "--resume", "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    metadata = load_checkpoint(tmp_path / "run").config.metadata
    assert metadata["steps"] == 3 and metadata["stopped"] == "steps"
    assert [record["step"] for record in log_records(tmp_path / "run") if record["event"] == "eval"] == [3]


def test_a_new_run_does_not_overwrite_a_resumable_one(tmp_path: Path, capsys) -> None:
    assert main(cli_run(tmp_path / "run", 2, "--time-budget", "0.01")) == 0
    assert main(cli_run(tmp_path / "run", 2)) == 2
    assert "pass --overwrite to replace it, or --resume to continue its run" in capsys.readouterr().err


@pytest.mark.slow
def test_torchrun_resume_continues_every_process_where_it_stopped(tmp_path: Path) -> None:
    """Two processes, each with its own data stream: cut after the first step by the time budget (every process
    stops at the same step), resumed, they end where an uncut two-process run ends."""

    def torchrun(*arguments: str) -> None:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "-m",
                "training",
                *arguments,
            ],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr[-8000:]  # the ranks' own errors come before torchrun's summary

    torchrun(*cli_run(tmp_path / "whole", 12, "--device", "cpu"))
    torchrun(*cli_run(tmp_path / "cut", 12, "--device", "cpu", "--time-budget", "0.001"))
    assert load_checkpoint(tmp_path / "cut").config.metadata["steps"] < 12
    torchrun("train", "--resume", "--out", str(tmp_path / "cut"), "--device", "cpu", "--threads", "1")
    assert_same_run(tmp_path / "whole", tmp_path / "cut")
    assert log_records(tmp_path / "cut")[-1]["param_sha256"][0] == log_records(tmp_path / "cut")[-1]["param_sha256"][1]


@pytest.mark.parametrize("transition_norm", ["column", "stochastic"])
def test_the_head_at_scored_positions_only_gives_the_full_passes_logits_there(transition_norm) -> None:
    """What the loop asks of an LRNN when a batch scores few positions (pass-key rows, padding)."""
    torch.manual_seed(0)
    model = build_model(
        "lrnn",
        LRNNConfig(
            vocab_size=50, num_labels=0, d_model=8, block_size=2, num_blocks=2, d_ff=16, transition_norm=transition_norm
        ),
    )
    tokens = torch.randint(0, 50, (3, 11))
    positions = torch.rand(3, 11) < 0.3
    selected = model(tokens, positions=positions)  # (N, V)
    assert selected.shape == (int(positions.sum()), 50)
    torch.testing.assert_close(selected, model(tokens)[positions])


def test_passkey_rows_fit_every_key_in_the_shipped_bpe() -> None:
    """A key's BPE tokens differ with its digits: the bound ``shortest()`` holds for every key drawn, and rows with
    the shortest prompt length the objective draws are built for any key."""
    from model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("file:tokenizer.tiktoken", REPO / "checkpoints" / "text-lrnn")
    builder = PassKeyBuilder(tokenizer, np.asarray(tokenizer.encode("It was a fine day in the country. " * 40)))
    rng = np.random.default_rng(0)
    keys = [str(key) for key in rng.integers(10_000, 100_000, size=3000)]
    assert max(builder.shortest(key) for key in keys) <= builder.shortest()
    for _ in range(200):
        tokens, targets = LanguageModelObjective._passkey_row(
            builder, 129, float(rng.random()), rng, builder.shortest() + 8, np.zeros(129, dtype=np.int64)
        )
        assert tokens.shape == (129,) and targets.shape == (128,)


def test_the_training_loss_and_its_gradient_equal_torchs_cross_entropy() -> None:
    """``masked_loss`` with a gradient to take (``SummedCrossEntropy``: the gradient made in the forward pass) gives
    torch's summed cross-entropy and its gradient, ignored positions included: rows of every scale, a row whose
    target's probability underflows float32 (its loss from logsumexp, ~300), and the same argmaxes counted."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=generator) * torch.tensor([0.1, 1.0, 8.0]).view(3, 1, 1)
    targets = torch.randint(0, 40, (3, 5), generator=generator)
    targets[0, 1] = targets[2, 4] = IGNORE_INDEX
    logits[1, 2] = 0.0
    logits[1, 2, targets[1, 2]] = -300.0  # e^-300: 0 in float32
    weights = torch.randn(3, 5, 40, generator=generator)  # what comes before the head, in a model

    def loss_and_gradient(fused: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        leaf = logits.clone().requires_grad_()
        scaled = leaf * weights.exp()
        if fused:
            loss, correct = losses.masked_loss(scaled, targets)
        else:
            loss = torch.nn.functional.cross_entropy(scaled.flatten(0, 1), targets.flatten(), reduction="sum")
            correct = int(((scaled.argmax(dim=-1) == targets) & (targets != IGNORE_INDEX)).sum())
        (loss / 7).backward()
        return loss.detach(), leaf.grad, correct

    loss, gradient, correct = loss_and_gradient(True)
    want_loss, want_gradient, want_correct = loss_and_gradient(False)
    assert float(want_loss) > 300
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gradient, want_gradient, rtol=1e-5, atol=1e-6)
    assert correct == want_correct
    assert not bool(gradient[0, 1].any()) and not bool(gradient[2, 4].any())
    leaf = logits.clone().requires_grad_()
    loss, _ = losses.masked_loss(leaf * 2, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):  # the gradient was scaled in place
        loss.backward()


@pytest.mark.parametrize(("taught", "scaled"), [(True, False), (True, True), (False, True)])
def test_the_distilled_loss_and_its_gradient_are_the_mixture_of_two_cross_entropies(taught: bool, scaled: bool) -> None:
    """``masked_loss`` with a teacher's distributions and per-position weights w: the loss is (1 - w) times the
    target's cross-entropy plus w times the teacher's, its gradient that of the same mixture written with torch (w 0:
    the target alone, w 1: the teacher alone), ignored positions give nothing; a per-position ``scale`` multiplies
    each position's loss, with or without a teacher; ``target_loss`` reads the targets' own plain loss off it, as
    without either."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 40, generator=generator) * torch.tensor([0.1, 1.0, 8.0]).view(3, 1, 1)
    targets = torch.randint(0, 40, (3, 5), generator=generator)
    targets[0, 1] = targets[2, 4] = IGNORE_INDEX
    soft = torch.softmax(torch.randn(3, 5, 40, generator=generator) * 3, dim=-1)
    weights = torch.tensor([0.0, 0.3, 1.0]).view(3, 1).expand(3, 5) if taught else torch.zeros(3, 5)
    scale = torch.tensor([2.0, 0.5, 7.0]).view(3, 1).expand(3, 5) if scaled else torch.ones(3, 5)

    def loss_and_gradient(fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        leaf = logits.clone().requires_grad_()
        scaled_logits = leaf * 1.5
        if fused:
            given = (soft, weights) if taught else (None, None)
            loss, _ = losses.masked_loss(scaled_logits, targets, *given, scale if scaled else None)
            target = losses.target_loss(loss)
        else:
            real = targets != IGNORE_INDEX
            log_p = torch.log_softmax(scaled_logits, dim=-1)
            hard = -log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
            from_teacher = -(soft * log_p).sum(-1)
            loss = (((1 - weights) * hard + weights * from_teacher) * scale * real).sum()
            target = (hard * real).sum().detach()
        (loss / 3).backward()
        return loss.detach(), leaf.grad, target

    loss, gradient, target = loss_and_gradient(True)
    want_loss, want_gradient, want_target = loss_and_gradient(False)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gradient, want_gradient, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(target, want_target, rtol=1e-5, atol=1e-4)
    assert not bool(gradient[0, 1].any()) and not bool(gradient[2, 4].any())
    plain, _ = losses.masked_loss(logits.clone().requires_grad_(), targets)
    torch.testing.assert_close(
        losses.target_loss(plain),
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"),
        rtol=1e-5,
        atol=1e-4,
    )


def test_with_a_teacher_the_rows_given_a_pass_key_example_are_not_distilled() -> None:
    """``Batch.distilled``: every text row, no row given a pass-key example (the teacher may answer it wrong); None
    without a teacher."""
    objective = text_objective(length=300, passkey_fraction=0.5)
    assert objective.batch(np.random.default_rng(0), 1).distilled is None
    objective.teacher = object()  # only whether there is one matters to the batch
    seen = set()
    for step in range(1, 6):
        batch = objective.batch(np.random.default_rng(step), step)
        examples = (batch.targets == IGNORE_INDEX).any(dim=1)  # a text row scores every position
        assert torch.equal(batch.distilled, ~examples)
        seen |= set(batch.distilled.tolist())
    assert seen == {True, False}
