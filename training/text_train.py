"""The language-model training loop of ``python -m training text-train``.

Next-token cross-entropy on windows of ``length`` tokens (training/text_data.py) from a corpus
(training/text_corpus.py), AdamW with linear warm-up and cosine decay, bfloat16 autocast on CUDA (float32 on
the CPU unless asked), gradient clipping. The budget is ``steps`` optimizer steps or ``time_budget_s`` seconds,
whichever ends first; the learning-rate schedule follows whichever is further along, so a time-limited run
still decays to the end. Under torchrun each process draws its own windows (in-memory corpora: its random
stream is keyed by its rank; OpenWebText2: its own shards) and DistributedDataParallel averages gradients.

The output folder is a ``kind="generate"`` checkpoint: ``config.json``, ``model.safetensors`` and the
tokenizer's ranks file ``tokenizer.tiktoken`` (named ``file:tokenizer.tiktoken`` in the config) when the
tokenizer is one, beside the log ``train.jsonl`` (one JSON object per line, each with an ``event``):

- ``"start"``: ``command``, ``corpus``, ``tokenizer``, ``architecture``, ``model``, ``parameters``,
  ``train_tokens`` (in-memory corpora), ``world_size``, ``device``, ``dtype``;
- ``"train"``: ``step``, ``loss`` (mean next-token cross-entropy since the last record, all processes),
  ``tokens`` (seen so far, all processes), ``tokens_per_s`` (since the last record), ``lr``, ``grad_norm``,
  ``elapsed_s``;
- ``"eval"``: ``step``, ``validation_loss`` and ``validation_perplexity`` over every position of the fixed
  validation windows of the training length;
- ``"end"``: ``step``, ``stopped`` ("steps" or "time"), ``tokens``, ``wall_time_s``, ``tokens_per_s``.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from model.base import SequenceModel
from model.checkpoint import save_checkpoint
from model.config import BaseModelConfig, CheckpointConfig
from model.registry import build_model
from model.tokenizer import FILE_PREFIX, Tokenizer
from training.distributed import Distributed
from training.text_corpus import corpus_documents, is_streamed, split_document
from training.text_data import StreamedWindows, TokenArray, tokenize_documents
from training.train import _open_log, _write  # the JSONL log, shared with the transducer loop

RANKS_FILE = "tokenizer.tiktoken"
TRAIN_STREAM, VALIDATION_STREAM = 0, 1


@dataclass(frozen=True)
class TextTrainSettings:
    corpus: str
    architecture: str
    out: Path
    length: int = 128  # the training context length L_tr
    steps: int = 1000
    time_budget_s: float | None = None
    batch_size: int = 16
    lr: float = 1e-3
    min_lr_fraction: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    validation_fraction: float = 0.1  # the tail of each document held out (in-memory corpora)
    validation_corpus: str | None = None  # for a streamed corpus: where validation windows come from
    validation_windows: int = 64
    eval_every: int = 200
    log_every: int = 10
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    progress: bool = True


def train_text(
    settings: TextTrainSettings, model_config: BaseModelConfig, tokenizer: Tokenizer, ranks_file: Path | None,
    command: str, dist: Distributed,
) -> dict[str, Any]:
    """Train, write the checkpoint folder and log (rank 0); returns the checkpoint's metadata."""
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    model = build_model(settings.architecture, model_config).to(dist.device).train()
    trained = dist.wrap(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=settings.weight_decay,
                                  betas=(0.9, 0.95))
    data, train_tokens = _training_windows(settings, tokenizer, dist)
    validation = _validation_windows(settings, tokenizer)
    rng = np.random.default_rng([settings.seed, TRAIN_STREAM, dist.rank])
    use_bfloat16 = _use_bfloat16(settings.dtype, dist.device)

    out = Path(settings.out)
    log = _open_log(out, dist)
    tokenizer_name = f"{FILE_PREFIX}{RANKS_FILE}" if ranks_file is not None else tokenizer.name
    _write(log, event="start", command=command, corpus=settings.corpus, tokenizer=tokenizer_name,
           architecture=settings.architecture, model=dataclasses.asdict(model_config),
           parameters=sum(p.numel() for p in model.parameters()), train_tokens=train_tokens,
           world_size=dist.world_size, device=str(dist.device), dtype="bfloat16" if use_bfloat16 else "float32")
    tokens_per_step = settings.batch_size * settings.length * dist.world_size
    loss_sum, loss_steps, stopped, step = 0.0, 0, "steps", 0
    window_started, last_eval = time.perf_counter(), None
    bar = tqdm(total=settings.steps, desc=f"text {settings.architecture}", unit="step", dynamic_ncols=True,
               disable=not (dist.is_main and settings.progress))
    for step in range(1, settings.steps + 1):
        lr = settings.lr * _lr_factor(settings, step, time.perf_counter() - started)
        for group in optimizer.param_groups:
            group["lr"] = lr
        windows = data.batch(rng, settings.batch_size, settings.length).to(dist.device)  # (B, L + 1)
        with torch.autocast(dist.device.type, dtype=torch.bfloat16, enabled=use_bfloat16):
            logits = trained(windows[:, :-1])  # (B, L, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), windows[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(trained.parameters(), settings.grad_clip or math.inf))
        optimizer.step()
        loss_sum, loss_steps = loss_sum + float(loss.detach()), loss_steps + 1
        bar.update(1)
        out_of_time = settings.time_budget_s is not None and time.perf_counter() - started >= settings.time_budget_s
        last = step == settings.steps or out_of_time
        if step % settings.log_every == 0 or last:
            total, count = dist.sum([loss_sum, float(loss_steps)])
            now = time.perf_counter()
            speed = count / dist.world_size * tokens_per_step / (now - window_started)
            _write(log, event="train", step=step, loss=total / count, tokens=step * tokens_per_step,
                   tokens_per_s=speed, lr=lr, grad_norm=grad_norm, elapsed_s=now - started)
            bar.set_postfix(loss=f"{total / count:.3f}", tok_s=f"{speed:,.0f}",
                            val_ppl="-" if last_eval is None else f"{math.exp(last_eval):.1f}")
            loss_sum, loss_steps, window_started = 0.0, 0, now
        if settings.eval_every and (step % settings.eval_every == 0 or last):
            last_eval = _validation_loss(model, validation, use_bfloat16, dist)
            _write(log, event="eval", step=step, validation_loss=last_eval,
                   validation_perplexity=math.exp(last_eval))
            if dist.is_main:  # kept on disk as it goes, in case the run is cut short
                _save(model, model_config, settings, tokenizer_name, ranks_file, out,
                      _metadata(settings, command, dist, step, None, time.perf_counter() - started, last_eval))
        if out_of_time:
            stopped = "time"
            break
    bar.close()

    wall = time.perf_counter() - started
    metadata = _metadata(settings, command, dist, step, stopped, wall, last_eval)
    if dist.is_main:
        _save(model, model_config, settings, tokenizer_name, ranks_file, out, metadata)
        _write(log, event="end", step=step, stopped=stopped, tokens=step * tokens_per_step, wall_time_s=wall,
               tokens_per_s=step * tokens_per_step / wall)
        log.close()
    return metadata


