"""The served models: every checkpoint folder under the given directories, loaded strictly, with what requests need to
turn text into token ids (a transducer's alphabet, a language model's tokenizer). A model's id is its folder's name; a
folder that fails to load is reported with its path and reason and skipped.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from model.base import SequenceModel
from model.checkpoint import CONFIG_FILE, CheckpointError, load_checkpoint
from model.config import CheckpointConfig
from model.cuda_graphs import Decoder
from model.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from server.api.protocol import DecodeStep, ModelCard
from server.errors import InvalidInput
from server.sched.costing import ModelBudget, ModelLimits

logger = logging.getLogger(__name__)
TOKEN_ID_TYPE = "i"  # a transducer input's token ids: array("i"), 4-byte integers (torch.frombuffer: torch.int32)
NATIVE_UTF32 = "utf-32-le" if sys.byteorder == "little" else "utf-32-be"  # code points as array("i") holds them


@dataclass
class ServedModel:
    id: str
    model: SequenceModel
    config: CheckpointConfig
    path: Path
    tokenizer: Tokenizer | None = None
    symbol_ids: dict[int, str] = field(default_factory=dict)  # a transducer's ord(symbol) -> chr(its token id)
    outside_alphabet: re.Pattern[str] | None = None  # finds the first character that is not a symbol
    notes: list[str] = field(default_factory=list)  # what ``model.for_serving()`` changed (logged at DEBUG)
    budget: ModelBudget | None = None  # set by the engine once the model's speed is measured
    limits: ModelLimits | None = None
    decoder: Decoder | None = None  # a generation model's decode step, set by the engine (CUDA graphs or eager)
    engine_card: ModelCard | None = None  # its card as the engine process describes it (the API process's copy of a
    # model served there holds no weights: ``server/engine/client.py``)

    @property
    def kind(self) -> str:
        return self.config.kind

    def card(self) -> ModelCard:
        if self.engine_card is not None:
            return self.engine_card
        return ModelCard(
            id=self.id,
            kind=self.config.kind,
            architecture=self.config.architecture,
            task=self.config.task,
            alphabet=self.config.alphabet,
            labels=list(self.config.labels) if self.config.labels is not None else None,
            tokenizer=self.config.tokenizer,
            vocab_size=self.config.model.vocab_size,
            parameters=sum(parameter.numel() for parameter in self.model.parameters()),
            limits=None if self.limits is None else self.limits.as_dict(),
            decode=None if self.decoder is None else DecodeStep(**vars(self.decoder.path)),
        )

    def encode_symbols(self, text: str, where: str) -> array[int]:
        """A transducer input -> its token ids (no Python loop over the symbols); a character outside the alphabet
        raises :class:`InvalidInput` (422) naming its position."""
        assert self.outside_alphabet is not None  # set for a transducer (``served_transducer``)
        outside = self.outside_alphabet.search(text)
        if outside is not None:
            raise InvalidInput(
                f"{where}: character {outside.group()!r} at position {outside.start()} is not in the alphabet "
                f"{self.config.alphabet!r} of model {self.id!r}"
            )
        ids = array(TOKEN_ID_TYPE)
        ids.frombytes(text.translate(self.symbol_ids).encode(NATIVE_UTF32))
        return ids


@dataclass
class LoadReport:
    models: dict[str, ServedModel]
    failures: list[str]  # "<path>: <reason>" per folder that did not load


def failed_folder(failure: str, directories: Sequence[Path]) -> str:
    """The folder name a ``LoadReport`` failure ("<path>: <reason>") is about, without the server's paths."""
    for directory in directories:
        if failure.startswith(f"{directory}{os.sep}"):
            path, _, _ = failure.removeprefix(f"{directory}{os.sep}").partition(": ")
            return Path(path).name or path
    path, _, _ = failure.partition(": ")
    return Path(path).name or path


def served_transducer(model_id: str, model: SequenceModel, config: CheckpointConfig, path: Path) -> ServedModel:
    """A transduce model with what requests need to turn its inputs into token ids."""
    assert config.alphabet is not None  # a transducer's config has its alphabet
    served = ServedModel(id=model_id, model=model, config=config, path=path)
    served.symbol_ids = str.maketrans({symbol: chr(index) for index, symbol in enumerate(config.alphabet)})
    served.outside_alphabet = re.compile(f"[^{re.escape(config.alphabet)}]")
    return served


def checkpoint_folders(directory: Path) -> list[Path]:
    """``directory`` itself if it is a checkpoint folder, else its sub-folders (not those named .* or _*)."""
    if (directory / CONFIG_FILE).is_file():
        return [directory]
    return sorted(path for path in directory.iterdir() if path.is_dir() and not path.name.startswith((".", "_")))


def load_models(directories: Path | Sequence[Path], device: str) -> LoadReport:
    """Load every checkpoint folder directly under each of ``directories`` (or the directory itself if it is one). A
    model id already loaded from an earlier folder is a failure, not a replacement."""
    directories = [directories] if isinstance(directories, Path) else list(directories)
    folders, failures = [], []
    for directory in directories:
        if not directory.is_dir():
            failures.append(f"{directory}: not a folder")
            continue
        try:
            found = checkpoint_folders(directory)
        except OSError as error:  # e.g. an unreadable folder: reported like a folder that failed
            failures.append(f"{directory}: {type(error).__name__}: {error}")
            continue
        if not found:
            failures.append(f"{directory}: holds no checkpoint folder")
        folders += found
    logger.info("loading %d models from %s", len(folders), ", ".join(map(str, directories)))
    models: dict[str, ServedModel] = {}
    for folder in folders:
        try:
            if folder.name in models:
                raise CheckpointError(f"model id {folder.name!r} is served already, from {models[folder.name].path}")
            models[folder.name] = load_served_model(folder, device)
            logger.debug("loaded %s from %s", folder.name, folder)
        except Exception as error:  # whatever the reason, this folder is reported and skipped
            expected = isinstance(error, (CheckpointError, TokenizerError))
            failures.append(f"{folder}: {error if expected else f'{type(error).__name__}: {error}'}")
    for failure in failures:
        logger.warning("skipped %s", failure)
    return LoadReport(models, failures)


def load_served_model(folder: Path, device: str) -> ServedModel:
    loaded = load_checkpoint(folder, device=device)
    config = loaded.config
    if config.kind == "transduce":
        return served_transducer(folder.name, loaded.model, config, folder)
    served = ServedModel(id=folder.name, model=loaded.model, config=config, path=folder)
    assert config.tokenizer is not None  # a language model's config names its tokenizer
    served.tokenizer = load_tokenizer(config.tokenizer, folder)
    if config.model.vocab_size < served.tokenizer.vocab_size:
        raise CheckpointError(
            f"{folder}: the model's vocab_size {config.model.vocab_size} is smaller than the "
            f"{served.tokenizer.vocab_size} tokens of tokenizer {config.tokenizer!r}"
        )
    return served
