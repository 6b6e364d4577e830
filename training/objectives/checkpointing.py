"""What a run writes to its output folder: the served checkpoint, the resume file (saved, loaded, exported as a
checkpoint), the log ``train.jsonl``, and the digest of the weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.base import SequenceModel
from model.cache import InferenceCache
from model.checkpoint import CONFIG_FILE, FILE_MODE, WEIGHTS_FILE, read_config, save_checkpoint
from model.config import BaseModelConfig
from model.registry import build_model
from model.tokenizer import FILE_PREFIX, ranks_file
from training.objectives.carried import carried_values, restore_carried
from training.objectives.distributed import Distributed
from training.objectives.run import Objective, RunState, TrainSettings

LOG_FILE = "train.jsonl"
RESUME_FILE = "resume.safetensors"
RESUME_FORMAT = 1


class ResumeError(ValueError):
    """A run that cannot be resumed; the message says why."""


def save_run_checkpoint(
    model: SequenceModel,
    best_state: dict[str, torch.Tensor] | None,
    objective: Objective,
    settings: TrainSettings,
    model_config: BaseModelConfig,
    out: Path,
    command: str,
    dist: Distributed,
    run: RunState,
) -> None:
    """The served checkpoint: the best weights when the objective keeps them, else the current ones."""
    metadata = run_metadata(settings, objective, command, dist, run)
    config = objective.checkpoint_config(settings.architecture, model_config, metadata)
    if best_state is None:
        save_checkpoint(model, config, out)
    else:
        current = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        model.load_state_dict(best_state)
        save_checkpoint(model, config, out)
        model.load_state_dict(current)
    objective.write_files(out)


def run_metadata(
    settings: TrainSettings, objective: Objective, command: str, dist: Distributed, run: RunState
) -> dict[str, Any]:
    """The checkpoint's provenance; ``stopped`` is None in the copies saved while training goes on."""
    return {
        "command": command,
        **_run_figures(run),
        "world_size": dist.world_size,
        "device": dist.device.type,
        "torch": torch.__version__,
        "settings": {**settings.to_dict(), **objective.settings()},
        **objective.metadata(run),
    }


def _run_figures(run: RunState) -> dict[str, Any]:
    """The checkpoint metadata's figures of where the run is."""
    return {
        "steps": run.step,
        "stopped": run.stopped,
        "wall_time_s": round(run.elapsed_s, 3),
        "tokens": run.tokens,
        "tokens_per_s": round(run.tokens / max(run.elapsed_s, 1e-9), 1),
    }


def save_resume(
    out: Path,
    model: SequenceModel,
    optimizer: torch.optim.Optimizer,
    rng: np.random.Generator,
    objective: Objective,
    run: RunState,
    best_state: dict[str, torch.Tensor] | None,
    settings: TrainSettings,
    model_config: BaseModelConfig,
    command: str,
    log: TextIO | None,
    dist: Distributed,
    carried: InferenceCache | None = None,
) -> None:
    """Write ``resume.safetensors`` (rank 0; every process's random streams, data position, carried states and log
    figures since the last record gathered to it)."""
    own = {
        "window": run.window,
        "numpy": rng.bit_generator.state,
        "torch": torch.get_rng_state().tolist(),
        "cuda": [state.tolist() for state in torch.cuda.get_rng_state_all()] if dist.device.type == "cuda" else [],
        "data": objective.data_state(),
        "carried": carried_values(carried),
    }
    if objective.teacher is not None:
        own["teacher_carried"] = carried_values(objective.teacher.carried)
    processes = [json.loads(text) for text in dist.gather(json.dumps(own))]
    if not dist.is_main:
        return
    if log is not None:
        log.flush()
        run.log_bytes = log.tell()
    tensors = {f"model.{name}": tensor for name, tensor in model.state_dict().items()}
    if best_state is not None:
        tensors.update({f"best.{name}": tensor for name, tensor in best_state.items()})
    optimizer_state = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for index, values in optimizer_state["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer.{index}.{name}"] = value
            else:
                scalars.setdefault(str(index), {})[name] = value
    state = {
        "format": RESUME_FORMAT,
        "command": command,
        "run": dataclasses.asdict(run),
        "settings": settings.to_dict(),
        "objective": {"name": objective.name, **objective.settings()},
        "architecture": settings.architecture,
        "model": dataclasses.asdict(model_config),
        "world_size": dist.world_size,
        "optimizer": {"param_groups": optimizer_state["param_groups"], "scalars": scalars},
        "processes": processes,
    }
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in tensors.items()}
    temporary = temporary_file(out / RESUME_FILE)
    save_file(tensors, str(temporary), metadata={"state": json.dumps(state)})
    temporary.chmod(FILE_MODE)
    os.replace(temporary, out / RESUME_FILE)


def temporary_file(path: Path) -> Path:
    """Where a save writes ``path`` before renaming it into place: ``.NAME.tmp`` beside it."""
    return path.with_name(f".{path.name}.tmp")


def remove_stale_temporaries(out: Path) -> list[Path]:
    """Delete ``.resume.safetensors.tmp``, ``.model.safetensors.tmp`` and ``.config.json.tmp`` in ``out`` (left by
    saves killed before their rename), no other file. Returns the paths removed."""
    removed = []
    for name in (RESUME_FILE, WEIGHTS_FILE, CONFIG_FILE):
        path = temporary_file(Path(out) / name)
        if path.is_file() or path.is_symlink():
            path.unlink()
            removed.append(path)
    return removed


