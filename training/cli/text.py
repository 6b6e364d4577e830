"""The language-model subcommands of ``python -m training``: ``bpe``, ``text-train`` and ``text-eval``: argument
parsing and validation. Bad input exits with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from model.base import SequenceModel
from model.checkpoint import LoadedCheckpoint, load_checkpoint
from model.config import ARCHITECTURE_CONFIGS, BaseModelConfig, RegularGPTConfig
from training.cli.arguments import (
    UsageError,
    add_threads,
    fractions,
    multiples,
    non_negative_int,
    positive_float,
    positive_int,
    probability,
    token_counts,
)
from training.cli.model_flags import CONFIG_FIELDS, TRAINABLE_ARCHITECTURES, given_model_flags
from training.cli.train import (
    NewRun,
    add_training_flags,
    check_new_run,
    launch,
    require_new_run_flags,
    resuming,
    settings_from_args,
)
from training.data.corpus import DEFAULT_CORPUS
from training.data.mqar import HELD_OUT, HELD_OUT_MODULUS, MAX_PAIRS, MAX_VALUE_TOKENS, row_ids, shortest_row, split_ids
from training.data.passkey import DISTRACTOR_PLACES, PassKeyBuilder
from training.data.retrieval import MAX_NEEDLES, SPLITS
from training.evaluation.passkey_probe import (
    FILLER_KINDS,
    GRASS_FILLER,
    PassKeyProbe,
    filler_tokens,
    format_passkey_table,
    is_filler_name,
    probe_checkpoint,
)
from training.evaluation.retrieval_probe import ASK_MODES

if TYPE_CHECKING:
    import numpy as np

    from model.tokenizer import Tokenizer

Runner = Callable[[argparse.Namespace, list[str]], int]


TEXT_COMMANDS = {  # name: one-line summary
    "bpe": "train a byte-level BPE and write a .tiktoken ranks file",
    "text-train": "train a language model on text and write a checkpoint folder",
    "text-eval": "last-token perplexity of language models against context length, or the pass-key probe",
}


def add_text_commands(command: Callable[[str], argparse.ArgumentParser]) -> None:
    """Fill in the parsers of ``bpe``, ``text-train`` and ``text-eval``; ``command(name)``: a new subcommand's parser
    of ``python -m training``."""
    _add_bpe_parser(command("bpe"))
    _add_train_parser(command("text-train"))
    _add_eval_parser(command("text-eval"))


def _guarded(run: Runner) -> Runner:
    """``run`` with its expected failures (ValueErrors: a corpus, tokenizer, checkpoint, config or device that does
    not fit) turned into a UsageError (one line on stderr, status 2)."""

    def guarded(args: argparse.Namespace, argv: list[str]) -> int:
        try:
            return run(args, argv)
        except ValueError as error:
            raise UsageError(str(error)) from None

    return guarded


# ---------------------------------------------------------------- bpe


def _add_bpe_parser(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=_guarded(_run_bpe))
    parser.add_argument("--corpus", default=DEFAULT_CORPUS, help="austen (default), text:PATH or owt2:PATH")
    parser.add_argument(
        "--ranks",
        type=positive_int,
        default=8191,
        help="tokens in the file, the 256 bytes included (<|endoftext|> comes on top)",
    )
    parser.add_argument(
        "--validation-fraction",
        type=float,
        default=0.1,
        help="tail of each document left out (in-memory corpora), as text-train holds it out",
    )
    parser.add_argument("--max-chars", type=positive_int, help="read at most this many characters")
    parser.add_argument("--out", required=True, type=Path, help="the .tiktoken file to write")
    add_threads(parser)


def _run_bpe(args: argparse.Namespace, argv: list[str]) -> int:
    from model.tokenizer import load_tokenizer
    from training.data.bpe import count_pieces, train_bpe, write_ranks
    from training.data.corpus import corpus_documents, is_streamed, split_document

    def texts() -> Iterator[str]:
        budget = args.max_chars or float("inf")
        for document in corpus_documents(args.corpus):
            text = (
                document.text
                if is_streamed(args.corpus)
                else split_document(document.text, args.validation_fraction, "train")
            )
            yield text[: int(min(len(text), budget))]
            budget -= len(text)
            if budget <= 0:
                return

    counts = count_pieces(texts())
    tokens = train_bpe(counts, args.ranks)
    write_ranks(tokens, args.out)
    tokenizer = load_tokenizer(f"file:{args.out.name}", args.out.parent)
    sample = "".join(texts())[:200_000]
    if tokenizer.decode(tokenizer.encode(sample)) != sample:
        raise ValueError(f"{args.out}: the ranks do not round-trip the corpus")
    bytes_per_token = len(sample.encode()) / max(1, len(tokenizer.encode(sample)))
    print(
        f"wrote {args.out}: {len(tokens)} ranks from {len(counts)} distinct pieces; "
        f"{bytes_per_token:.2f} bytes per token on the corpus"
    )
    return 0


# ---------------------------------------------------------------- text-train


RECURRENT_ARCHITECTURES = ("lrnn", "diagonal_lrnn", "lstm")  # a fixed-size state: what --state-passing carries

TEXT_DEFAULTS = {
    "batch_size": 16,
    "lr": 1e-3,
    "optimizer": "adamw",
    "beta2": 0.95,
    "weight_decay": 0.1,
    "schedule": "cosine",
    "warmup_steps": 100,
    "min_lr_fraction": 0.1,
    "eval_every": 200,
    "dtype": "auto",
}


def _add_train_parser(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=_guarded(_run_train))
    what = parser.add_argument_group("what to train")
    what.add_argument("--arch", help=f"architecture: {', '.join(TRAINABLE_ARCHITECTURES)}")
    what.add_argument("--corpus", default=DEFAULT_CORPUS, help="austen (default), text:PATH or owt2:PATH")
    what.add_argument(
        "--tokenizer", help="a .tiktoken ranks file (copied into the checkpoint), 'bytes', or an offline tiktoken name"
    )
    what.add_argument("--length", type=positive_int, default=128, help="training context length L_tr")
    what.add_argument(
        "--passkey-fraction",
        type=probability,
        default=0.0,
        help="each training row ends, with this probability, in a pass-key prompt (filler: the "
        "training text) scored on its needle and answer only (training/objectives/language_model.py)",
    )
    what.add_argument(
        "--passkey-fraction-final",
        type=probability,
        help="the pass-key fraction at the last step (--steps), moving linearly from --passkey-fraction: "
        "mix text in gradually into a model that learned the key from pass-key rows",
    )
    what.add_argument(
        "--passkey-distractors",
        type=non_negative_int,
        default=2,
        help="a pass-key example's filler holds 0 to this many other numbers (default 2)",
    )
    what.add_argument(
        "--passkey-number-forms",
        action="store_true",
        help="the distractor numbers take the forms numbers have in prose ('CHAPTER 31', 'in 1797-98', "
        "'No. 97', '20,000', '£45'), not only ' 4521'",
    )
    what.add_argument(
        "--recall-fraction",
        type=probability,
        default=0.0,
        help="each training row ends, with this probability, in a retrieval example of the trained split "
        "(training/data/retrieval.py: composed wordings, numbers, codes and words, several needles, "
        "several questions), scored on its answers only",
    )
    what.add_argument(
        "--recall-needles",
        type=positive_int,
        default=4,
        help=f"a retrieval example hides 1 to this many needles (at most {MAX_NEEDLES}; default 4)",
    )
    what.add_argument(
        "--recall-varied",
        type=probability,
        default=0.5,
        help="the chance that a retrieval example takes its keys and its subject's words from the corpus's words "
        "instead of the trained lists, held-out words excluded, its value then also a phrase of such words or a run "
        "of letters and digits (default 0.5)",
    )
    what.add_argument(
        "--mqar-fraction",
        type=probability,
        default=0.0,
        help="each training row is, with this probability, multi-query associative recall "
        "(training/data/mqar.py): key-value pairs, text, every key again followed by its value; keys and values "
        f"never from the held-out ids (those divisible by {HELD_OUT_MODULUS}), which evaluation reports apart",
    )
    what.add_argument(
        "--mqar-pairs",
        type=positive_int,
        default=4,
        help=f"an MQAR row holds 1 to this many pairs, all asked (at most {MAX_PAIRS}; default 4)",
    )
    what.add_argument(
        "--mqar-value-tokens",
        type=positive_int,
        default=1,
        help=f"each MQAR value is a run of this many tokens, all scored (at most {MAX_VALUE_TOKENS}; default 1)",
    )
    what.add_argument(
        "--example-weight",
        type=positive_float,
        default=1.0,
        help="the loss weight of a row holding a whole pass-key or retrieval example, which scores only its "
        "answer (and needle): above 1, so that a few answer tokens beside rows of text share the gradient "
        "(default 1)",
    )
    what.add_argument(
        "--state-passing",
        action="store_true",
        help="recurrent models: each row reads consecutive windows, starting from the state its last "
        "one ended in (the gradient cut between steps)",
    )
    what.add_argument(
        "--passkey-span",
        type=positive_int,
        default=1,
        metavar="WINDOWS",
        help="with --state-passing: a pass-key example stretches over 1 to this many consecutive "
        "windows of its row (log-uniform up to a longest span growing from 1 to this over --steps; "
        "default 1: within one window), the needle in the first, the question in the last",
    )
    what.add_argument(
        "--recall-span",
        type=positive_int,
        default=1,
        metavar="WINDOWS",
        help="with --state-passing: a retrieval example stretches over 1 to this many consecutive windows of its "
        "row, as --passkey-span's do: its needles at the end of the first window's text, its question and answer "
        "at the end of the last (default 1: within one window)",
    )
    what.add_argument(
        "--state-reset",
        type=probability,
        default=0.0,
        metavar="P",
        help="with --state-passing: each row starts each step, with this chance, from the model's "
        "initial state instead of the one it carries (its text reads on); default 0",
    )
    what.add_argument(
        "--passkey-fresh",
        action="store_true",
        help="with --state-passing: a row given a pass-key or retrieval example starts it from the model's "
        "initial state, while text rows carry theirs (no example begins in a state holding an earlier key)",
    )
    what.add_argument(
        "--teacher",
        type=Path,
        metavar="DIR",
        help="a trained language model (same tokenizer) whose next-token distributions the text rows "
        "learn beside their next tokens (knowledge distillation; with --state-passing it carries "
        "its states too); pass-key rows learn their targets alone",
    )
    what.add_argument(
        "--teacher-weight",
        type=probability,
        metavar="W",
        help="with --teacher: a text row's loss is (1 - W) times its next token's cross-entropy plus W "
        "times the teacher's (default 0.5); the logged loss is the next token's",
    )
    checks = parser.add_argument_group("validation")
    checks.add_argument("--validation-fraction", type=probability, default=0.1, help="held-out tail of each document")
    checks.add_argument("--validation-corpus", help="for owt2 training: a held-out corpus spec, e.g. owt2:val/")
    checks.add_argument("--validation-windows", type=positive_int, default=64, help="fixed validation windows")
    add_training_flags(parser, TEXT_DEFAULTS)


def language_model_config(architecture: str, vocab_size: int, flags: dict[str, Any]) -> BaseModelConfig:
    """A language model's config (tied head, ``num_labels = 0``) from the architecture flags given."""
    if architecture not in TRAINABLE_ARCHITECTURES:
        known = "is built by hand, not trained" if architecture in ARCHITECTURE_CONFIGS else "is unknown"
        raise ValueError(f"architecture {architecture!r} {known}; trainable: {', '.join(TRAINABLE_ARCHITECTURES)}")
    fields = CONFIG_FIELDS[architecture]
    foreign = sorted(set(flags) - set(fields))
    if foreign:
        raise ValueError(f"{', '.join('--' + d.replace('_', '-') for d in foreign)} does not apply to {architecture}")
    values = {fields[dest]: value for dest, value in flags.items()}
    return ARCHITECTURE_CONFIGS[architecture](vocab_size=vocab_size, num_labels=0, **values)


