"""Text corpora: the OpenWebText2 reader on made shards (streaming, rank sharding), the R lazy-load reader of
the embedded corpus on a made database, paragraph joining and the validation split. No network."""

from __future__ import annotations

import json
import struct
import zlib

import pytest

from training.data.corpus import (
    CorpusError,
    austen_novels,
    corpus_documents,
    join_wrapped_lines,
    owt2_shards,
    read_r_string_vectors,
    split_document,
)

zstandard = pytest.importorskip("zstandard")
pytestmark = pytest.mark.usefixtures("no_network")


def write_shard(path, texts: list[str], blank_lines: bool = False) -> None:
    """A Pile-style shard: one {"text", "meta"} JSON object per line, zstd-compressed."""
    lines = []
    for text in texts:
        lines.append(json.dumps({"text": text, "meta": {"pile_set_name": "OpenWebText2"}}))
        if blank_lines:
            lines.append("")
    path.write_bytes(zstandard.ZstdCompressor(level=3).compress(("\n".join(lines) + "\n").encode()))


@pytest.fixture
def owt2_dir(tmp_path):
    folder = tmp_path / "openwebtext2"
    folder.mkdir()
    write_shard(folder / "RS_2019-01.jsonl.zst", ["first doc ☃", "second doc\nwith lines", ""], blank_lines=True)
    write_shard(folder / "RS_2019-02.jsonl.zst", ["third", "fourth 👋"])
    write_shard(folder / "RS_2019-03.jsonl.zst", ["fifth"])
    return folder


def test_owt2_reader_streams_every_document_in_order(owt2_dir) -> None:
    documents = list(corpus_documents(f"owt2:{owt2_dir}"))
    assert [document.text for document in documents] == [
        "first doc ☃",
        "second doc\nwith lines",
        "third",
        "fourth 👋",
        "fifth",
    ]  # the empty text is skipped
    assert documents[0].source.endswith("RS_2019-01.jsonl.zst:1")


def test_owt2_reader_takes_a_file_or_a_glob(owt2_dir) -> None:
    assert [d.text for d in corpus_documents(f"owt2:{owt2_dir / 'RS_2019-03.jsonl.zst'}")] == ["fifth"]
    assert len(owt2_shards(str(owt2_dir / "RS_2019-0[12].jsonl.zst"))) == 2


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_owt2_ranks_read_disjoint_shares_that_cover_the_corpus(owt2_dir, world_size) -> None:
    shares = [[d.text for d in corpus_documents(f"owt2:{owt2_dir}", rank, world_size)] for rank in range(world_size)]
    every = [text for share in shares for text in share]
    assert sorted(every) == sorted(["first doc ☃", "second doc\nwith lines", "third", "fourth 👋", "fifth"])
    if world_size <= 3:  # at least as many shards as ranks: whole shards each
        assert shares[0][0] == "first doc ☃" and shares[1][0] == "third"


def test_owt2_malformed_line_is_named(tmp_path) -> None:
    shard = tmp_path / "bad.jsonl.zst"
    shard.write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "ok"}\n{"meta": {}}\n'))
    with pytest.raises(CorpusError, match="bad.jsonl.zst:2"):
        list(corpus_documents(f"owt2:{shard}"))


def test_missing_shards_and_unknown_specs_are_refused(tmp_path) -> None:
    with pytest.raises(CorpusError, match="no .jsonl.zst"):
        list(corpus_documents(f"owt2:{tmp_path}"))
    with pytest.raises(CorpusError, match="unknown corpus"):
        list(corpus_documents("wikipedia"))


def r_record(raw_object: bytes) -> bytes:
    """One lazy-load database record: length, then zlib of R's XDR serialisation (version 3)."""
    raw = b"X\n" + struct.pack(">iii", 3, 0x040201, 0x030500) + struct.pack(">i", 5) + b"UTF-8" + raw_object
    return struct.pack(">I", len(raw)) + zlib.compress(raw)


def r_strings(lines: list[str | None]) -> bytes:
    out = struct.pack(">ii", 16, len(lines))
    for line in lines:
        if line is None:
            out += struct.pack(">ii", 9, -1)
        else:
            encoded = line.encode()
            out += struct.pack(">ii", 9 | (8 << 12), len(encoded)) + encoded
    return out


def test_r_lazy_load_database_reader(tmp_path) -> None:
    database = tmp_path / "Rdata.rdb"
    novel = [
        "EMMA",
        "",
        "By Jane Austen",
        "",
        "Emma Woodhouse, handsome, clever,",
        "and rich, with a",
        None,
        "comfortable home — naïve.",
    ]
    integers = struct.pack(">ii", 13, 2) + struct.pack(">ii", 1, 2)  # an integer vector: skipped
    database.write_bytes(r_record(r_strings(novel)) + r_record(integers) + r_record(r_strings(["Persuasion", "x"])))
    assert read_r_string_vectors(database) == [[line or "" for line in novel], ["Persuasion", "x"]]
    emma, persuasion = austen_novels(database)
    assert (
        emma.text == "EMMA\n\nBy Jane Austen\n\nEmma Woodhouse, handsome, clever, and rich, with a\n\n"
        "comfortable home — naïve."
    )
    assert emma.source.endswith("EMMA") and persuasion.text == "Persuasion x"


def test_corrupt_database_is_refused(tmp_path) -> None:
    database = tmp_path / "Rdata.rdb"
    database.write_bytes(struct.pack(">I", 10) + b"not zlib at all")
    with pytest.raises(CorpusError, match="not zlib"):
        read_r_string_vectors(database)


def test_join_wrapped_lines() -> None:
    assert join_wrapped_lines(["", "a b", " c ", "", "", "d", ""]) == "a b c\n\nd"


def test_split_document_cuts_at_a_paragraph_break() -> None:
    text = "\n\n".join(f"paragraph {i} " + "x" * 20 for i in range(10))
    head, tail = split_document(text, 0.25, "train"), split_document(text, 0.25, "validation")
    assert head + "\n\n" + tail == text
    assert tail.startswith("paragraph 8") and 0.15 < len(tail) / len(text) < 0.3


def test_text_files_corpus(tmp_path) -> None:
    (tmp_path / "a.txt").write_text("alpha")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta")
    assert [d.text for d in corpus_documents(f"text:{tmp_path}")] == ["alpha", "beta"]
    assert [d.text for d in corpus_documents(f"text:{tmp_path}", rank=1, world_size=2)] == ["beta"]
