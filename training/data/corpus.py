"""Where language-model text comes from, as a stream of documents. A corpus is named by a spec string:

``"austen"`` (default: Jane Austen's novels from the Debian package ``r-cran-janeaustenr``, read without R),
``"text:PATH"`` (a ``.txt`` file or folder) or ``"owt2:PATH"`` (OpenWebText2 shards, streamed); docs/training.md,
"Corpora". Unreadable corpora raise :class:`CorpusError`.
"""

from __future__ import annotations

import glob
import io
import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CORPUS = "austen"
AUSTEN_PACKAGE = "r-cran-janeaustenr"
# R library folders where Debian (and a source install of R) puts the package.
R_LIBRARIES = ("/usr/lib/R/site-library", "/usr/local/lib/R/site-library", "/usr/lib/R/library")
AUSTEN_DATABASE = "janeaustenr/data/Rdata.rdb"

R_STRING_VECTOR, R_CHARACTER, R_NA_LENGTH = 16, 9, -1  # SEXP types of R's serialisation


class CorpusError(ValueError):
    """A corpus that cannot be read; the message says which and how to get it."""


@dataclass(frozen=True)
class Document:
    text: str
    source: str  # where it came from: a file, a shard and line, or a novel's title


def corpus_documents(spec: str, rank: int = 0, world_size: int = 1) -> Iterator[Document]:
    """The documents of corpus ``spec`` that belong to process ``rank`` of ``world_size``: whole shards when there
    are at least as many as processes, else every ``world_size``-th document."""
    kind, _, location = spec.partition(":")
    if kind == DEFAULT_CORPUS and not location:
        documents: Iterator[Document] = iter(austen_novels())
    elif kind == "text" and location:
        documents = iter(text_files(Path(location)))
    elif kind == "owt2" and location:
        shards = owt2_shards(location)
        if len(shards) >= world_size:
            return owt2_documents(shards[rank::world_size])
        documents = owt2_documents(shards)
    else:
        raise CorpusError(f"unknown corpus {spec!r}: use {DEFAULT_CORPUS!r}, 'text:PATH' or 'owt2:PATH'")
    return (document for index, document in enumerate(documents) if index % world_size == rank)


def is_streamed(spec: str) -> bool:
    """Whether the corpus is read as a stream (too large to hold) rather than held in memory."""
    return spec.startswith("owt2:")


def split_document(text: str, validation_fraction: float, part: str) -> str:
    """The training head (``part="train"``) or validation tail (``"validation"``) of one document, cut at a
    paragraph break near ``1 - validation_fraction`` of its length."""
    cut = round(len(text) * (1.0 - validation_fraction))
    paragraph = text.find("\n\n", cut)
    cut = len(text) if paragraph < 0 else paragraph
    return text[:cut] if part == "train" else text[cut:].lstrip("\n")


# ---------------------------------------------------------------- the embedded corpus


def austen_novels(database: Path | None = None) -> list[Document]:
    """Jane Austen's six novels from ``r-cran-janeaustenr`` (or the given ``Rdata.rdb``), one document each."""
    database = database or _find_austen_database()
    novels = []
    for lines in read_r_string_vectors(database):
        title = next(line for line in lines if line.strip())
        novels.append(Document(join_wrapped_lines(lines), source=f"{AUSTEN_PACKAGE}: {title.strip()}"))
    return novels


def _find_austen_database() -> Path:
    for library in R_LIBRARIES:
        path = Path(library) / AUSTEN_DATABASE
        if path.is_file():
            return path
    raise CorpusError(
        f"the default corpus needs the Debian package {AUSTEN_PACKAGE} (apt-get install {AUSTEN_PACKAGE}); "
        f"looked for {AUSTEN_DATABASE} under {', '.join(R_LIBRARIES)}. Or give --corpus text:PATH or owt2:PATH"
    )


def join_wrapped_lines(lines: list[str]) -> str:
    """Project Gutenberg lines -> paragraphs (a paragraph's lines joined by a space), separated by a blank line."""
    paragraphs, current = [], []
    for line in lines:
        if line.strip():
            current.append(line.strip())
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