def read_resume_state(out: Path, with_tensors: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The JSON state and the tensors (none unless ``with_tensors``) of ``out/resume.safetensors``; ResumeError when it
    is missing or unreadable."""
    path = Path(out) / RESUME_FILE
    if not path.is_file():
        raise ResumeError(f"{path}: missing; there is no run to resume in {out}")
    try:
        with safe_open(str(path), framework="pt") as handle:
            state = json.loads((handle.metadata() or {})["state"])
            names = handle.keys() if with_tensors else []
            tensors = {name: handle.get_tensor(name) for name in names}
    except (SafetensorError, OSError, ValueError, RuntimeError, KeyError) as error:
        raise ResumeError(f"{path}: not a readable resume file (truncated or corrupted?): {error}") from None
    if state.get("format") != RESUME_FORMAT:
        raise ResumeError(f"{path}: resume format {state.get('format')!r}; this build reads {RESUME_FORMAT}")
    return state, tensors


def export_weights(run: Path, out: Path, best: bool = False) -> dict[str, Any]:
    """Write the weights of the run's last resume save (``best``: the best kept) as a checkpoint folder ``out``,
    with the run's config.json and tokenizer file. Returns the metadata; ResumeError, CheckpointError or
    TokenizerError says what is missing."""
    run, out = Path(run), Path(out)
    if out.resolve() == run.resolve():
        raise ResumeError(f"--out {out} is the run's own folder; export into another one")
    state, tensors = read_resume_state(run)
    if not (run / CONFIG_FILE).is_file():
        raise ResumeError(
            f"{run} has no {CONFIG_FILE} yet (a run writes it at its first evaluation): it says what the "
            f"checkpoint serves (its tokenizer or task)"
        )
    config = read_config(run)
    tokenizer = None
    if config.tokenizer is not None and config.tokenizer.startswith(FILE_PREFIX):
        tokenizer = ranks_file(config.tokenizer, run)  # checked before anything is written
    prefix = "best." if best else "model."
    weights = {name[len(prefix) :]: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
    if not weights:
        raise ResumeError(f"{run / RESUME_FILE} holds no best weights (the run keeps none, or has not evaluated)")
    model = build_model(state["architecture"], config.model)
    try:
        model.load_state_dict(weights)
    except RuntimeError as error:  # a resume file of another run than the checkpoint's
        raise ResumeError(f"{run / RESUME_FILE}: its weights do not fit {run / CONFIG_FILE}: {error}") from None
    saved = RunState(**{**state["run"], "stopped": None})  # a copy saved while training goes on
    metadata = {**config.metadata, **_run_figures(saved), "exported": {"from": str(run), "best": best}}
    save_checkpoint(model, dataclasses.replace(config, metadata=metadata), out)
    if tokenizer is not None:
        copy = out / tokenizer.relative_to(run.resolve())
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tokenizer, copy)
    return metadata


def load_resume(
    out: Path,
    model: SequenceModel,
    optimizer: torch.optim.Optimizer,
    rng: np.random.Generator,
    objective: Objective,
    dist: Distributed,
    carried: InferenceCache | None = None,
) -> tuple[RunState, dict[str, torch.Tensor] | None]:
    """Restore the run in ``out`` into the model, optimizer, random stream, objective and ``carried`` (in place)."""
    state, tensors = read_resume_state(out)
    if state["world_size"] != dist.world_size:
        raise ResumeError(
            f"{out} was trained by {state['world_size']} process(es); resume it with as many "
            f"(each one's data stream is its own), not {dist.world_size}"
        )
    device = dist.device
    model.load_state_dict(
        {name[len("model.") :]: tensor for name, tensor in tensors.items() if name.startswith("model.")}
    )
    best = {name[len("best.") :]: tensor.to(device) for name, tensor in tensors.items() if name.startswith("best.")}
    optimizer_state: dict[str, Any] = {"state": {}, "param_groups": state["optimizer"]["param_groups"]}
    for name, tensor in tensors.items():
        if name.startswith("optimizer."):
            _, index, key = name.split(".", 2)
            optimizer_state["state"].setdefault(int(index), {})[key] = tensor.to(device)
    for index, values in state["optimizer"]["scalars"].items():
        optimizer_state["state"].setdefault(int(index), {}).update(values)
    optimizer.load_state_dict(optimizer_state)
    own = state["processes"][dist.rank]
    rng.bit_generator.state = own["numpy"]
    torch.set_rng_state(torch.tensor(own["torch"], dtype=torch.uint8))
    if own["cuda"]:
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in own["cuda"]])
    objective.load_data_state(own["data"])
    restore_carried(carried, own["carried"])
    if objective.teacher is not None:
        restore_carried(objective.teacher.carried, own.get("teacher_carried"))
    return RunState(**{**state["run"], "window": own["window"]}), best or None


def weights_digest(model: SequenceModel) -> str:
    """SHA-256 over every parameter and buffer (names and raw bytes, sorted by name): equal iff the weights are."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def open_log(out: Path, dist: Distributed, keep_bytes: int | None) -> TextIO | None:
    """Rank 0's log: a new one, or (``keep_bytes``) the old one cut back to the records of the saved state."""
    if not dist.is_main:
        return None
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOG_FILE
    if keep_bytes is None:
        return path.open("w")
    log = path.open("r+" if path.exists() else "w")
    log.truncate(keep_bytes)
    log.seek(keep_bytes)
    return log


def write_record(log: TextIO | None, **record: Any) -> None:
    if log is not None:
        log.write(json.dumps(record) + "\n")
        log.flush()