def _training_windows(
    settings: TextTrainSettings, tokenizer: Tokenizer, dist: Distributed
) -> tuple[TokenArray | StreamedWindows, int | None]:
    """The training windows of this process and, for an in-memory corpus, its token count."""
    if is_streamed(settings.corpus):
        return StreamedWindows(lambda: corpus_documents(settings.corpus, dist.rank, dist.world_size), tokenizer), None
    texts = [split_document(document.text, settings.validation_fraction, "train")
             for document in corpus_documents(settings.corpus)]
    tokens = tokenize_documents(texts, tokenizer)
    return TokenArray(tokens), len(tokens)


def validation_tokens(corpus: str, validation_fraction: float, tokenizer: Tokenizer) -> list[np.ndarray]:
    """The held-out tokens, one array per document: the tails of an in-memory corpus's documents, or the
    whole documents of a streamed one (then give a held-out shard)."""
    documents = corpus_documents(corpus)
    if is_streamed(corpus):
        texts = [document.text for document in documents]
    else:
        texts = [split_document(document.text, validation_fraction, "validation") for document in documents]
    return [tokenize_documents([text], tokenizer) for text in texts if text]


def _validation_windows(settings: TextTrainSettings, tokenizer: Tokenizer) -> torch.Tensor | None:
    """Fixed (N, length + 1) validation windows (the same on every process), or None without evaluation."""
    if not settings.eval_every:
        return None
    corpus = settings.validation_corpus or settings.corpus
    if is_streamed(corpus) and settings.validation_corpus is None:
        return None  # a streamed training corpus has no held-out tail: give --validation-corpus
    tokens = np.concatenate(validation_tokens(corpus, settings.validation_fraction, tokenizer))
    rng = np.random.default_rng([settings.seed, VALIDATION_STREAM])
    return TokenArray(tokens).batch(rng, settings.validation_windows, settings.length)


