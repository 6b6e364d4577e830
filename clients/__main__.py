"""Command line of the regularlm server.

    python -m clients transduce MODEL 0110 [1 ...] [--all]   one line per input: input, final label, confidence
    python -m clients generate MODEL "prompt" [--max-tokens N] [--temperature T] [--seed S] [--stream]
    python -m clients models

The server is ``--url`` (or REGULARLM_URL, default http://127.0.0.1:8000), the API key REGULARLM_API_KEY.
Exit code 2, with the reason on stderr, on bad input or any HTTP or connection error.
"""

from __future__ import annotations

import argparse
import os
import sys

import httpx
from pydantic import ValidationError

from clients.client import DEFAULT_URL, APIStatusError, Client

EXIT_ERROR = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m clients", description="Talk to a regularlm server.")
    parser.add_argument(
        "--url",
        default=os.environ.get("REGULARLM_URL", DEFAULT_URL),
        help=f"the server (default: REGULARLM_URL if set, else {DEFAULT_URL}; here %(default)s); "
        "the API key, if the server wants one, is read from REGULARLM_API_KEY",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("models", help="list the served models (JSON)")

    transduce = commands.add_parser("transduce", help="labels of inputs under a transduce model")
    transduce.add_argument("model")
    transduce.add_argument("inputs", nargs="+")
    transduce.add_argument("--all", action="store_true", help="also print the label at every position")

    generate = commands.add_parser("generate", help="continue a prompt with a generate model")
    generate.add_argument("model")
    generate.add_argument("prompt")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=1.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--top-k", type=int, default=0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", help="a stop string (repeatable)")
    generate.add_argument("--stream", action="store_true", help="print the text as it is generated")
    return parser


def run(args: argparse.Namespace, client: Client) -> None:
    if args.command == "models":
        print(client.models().model_dump_json(indent=2))
    elif args.command == "transduce":
        response = client.transduce(args.model, args.inputs, "all" if args.all else "final")
        for text, result in zip(args.inputs, response.results):
            labels = f"\t{' '.join(result.all)}" if result.all is not None else ""
            print(f"{text}\t{result.final}\t{result.confidence:.4f}{labels}")
    else:
        sampling = {
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "seed": args.seed,
            "stop": args.stop,
        }
        if args.stream:
            for chunk in client.stream_generate(args.model, args.prompt, **sampling):
                print(chunk.text, end="", flush=True)
            print()
        else:
            print(client.generate(args.model, args.prompt, **sampling).text)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with Client(args.url, api_key=os.environ.get("REGULARLM_API_KEY"), timeout=args.timeout) as client:
            run(args, client)
    except APIStatusError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except ValidationError as error:
        print(f"error: invalid request: {error}", file=sys.stderr)
        return EXIT_ERROR
    except httpx.HTTPError as error:
        print(f"error: cannot reach the server at {args.url}: {error}", file=sys.stderr)
        return EXIT_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(main())
