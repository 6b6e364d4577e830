"""``python -m clients``: output, and exit code 2 with a clear message on bad input or HTTP errors."""

from __future__ import annotations

import json
import socket

import pytest

from clients.__main__ import build_parser, main
from clients.client import DEFAULT_URL


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_transduce(live, capsys) -> None:
    code, out, _ = run(capsys, "--url", live.url, "transduce", "parity-lrnn", "0110", "1", "--all")
    assert code == 0
    lines = out.splitlines()
    assert [line.split("\t")[0] for line in lines] == ["0110", "1"]
    assert len(lines[0].split("\t")[3].split()) == 4


def test_generate_and_stream(live, capsys) -> None:
    code, plain, _ = run(capsys, "--url", live.url, "generate", "text-lrnn", "Once", "--max-tokens", "8", "--seed", "2")
    assert code == 0
    code, streamed, _ = run(
        capsys, "--url", live.url, "generate", "text-lrnn", "Once", "--max-tokens", "8", "--seed", "2", "--stream"
    )
    assert code == 0 and streamed == plain


def test_models(live, capsys) -> None:
    code, out, _ = run(capsys, "--url", live.url, "models")
    assert code == 0 and json.loads(out)["object"] == "list"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["transduce", "parity-lrnn", "01x"], "character 'x' at position 2"),
        (["transduce", "nope", "0"], "HTTP 404"),
        (["generate", "text-lrnn", "x", "--temperature", "-1"], "invalid request"),
    ],
)
def test_errors_exit_2(argv: list[str], message: str, live, capsys) -> None:
    code, _, err = run(capsys, "--url", live.url, *argv)
    assert code == 2 and err.startswith("error: ") and message in err


def test_unreachable_server_exits_2(capsys) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, _, err = run(capsys, "--url", f"http://127.0.0.1:{port}", "models")
    assert code == 2 and "cannot reach the server" in err


def test_help_tells_the_url_default_and_the_api_key_variable(monkeypatch) -> None:
    monkeypatch.delenv("REGULARLM_URL", raising=False)
    text = " ".join(build_parser().format_help().split())  # argparse wraps the lines
    assert f"default: REGULARLM_URL if set, else {DEFAULT_URL}; here {DEFAULT_URL}" in text
    assert "REGULARLM_API_KEY" in text
    monkeypatch.setenv("REGULARLM_URL", "http://pod:9000")
    assert "here http://pod:9000" in " ".join(build_parser().format_help().split())