def read_r_string_vectors(database: Path) -> list[list[str]]:
    """Every character vector stored in an R lazy-load database (``.rdb``), in file order.

    A record is a 4-byte big-endian uncompressed length, then a zlib stream of R's XDR serialisation: "X\\n",
    three version ints (for version 3, the native encoding's name), then the object. Records that are not a
    character vector are skipped. NA elements become empty strings.
    """
    data = database.read_bytes()
    vectors, position = [], 0
    while position < len(data):
        (expected,) = struct.unpack_from(">I", data, position)
        inflater = zlib.decompressobj()
        try:
            raw = inflater.decompress(data[position + 4 :])
        except zlib.error as error:
            raise CorpusError(f"{database}: record at byte {position} is not zlib-compressed: {error}") from None
        if len(raw) != expected:
            raise CorpusError(f"{database}: record at byte {position} holds {len(raw)} bytes, header says {expected}")
        position = len(data) - len(inflater.unused_data)
        strings = _r_string_vector(raw)
        if strings is not None:
            vectors.append(strings)
    return vectors


def _r_string_vector(raw: bytes) -> list[str] | None:
    if raw[:2] != b"X\n":
        raise CorpusError("not R's XDR serialisation (no 'X\\n' header)")
    version, _writer, _reader = struct.unpack_from(">iii", raw, 2)
    offset = 14
    if version == 3:
        (name_length,) = struct.unpack_from(">i", raw, offset)
        offset += 4 + name_length
    (flags,) = struct.unpack_from(">i", raw, offset)
    if flags & 0xFF != R_STRING_VECTOR:
        return None
    (length,) = struct.unpack_from(">i", raw, offset + 4)
    offset += 8
    strings = []
    for _ in range(length):
        flags, size = struct.unpack_from(">ii", raw, offset)
        offset += 8
        if flags & 0xFF != R_CHARACTER:
            raise CorpusError(f"unexpected R element type {flags & 0xFF} in a character vector")
        if size == R_NA_LENGTH:
            strings.append("")
            continue
        strings.append(raw[offset : offset + size].decode("utf-8", errors="replace"))
        offset += size
    return strings


# ---------------------------------------------------------------- files and OpenWebText2


def text_files(path: Path) -> list[Document]:
    files = [path] if path.is_file() else sorted(path.rglob("*.txt"))
    if not files:
        raise CorpusError(f"text:{path}: no .txt file there")
    return [Document(file.read_text(encoding="utf-8", errors="replace"), source=str(file)) for file in files]


def owt2_shards(location: str) -> list[Path]:
    """The ``*.jsonl.zst`` shards named by a file, a folder (searched recursively) or a glob, sorted."""
    path = Path(location)
    if path.is_dir():
        shards = sorted(path.rglob("*.jsonl.zst"))
    elif path.is_file():
        shards = [path]
    else:
        shards = sorted(Path(match) for match in glob.glob(location, recursive=True) if match.endswith(".jsonl.zst"))
    if not shards:
        raise CorpusError(f"owt2:{location}: no .jsonl.zst shard there (extract the Pile's openwebtext2 tar first)")
    return shards


def owt2_documents(shards: list[Path]) -> Iterator[Document]:
    """Stream the documents of the shards in order; empty texts are skipped, a malformed line is an error."""
    try:
        import zstandard
    except ImportError:
        raise CorpusError("reading OpenWebText2 needs the zstandard package: pip install -e '.[text]'") from None
    for shard in shards:
        with shard.open("rb") as compressed:
            reader = zstandard.ZstdDecompressor(max_window_size=2**31).stream_reader(compressed)
            for number, line in enumerate(io.TextIOWrapper(reader, encoding="utf-8", errors="replace"), start=1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as error:
                    raise CorpusError(f"{shard}:{number}: not an {{'text', 'meta'}} JSON line: {error}") from None
                if text:
                    yield Document(text, source=f"{shard}:{number}")
