"""Checkpoint folders: ``config.json`` beside ``model.safetensors``, never pickled, written atomically and
world-readable. Loading is strict: missing, unexpected or misshapen tensors, truncation, SHA-256 mismatches and
non-finite weights raise :class:`CheckpointError`."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from model.base import SequenceModel
from model.config import CheckpointConfig, ConfigError
from model.device import resolve_device
from model.registry import build_model

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
FILE_MODE = 0o644  # whatever the umask: the server may run as another user (the Docker image's non-root one)


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message names the file and the problem."""


@dataclass
class LoadedCheckpoint:
    model: SequenceModel
    config: CheckpointConfig
    path: Path


def save_checkpoint(model: SequenceModel, config: CheckpointConfig, directory: str | os.PathLike[str]) -> Path:
    """Write ``config.json`` and ``model.safetensors`` (float tensors as stored in the model) into directory."""
    if model.config != config.model:
        raise CheckpointError("the model's hyper-parameters differ from config.model")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: tensor.detach().contiguous().cpu() for name, tensor in model.state_dict().items()}
    metadata = {
        "format": "pt",
        "architecture": config.architecture,
        "sha256": json.dumps({name: _digest(tensor) for name, tensor in sorted(tensors.items())}),
    }
    weights_tmp = directory / f".{WEIGHTS_FILE}.tmp"
    save_file(tensors, str(weights_tmp), metadata=metadata)
    weights_tmp.chmod(FILE_MODE)
    config_tmp = _config_tmp(config, directory)
    os.replace(weights_tmp, directory / WEIGHTS_FILE)
    os.replace(config_tmp, directory / CONFIG_FILE)
    return directory


def upgrade_config(directory: str | os.PathLike[str]) -> bool:
    """Rewrite an older ``config.json`` in the current format; returns whether it changed."""
    directory = Path(directory)
    config = read_config(directory)
    if json.loads((directory / CONFIG_FILE).read_text()) == json.loads(_config_text(config)):
        return False
    os.replace(_config_tmp(config, directory), directory / CONFIG_FILE)
    return True


def _config_tmp(config: CheckpointConfig, directory: Path) -> Path:
    path = directory / f".{CONFIG_FILE}.tmp"
    path.write_text(_config_text(config))
    path.chmod(FILE_MODE)
    return path


def _config_text(config: CheckpointConfig) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"


def read_config(directory: str | os.PathLike[str]) -> CheckpointConfig:
    """Parse and validate ``config.json`` of a checkpoint folder."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (a checkpoint folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        data = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: not valid JSON: {error}") from None
    try:
        return CheckpointConfig.from_dict(data)
    except ConfigError as error:
        raise CheckpointError(f"{path}: {error}") from None


def load_checkpoint(
    directory: str | os.PathLike[str], device: str = "auto", dtype: torch.dtype | None = None
) -> LoadedCheckpoint:
    """Load a checkpoint folder strictly onto ``device``, in the stored floating dtype or ``dtype``."""
    directory = Path(directory)
    config = read_config(directory)
    model = build_model(config.architecture, config.model)
    tensors = read_weights(directory / WEIGHTS_FILE)
    stored_dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(stored_dtypes) == 1:
        model = model.to(stored_dtypes.pop())
    _load_strict(model, tensors, directory / WEIGHTS_FILE)
    model = model.to(resolve_device(device))
    if dtype is not None:
        model = model.to(dtype)
    return LoadedCheckpoint(model=model.eval(), config=config, path=directory)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Read every tensor of a safetensors file and check it against the digests in its header."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"{path}: not a readable safetensors file (truncated or corrupted?): {error}") from None
    digests = _parse_digests(path, metadata)
    for name, tensor in tensors.items():
        if digests is not None and digests.get(name) != _digest(tensor):
            raise CheckpointError(f"{path}: tensor {name!r} does not match its SHA-256 in the header (corrupted)")
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{path}: tensor {name!r} holds NaN or infinite values")
    return tensors


def _parse_digests(path: Path, metadata: dict[str, str]) -> dict[str, str] | None:
    """The per-tensor digests from the header; None for files written by other tools (no digests)."""
    if "sha256" not in metadata:
        return None
    try:
        digests = json.loads(metadata["sha256"])
    except json.JSONDecodeError:
        raise CheckpointError(f"{path}: the header's sha256 entry is not valid JSON (corrupted)") from None
    if not isinstance(digests, dict):
        raise CheckpointError(f"{path}: the header's sha256 entry is not an object (corrupted)")
    return digests


def _load_strict(model: SequenceModel, tensors: dict[str, torch.Tensor], path: Path) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected}")
    for name in sorted(set(expected) & set(tensors)):
        want, got = expected[name], tensors[name]
        if want.shape != got.shape:
            problems.append(f"{name}: shape {tuple(got.shape)} in the file, {tuple(want.shape)} in the model")
        elif want.dtype.is_floating_point != got.dtype.is_floating_point:
            problems.append(f"{name}: dtype {got.dtype} in the file, {want.dtype} in the model")
    if problems:
        raise CheckpointError(f"{path}: does not fit config.json: " + "; ".join(problems))
    model.load_state_dict(tensors, strict=True)


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # raw bytes, any dtype
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()