def training_tokenizer(spec: str) -> tuple[Tokenizer, Path | None]:
    """The tokenizer named on the command line, and its ranks file when it is one."""
    from model.tokenizer import load_tokenizer

    if spec.endswith(".tiktoken"):
        path = Path(spec)
        return load_tokenizer(f"file:{path.name}", path.parent), path
    return load_tokenizer(spec, "."), None


def _run_train(args: argparse.Namespace, argv: list[str]) -> int:
    metadata = launch(args, argv, None if resuming(args) else _new_text_run(args))
    if metadata["world_size"] == 1 or int(os.environ.get("RANK", "0")) == 0:
        loss = metadata.get("validation_loss")
        summary = "no validation" if loss is None else f"validation perplexity {math.exp(loss):.2f}"
        print(
            f"wrote {args.out}: {metadata['steps']} steps, {metadata['tokens']:,} tokens in "
            f"{metadata['wall_time_s']:.0f} s ({metadata['tokens_per_s']:,.0f} tokens/s; stopped: "
            f"{metadata['stopped']}), {summary}"
        )
    return 0


def _new_text_run(args: argparse.Namespace) -> NewRun:
    """The settings, model config and objective of a new ``text-train`` run, all input checked."""
    from training.objectives.language_model import (
        LanguageModelObjective,
        TextData,
        check_passkey_length,
        check_recall_length,
        checkpoint_tokenizer_name,
    )

    require_new_run_flags(args, "--arch", "--tokenizer")
    check_new_run(args)
    tokenizer, ranks_file = training_tokenizer(args.tokenizer)
    config = language_model_config(args.arch, tokenizer.vocab_size, given_model_flags(args))
    if args.passkey_fraction_final is not None and not args.passkey_fraction:
        raise UsageError("--passkey-fraction-final needs --passkey-fraction (the fraction at the first step)")
    if args.passkey_fraction:  # before the corpus is read
        check_passkey_length(tokenizer, args.length)
    if args.state_passing and args.arch not in RECURRENT_ARCHITECTURES:
        raise UsageError(
            f"--state-passing needs a recurrent model ({', '.join(RECURRENT_ARCHITECTURES)}); "
            f"{args.arch}'s cache grows with the context"
        )
    if args.passkey_span > 1 and not (args.state_passing and args.passkey_fraction):
        raise UsageError(
            "--passkey-span needs --state-passing and --passkey-fraction (an example across windows "
            "is read from carried states)"
        )
    if args.state_reset and not args.state_passing:
        raise UsageError("--state-reset needs --state-passing (it resets carried states)")
    if args.recall_span > 1 and not (args.state_passing and args.recall_fraction):
        raise UsageError(
            "--recall-span needs --state-passing and --recall-fraction (an example across windows "
            "is read from carried states)"
        )
    for name, span in (("--passkey-span", args.passkey_span), ("--recall-span", args.recall_span)):
        if args.state_reset and span > 1:
            raise UsageError(
                f"--state-reset with {name} over 1 would cut examples across windows in their middle "
                "(a reset row forgets its needles): use one of them"
            )
    if args.passkey_fresh and not (
        args.state_passing and (args.passkey_fraction or args.recall_fraction or args.mqar_fraction)
    ):
        raise UsageError(
            "--passkey-fresh needs --state-passing and --passkey-fraction, --recall-fraction or --mqar-fraction (it starts "
            "example rows from the initial state instead of their carried one)"
        )
    if args.recall_needles > MAX_NEEDLES:
        raise UsageError(f"--recall-needles {args.recall_needles}: an example holds at most {MAX_NEEDLES} needles")
    if args.recall_fraction:
        check_recall_length(tokenizer, args.length)
    if args.mqar_pairs > MAX_PAIRS:
        raise UsageError(f"--mqar-pairs {args.mqar_pairs}: an MQAR row holds at most {MAX_PAIRS} pairs")
    if args.mqar_value_tokens > MAX_VALUE_TOKENS:
        raise UsageError(
            f"--mqar-value-tokens {args.mqar_value_tokens}: an MQAR value is at most {MAX_VALUE_TOKENS} tokens"
        )
    shortest = shortest_row(args.mqar_pairs, args.mqar_value_tokens)
    if args.mqar_fraction and args.length + 1 < shortest:
        raise UsageError(
            f"--mqar-pairs {args.mqar_pairs} and --mqar-value-tokens {args.mqar_value_tokens} need windows of at "
            f"least {shortest - 1} tokens (--length {args.length})"
        )
    distinct = row_ids(args.mqar_pairs, args.mqar_value_tokens)
    if args.mqar_fraction and (held_out := len(split_ids(tokenizer, HELD_OUT))) < distinct:
        raise UsageError(
            f"--mqar-pairs {args.mqar_pairs} and --mqar-value-tokens {args.mqar_value_tokens} need {distinct} distinct "
            f"token ids a row, and the tokenizer's held-out split has {held_out}"
        )
    if args.example_weight != 1.0 and not (args.passkey_fraction or args.recall_fraction or args.mqar_fraction):
        raise UsageError(
            "--example-weight needs --passkey-fraction, --recall-fraction or --mqar-fraction (the rows it weighs)"
        )
    if args.teacher_weight is not None and args.teacher is None:
        raise UsageError("--teacher-weight needs --teacher (the model whose distributions are learned)")
    teacher_weight = 0.0 if args.teacher is None else 0.5 if args.teacher_weight is None else args.teacher_weight
    if args.teacher is not None and teacher_weight == 0.0:
        raise UsageError("--teacher-weight 0 would learn nothing from --teacher: give a weight in (0, 1]")
    settings = settings_from_args(args, args.arch)
    data = TextData(
        corpus=args.corpus,
        tokenizer=checkpoint_tokenizer_name(ranks_file, tokenizer.name),
        length=args.length,
        validation_fraction=args.validation_fraction,
        validation_corpus=args.validation_corpus,
        validation_windows=args.validation_windows,
        passkey_fraction=args.passkey_fraction,
        passkey_fraction_final=args.passkey_fraction_final,
        passkey_distractors=args.passkey_distractors,
        passkey_number_forms=args.passkey_number_forms,
        state_passing=args.state_passing,
        passkey_span=args.passkey_span,
        recall_span=args.recall_span,
        state_reset=args.state_reset,
        passkey_fresh=args.passkey_fresh,
        recall_fraction=args.recall_fraction,
        recall_needles=args.recall_needles,
        recall_varied=args.recall_varied if args.recall_fraction else 0.0,
        mqar_fraction=args.mqar_fraction,
        mqar_pairs=args.mqar_pairs,
        mqar_value_tokens=args.mqar_value_tokens,
        example_weight=args.example_weight,
        teacher=None if args.teacher is None else str(args.teacher),
        teacher_weight=teacher_weight,
    )
    return (
        settings,
        config,
        lambda settings, dist: LanguageModelObjective(
            data,
            tokenizer,
            ranks_file,
            settings.steps,
            settings.batch_size,
            settings.seed,
            settings.eval_every > 0,
            dist,
        ),
    )