@torch.no_grad()
def _validation_loss(
    model: SequenceModel, windows: torch.Tensor | None, use_bfloat16: bool, dist: Distributed, batch_size: int = 16
) -> float | None:
    if windows is None:
        return None
    model.eval()
    total = 0.0
    for start in range(0, len(windows), batch_size):
        chunk = windows[start:start + batch_size].to(dist.device)  # (b, L + 1)
        with torch.autocast(dist.device.type, dtype=torch.bfloat16, enabled=use_bfloat16):
            logits = model(chunk[:, :-1])  # (b, L, V)
        total += float(F.cross_entropy(logits.float().flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"))
    model.train()
    return total / windows[:, 1:].numel()


def _lr_factor(settings: TextTrainSettings, step: int, elapsed: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_fraction`` over the budget."""
    if step <= settings.warmup_steps:
        return step / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    if settings.time_budget_s is not None:
        progress = max(progress, elapsed / settings.time_budget_s)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return settings.min_lr_fraction + (1.0 - settings.min_lr_fraction) * cosine


def _use_bfloat16(dtype: str, device: torch.device) -> bool:
    return dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda")


def _save(
    model: SequenceModel, model_config: BaseModelConfig, settings: TextTrainSettings, tokenizer_name: str,
    ranks_file: Path | None, out: Path, metadata: dict[str, Any],
) -> None:
    if ranks_file is not None and ranks_file.resolve() != (out / RANKS_FILE).resolve():
        shutil.copyfile(ranks_file, out / RANKS_FILE)
    config = CheckpointConfig(architecture=settings.architecture, model=model_config, kind="generate",
                              tokenizer=tokenizer_name, metadata=metadata)
    save_checkpoint(model, config, out)


def _metadata(
    settings: TextTrainSettings, command: str, dist: Distributed, steps: int, stopped: str | None, wall: float,
    validation_loss: float | None,
) -> dict[str, Any]:
    """The checkpoint's provenance; ``stopped`` is None in the copies saved while training goes on."""
    tokens = steps * settings.batch_size * settings.length * dist.world_size
    return {
        "command": command,
        "steps": steps,
        "stopped": stopped,
        "tokens": tokens,
        "wall_time_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "train_length": settings.length,
        "validation_loss": validation_loss,
        "world_size": dist.world_size,
        "device": dist.device.type,
        "torch": torch.__version__,
        "settings": {key: str(value) if isinstance(value, Path) else value
                     for key, value in dataclasses.asdict(settings).items() if key != "out"},
    }
