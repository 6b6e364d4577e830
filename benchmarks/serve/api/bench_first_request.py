"""What the first requests cost after /health turns ok: a fresh server on the shipped checkpoints (or --models),
then, in order, each request below once, timed end to end (sent -> whole answer), as a markdown table, after the
time from start to /health ok (the load, the speed measurement and the warm-up).

    python -m benchmarks.serve.api.bench_first_request [--models checkpoints] [--threads 1] [--repeat 2]

The requests, per language model (text-lrnn, text-regulargpt): /v1/generate with prompts of about 5, 100 and 1,000
tokens, /v1/completions with token-id prompts of 5, 100 and 1,000 tokens, one sampled (temperature 1, top_p 0.9,
seed 0) and one with structured_outputs (choice); all with max_tokens 16. Then one /v1/transduce per architecture
kind (an LRNN, a RegularGPT, an exact encoder). ``--repeat``: how many times the whole list is sent (a later pass
shows the warm cost).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx

from benchmarks.serve.harness import ROOT, add_server_arguments, machine, server_process

LANGUAGE_MODELS = ("text-lrnn", "text-regulargpt")
TRANSDUCERS = ("parity_check-lrnn", "parity_check-regulargpt", "parity_check-exact")
PROMPT_TOKENS = (5, 100, 1000)
# About 78 tokens of the text models' tokenizer (a word repeated 600 times made text-lrnn's logits NaN).
TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a "
    "wife. However little known the feelings or views of such a man may be on his first entering a neighbourhood, this "
    "truth is so well fixed in the minds of the surrounding families, that he is considered as the rightful property "
    "of some one or other of their daughters. "
)
CHARACTERS_PER_TOKEN = 4.7


def requests(model: str, attempt: int) -> list[tuple[str, str, dict]]:
    """(label, path, body) of the requests sent to one language model; each ``attempt`` has its own prompts and
    choices, so that no pass finds another's prompts in the state cache or its constraint compiled."""
    listed = []
    for tokens in PROMPT_TOKENS:
        prompt = (f"{attempt}. " + TEXT * (tokens // 70 + 1))[: int(tokens * CHARACTERS_PER_TOKEN)]
        listed.append((f"generate ~{tokens} tok", "/v1/generate", {"prompt": prompt}))
    for tokens in PROMPT_TOKENS:
        ids = [(7 * i + attempt) % 200 + 1 for i in range(tokens)]
        listed.append((f"completions {tokens} ids", "/v1/completions", {"prompt": ids}))
    sampled = {"prompt": "It was", "temperature": 1.0, "top_p": 0.9, "seed": 0}
    listed.append(("generate sampled", "/v1/generate", sampled))
    structured = {"prompt": "It was", "structured_outputs": {"choice": [f"yes {attempt}", f"no {attempt}"]}}
    listed.append(("generate choice", "/v1/generate", structured))
    fields = {"model": model, "max_tokens": 16, "temperature": 0.0}
    return [(label, path, {**fields, **body}) for label, path, body in listed]


def transduce_requests() -> list[tuple[str, str, dict]]:
    return [("transduce", "/v1/transduce", {"model": model, "inputs": ["0110" * 8]}) for model in TRANSDUCERS]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=Path, default=ROOT / "checkpoints")
    parser.add_argument("--repeat", type=int, default=2)
    add_server_arguments(parser)
    args = parser.parse_args()
    print(machine(args.device))
    started = time.monotonic()
    with server_process(args.models, args.threads, args.device) as url:
        print(f"start -> /health ok: {time.monotonic() - started:.1f} s\n")
        rows: dict[str, list[str]] = {}
        with httpx.Client(base_url=url, timeout=600) as client:
            for attempt in range(args.repeat):
                listed = [request for model in LANGUAGE_MODELS for request in requests(model, attempt)]
                for label, path, body in [*listed, *transduce_requests()]:
                    sent = time.perf_counter()
                    response = client.post(path, json=body)
                    milliseconds = 1000 * (time.perf_counter() - sent)
                    failed = "" if response.status_code == 200 else f" ({response.status_code})"
                    rows.setdefault(f"{body['model']} {label}", []).append(f"{milliseconds:.1f}{failed}")
    print("| request | " + " | ".join(f"pass {attempt + 1} (ms)" for attempt in range(args.repeat)) + " |")
    print("|---|" + "---:|" * args.repeat)
    for request, cells in rows.items():
        print(f"| {request} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