# ---------------------------------------------------------------- text-eval


def _with_attention_impl(model: SequenceModel, attention_impl: Literal["auto", "reference", "fast"]) -> SequenceModel:
    """The same RegularGPT weights in a model built with another ``attention_impl``."""
    from model.registry import build_model

    assert isinstance(model.config, RegularGPTConfig)  # a "regulargpt" checkpoint's model
    config = dataclasses.replace(model.config, attention_impl=attention_impl)
    rebuilt = build_model("regulargpt", config).to(device=model.device, dtype=model.dtype)
    rebuilt.load_state_dict(model.state_dict())
    return rebuilt.eval()


REPORT_FILE, PERPLEXITY_PLOT, RECEPTIVE_PLOT = "eval.json", "perplexity.png", "receptive_field.png"  # in --out
PASSKEY_REPORT, PASSKEY_PLOT = "passkey.json", "passkey.png"  # in --out, with --probe passkey
RETRIEVAL_REPORT, RETRIEVAL_PLOT = "retrieval.json", "retrieval.png"  # in --out, with --probe retrieval
MAX_PROBE_TOKENS = 2**24  # the largest prompt a probe builds
# probe: {flag's dest: its default}; a flag of one probe is refused with the other
PROBE_DEFAULTS: dict[str, dict[str, Any]] = {
    "perplexity": {
        "corpus": None,
        "train_length": None,
        "multiples": (1, 2, 4, 8, 16),
        "targets": 256,
        "batch_size": 8,
        "receptive_field": 0,
        "receptive_multiple": 4.0,
    },
    "passkey": {
        "sizes": (2**10, 2**13, 2**16, 2**20),
        "depths": (0.0, 0.25, 0.5, 0.75, 1.0),
        "filler": [[DEFAULT_CORPUS, GRASS_FILLER]],
        "trials": 2,
        "seed": 0,
        "max_new_tokens": 8,
        "batch_size": 16,
        "max_memory": 4.0,
        "distractors": 0,
        "distractors_at": "either",
        "number_forms": False,
    },
    "retrieval": {
        "sizes": (2**10, 2**13, 2**15),
        "depths": (0.0, 0.25, 0.5, 0.75, 1.0),
        "filler": [[DEFAULT_CORPUS, GRASS_FILLER]],
        "trials": 4,
        "seed": 0,
        "max_new_tokens": 16,
        "batch_size": 16,
        "max_memory": 4.0,
        "split": "both",
        "formats": None,
        "needles": 1,
        "ask": "one",
        "wordings": None,
    },
}


def filler_names(text: str) -> list[str]:
    """ "austen,grass": filler names (a corpus spec or ``grass``)."""
    names = text.split(",")
    unknown = [name for name in names if not is_filler_name(name)]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown filler {unknown[0]!r}: use {FILLER_KINDS}")
    return names


def _add_eval_parser(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(run=_guarded(_run_eval))
    parser.add_argument("--checkpoint", required=True, action="append", type=Path, help="repeat to compare")
    parser.add_argument(
        "--probe",
        choices=tuple(PROBE_DEFAULTS),
        default="perplexity",
        help="perplexity (default): last-token perplexity against context length; passkey: "
        "pass-key retrieval by prompt size and key depth; retrieval: values of several formats hidden and asked "
        "in generated wordings, a trained and a held-out split",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, help="rows per forward pass (default: perplexity 8, passkey 16)"
    )
    perplexity = parser.add_argument_group("--probe perplexity")
    perplexity.add_argument(
        "--corpus", help="held-out text (default: the corpus each checkpoint was trained on, its validation tails)"
    )
    perplexity.add_argument(
        "--train-length", type=positive_int, help="L_tr (default: the checkpoint's metadata.train_length)"
    )
    perplexity.add_argument(
        "--multiples", type=multiples, help="context lengths as multiples of L_tr (default 1,2,4,8,16)"
    )
    perplexity.add_argument("--targets", type=positive_int, help="target tokens, the same at every length (256)")
    perplexity.add_argument(
        "--receptive-field",
        type=int,
        metavar="N",
        help="also the cumulative gradient-norm curve over N windows (default 0: skip)",
    )
    perplexity.add_argument(
        "--receptive-multiple",
        type=positive_float,
        help="length of the receptive-field windows in multiples of L_tr (default 4)",
    )
    passkey = parser.add_argument_group(
        "--probe passkey and --probe retrieval (training/evaluation/passkey_probe.py, retrieval_probe.py)"
    )
    passkey.add_argument(
        "--sizes", type=token_counts, help="prompt sizes in tokens, k = 1024, M = 1048576 (default 1k,8k,64k,1M)"
    )
    passkey.add_argument(
        "--depths",
        type=fractions,
        help="where the key sits in the filler, 0: first, 1: last (default 0,0.25,0.5,0.75,1)",
    )
    passkey.add_argument(
        "--filler",
        type=filler_names,
        action="append",
        help="repeat or comma-separate: austen (its held-out tails), grass (the classic "
        "'The grass is green. ...'), text:PATH or owt2:PATH (default austen,grass)",
    )
    passkey.add_argument(
        "--trials", type=positive_int, help="keys per size, depth and filler (default: passkey 2, retrieval 4)"
    )
    passkey.add_argument("--seed", type=int, help="draws the keys and filler offsets (default 0)")
    passkey.add_argument(
        "--max-new-tokens", type=positive_int, help="greedy tokens decoded (default: passkey 8, retrieval 16)"
    )
    passkey.add_argument(
        "--distractors",
        type=non_negative_int,
        metavar="N",
        help="other numbers (never the key) put in each prompt's filler, on either side of the needle (default 0)",
    )
    passkey.add_argument(
        "--distractors-at",
        choices=DISTRACTOR_PLACES,
        help="with --distractors: on either side of the needle (default), or all before or all after "
        "it (a model that answers the last number it read fails every prompt of 'after')",
    )
    passkey.add_argument(
        "--number-forms",
        action="store_const",
        const=True,
        help="with --distractors: the numbers take the forms numbers have in prose ('CHAPTER 31', "
        "'in 1797-98', 'No. 97', ...), as text-train's --passkey-number-forms",
    )
    passkey.add_argument(
        "--max-memory",
        type=positive_float,
        metavar="GIB",
        help="for a batch's caches and one prefill call's peak, as the model estimates them; "
        "a size at which one row does not fit is skipped (default 4)",
    )
    retrieval = parser.add_argument_group("--probe retrieval (training/data/retrieval.py)")
    retrieval.add_argument(
        "--split",
        choices=(*SPLITS, "both"),
        help="the wordings and value formats training draws from (trained), those it never sees (held-out), or "
        "both, reported apart (default both)",
    )
    retrieval.add_argument(
        "--formats",
        help="value formats, comma-separated: number, code, word (a family: all of its formats in the split) or "
        "number-N (default: all of the split's)",
    )
    retrieval.add_argument(
        "--needles",
        type=positive_int,
        help=f"needles per prompt, each with a key and value of its own (at most {MAX_NEEDLES}; default 1)",
    )
    retrieval.add_argument(
        "--ask",
        choices=ASK_MODES,
        help="with --needles: ask for the needle at --depths (one, default), or for each needle in turn (each)",
    )
    retrieval.add_argument(
        "--wordings",
        type=Path,
        metavar="FILE",
        help='JSON list of {"needle": "... {value} ...", "question": "...", "introduction": "..."} ({key} in '
        "both or neither) used instead of the composed wordings",
    )
    parser.add_argument("--device", default="cpu", help="auto, cpu, cuda or cuda:N")
    parser.add_argument(
        "--out",
        type=Path,
        help=f"folder for {REPORT_FILE} ({PASSKEY_REPORT} with --probe passkey: the reports, a "
        "list) and the plots (default: runs/text-eval/<checkpoint names joined by '+'>)",
    )
    parser.add_argument(
        "--plots",
        action="store_true",
        help=f"also write {PERPLEXITY_PLOT} and, with --receptive-field, {RECEPTIVE_PLOT} "
        f"({PASSKEY_PLOT} with --probe passkey; matplotlib: the plots extra)",
    )
    parser.add_argument(
        "--attention-impl",
        choices=("auto", "reference", "fast"),
        help="RegularGPT: evaluate through this attention implementation instead of the "
        "checkpoint's (exact either way; reference is O(T^2), fast O(T*C))",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a tqdm progress bar on stderr, at a terminal (tokens run)",
    )
    add_threads(parser)


def _run_eval(args: argparse.Namespace, argv: list[str]) -> int:
    _fill_probe_defaults(args)
    checkpoints = [_text_checkpoint(path, args) for path in args.checkpoint]
    out = args.out or Path("runs", "text-eval", "+".join(path.resolve().name for path in args.checkpoint))
    run = {"passkey": _run_passkey, "retrieval": _run_retrieval}.get(args.probe, _run_perplexity)
    written = run(args, checkpoints, out)
    print(f"wrote {', '.join(map(str, written))}", file=sys.stderr)
    return 0


def _fill_probe_defaults(args: argparse.Namespace) -> None:
    """Refuse the flags of the probe not run; give those of the probe run that were not given their defaults."""
    own = PROBE_DEFAULTS[args.probe]
    foreign = [
        dest
        for probe, defaults in PROBE_DEFAULTS.items()
        if probe != args.probe
        for dest in defaults
        if dest not in own and getattr(args, dest) is not None
    ]
    if foreign:
        flags = ", ".join("--" + dest.replace("_", "-") for dest in foreign)
        raise UsageError(f"{flags} {'does' if len(foreign) == 1 else 'do'} not apply to --probe {args.probe}")
    for dest, default in own.items():
        if getattr(args, dest) is None:
            setattr(args, dest, default)
    if "sizes" in own and args.sizes[-1] > MAX_PROBE_TOKENS:
        raise UsageError(f"--sizes {args.sizes[-1]}: a probe's prompts have at most {MAX_PROBE_TOKENS} tokens (16M)")


def _text_checkpoint(path: Path, args: argparse.Namespace) -> tuple[LoadedCheckpoint, Tokenizer]:
    """A language model checkpoint (with ``--attention-impl``) and its tokenizer; a transducer is refused."""
    from model.tokenizer import BYTES_TOKENIZER, load_tokenizer

    loaded = load_checkpoint(path, device=args.device)
    if loaded.config.kind != "generate":
        raise ValueError(f"{path} is a transducer (kind {loaded.config.kind!r}); text-eval measures text models")
    if args.attention_impl and loaded.config.architecture == "regulargpt":
        loaded.model = _with_attention_impl(loaded.model, args.attention_impl)
    return loaded, load_tokenizer(loaded.config.tokenizer or BYTES_TOKENIZER, path)


def _validation_fraction(loaded: LoadedCheckpoint) -> float:
    fraction: float = loaded.config.metadata.get("settings", {}).get("validation_fraction", 0.1)  # JSON metadata
    return fraction


def _run_perplexity(
    args: argparse.Namespace, checkpoints: list[tuple[LoadedCheckpoint, Tokenizer]], out: Path
) -> list[Path]:
    from training.evaluation.text_eval import evaluate_text_checkpoint, format_text_table
    from training.objectives.language_model import validation_tokens

    reports = []
    for loaded, tokenizer in checkpoints:
        corpus = args.corpus or loaded.config.metadata.get("settings", {}).get("corpus", DEFAULT_CORPUS)
        train_length = args.train_length or loaded.config.metadata.get("train_length")
        if train_length is None:
            raise ValueError(f"{loaded.path}: no train_length in its metadata; give --train-length")
        documents = validation_tokens(corpus, _validation_fraction(loaded), tokenizer)
        reports.append(
            evaluate_text_checkpoint(
                loaded,
                documents,
                corpus,
                train_length,
                args.multiples,
                args.targets,
                args.batch_size,
                args.receptive_field,
                args.receptive_multiple,
                progress=args.progress,
            )
        )
        print(
            f"{loaded.path}: "
            + ", ".join(f"{row['length']}: {row['perplexity']:.2f}" for row in reports[-1]["perplexity"]),
            file=sys.stderr,
        )
    print(format_text_table(reports))
    plots = []
    if args.plots:
        from training.evaluation.text_plots import plot_perplexity, plot_receptive_field

        plots.append((PERPLEXITY_PLOT, plot_perplexity))
        if args.receptive_field:
            plots.append((RECEPTIVE_PLOT, plot_receptive_field))
    return _write_reports(out, REPORT_FILE, reports, plots)


def _run_passkey(
    args: argparse.Namespace, checkpoints: list[tuple[LoadedCheckpoint, Tokenizer]], out: Path
) -> list[Path]:
    probe = PassKeyProbe(
        sizes=args.sizes,
        depths=args.depths,
        fillers=tuple(dict.fromkeys(name for names in args.filler for name in names)),
        trials=args.trials,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        max_memory=int(args.max_memory * 2**30),
        distractors=args.distractors,
        distractors_at=args.distractors_at,
        number_forms=args.number_forms,
    )
    if not probe.distractors and (probe.distractors_at != "either" or probe.number_forms):
        raise UsageError(
            "--distractors-at and --number-forms place or shape the --distractors numbers: give --distractors N (N > 0)"
        )
    fillers = []  # every checkpoint's filler token streams, all read (and the sizes checked) before any runs
    for loaded, tokenizer in checkpoints:
        streams = _filler_streams(probe.fillers, loaded, tokenizer)
        shortest = PassKeyBuilder(tokenizer, streams[probe.fillers[0]]).shortest()
        if probe.sizes[0] < shortest:
            raise UsageError(
                f"--sizes {probe.sizes[0]}: a pass-key prompt takes at least {shortest} tokens of "
                f"{loaded.path}'s tokenizer"
            )
        fillers.append(streams)
    reports = []
    for (loaded, tokenizer), streams in zip(checkpoints, fillers):
        reports.append(probe_checkpoint(loaded, tokenizer, streams, probe, progress=args.progress))
    print(format_passkey_table(reports))
    return _write_probe_reports(args, out, PASSKEY_REPORT, PASSKEY_PLOT, reports)


def _run_retrieval(
    args: argparse.Namespace, checkpoints: list[tuple[LoadedCheckpoint, Tokenizer]], out: Path
) -> list[Path]:
    from training.data.retrieval import RetrievalBuilder, formats_named, wordings_from_file
    from training.evaluation.retrieval_probe import (
        RetrievalProbe,
        format_retrieval_table,
        probe_checkpoint,
    )

    if args.needles > MAX_NEEDLES:
        raise UsageError(f"--needles {args.needles}: a prompt holds at most {MAX_NEEDLES} needles")
    splits = SPLITS if args.split == "both" else (args.split,)
    if args.formats is not None:
        for split in splits:
            formats_named(args.formats, split)  # ValueError naming an unknown format (exit 2)
    wordings = wordings_from_file(args.wordings) if args.wordings is not None else None
    probe = RetrievalProbe(
        sizes=args.sizes,
        depths=args.depths,
        fillers=tuple(dict.fromkeys(name for names in args.filler for name in names)),
        splits=splits,
        formats=args.formats,
        needles=args.needles,
        ask=args.ask,
        trials=args.trials,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        max_memory=int(args.max_memory * 2**30),
        wordings=args.wordings,
    )
    fillers = []  # every checkpoint's filler streams, read (and the sizes checked) before any runs
    for loaded, tokenizer in checkpoints:
        streams = _filler_streams(probe.fillers, loaded, tokenizer)
        for split in splits:
            builder = RetrievalBuilder(tokenizer, streams[probe.fillers[0]], split, wordings)
            shortest = builder.longest_fixed(probe.split_formats(split), probe.needles)
            if probe.sizes[0] < shortest:
                raise UsageError(
                    f"--sizes {probe.sizes[0]}: a retrieval prompt of the {split} split with {probe.needles} "
                    f"needle(s) takes up to {shortest} tokens of {loaded.path}'s tokenizer"
                )
        fillers.append(streams)
    reports = []
    for (loaded, tokenizer), streams in zip(checkpoints, fillers):
        reports += probe_checkpoint(loaded, tokenizer, streams, probe, wordings, progress=args.progress)
    print(format_retrieval_table(reports))
    return _write_probe_reports(args, out, RETRIEVAL_REPORT, RETRIEVAL_PLOT, reports)


def _write_probe_reports(
    args: argparse.Namespace, out: Path, name: str, plot_name: str, reports: list[dict[str, Any]]
) -> list[Path]:
    """A needle probe's reports in ``out/name``, and with ``--plots`` their heat map in ``out/plot_name``."""
    plots = []
    if args.plots:
        from training.evaluation.text_plots import plot_passkey

        plots.append((plot_name, plot_passkey))
    return _write_reports(out, name, reports, plots)


def _filler_streams(names: tuple[str, ...], loaded: LoadedCheckpoint, tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    """Each filler's token stream for one checkpoint; UsageError for one without held-out text."""
    streams = {name: filler_tokens(name, tokenizer, _validation_fraction(loaded)) for name in names}
    empty = [name for name, stream in streams.items() if len(stream) == 0]
    if empty:
        raise UsageError(f"--filler {empty[0]}: no held-out text")
    return streams


def _write_reports(
    out: Path,
    name: str,
    reports: list[dict[str, Any]],
    plots: Sequence[tuple[str, Callable[[list[dict[str, Any]], Path], None]]],
) -> list[Path]:
    """``reports`` as JSON in ``out/name`` and each plot of them in ``out/plot name``; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(reports, indent=2) + "\n")
    for plot_name, plot in plots:
        plot(reports, out / plot_name)
    return [out / name, *(out / plot_name for plot_name, _ in plots)]
