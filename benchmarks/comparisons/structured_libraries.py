"""Token-level constraint libraries on one of our tiktoken vocabularies: llguidance, xgrammar and outlines-core.

Each is its own Python package ("pip install llguidance xgrammar outlines-core"; xgrammar with --no-deps plus
apache-tvm-ffi, since it requires torch, transformers and triton).

For each library: the setup time per vocabulary (its tokenizer object from tiktoken's byte ranks and the
end-of-text id after the last rank), the compile time of a set of regexes and JSON schemas, the mask time per
token (a mask computed and a token consumed, along random walks that pick an allowed token uniformly), and
agreement with ``re.fullmatch`` on random Python patterns, both given as they are and in the plain dialect of
``server/structured/regex.py``: each walk's text, once the library lets it end, must fullmatch, and strings
``re`` accepts or refuses must be accepted or refused. Single thread, median of repeats.

    python -m benchmarks.comparisons.structured_libraries [--checkpoint checkpoints/text-lrnn] [--patterns 300]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from model.checkpoint import read_config
from model.tokenizer import Tokenizer, load_tokenizer
from server.structured.regex import PatternError, plain_regex
from tests.automata.helpers import random_pattern

REGEXES = {
    "phone": r"\(\d{3}\) \d{3}-\d{4}",
    "date": r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    "email": r"[a-z0-9._%+-]{1,20}@[a-z0-9.-]{1,20}\.(com|org|net)",
    "ipv4": r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)",
    "sentence": r"[A-Z][a-z]+( [a-z]+){2,8}\.",
    "line": r"[^\n]{1,40}\n",
    "choice": r"(yes|no|maybe|Elizabeth Bennet|Mr\. Darcy)",
}
SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            },
            "status": {"enum": ["open", "paid", "shipped"]},
        },
        "required": ["id", "items", "status"],
        "additionalProperties": False,
    },
}


class Library:
    """One library behind one interface: ``setup`` a vocabulary, ``compile`` a regex or schema, walk a matcher."""

    name = ""

    def setup(self, tokenizer: Tokenizer) -> None:
        raise NotImplementedError

    def compile(self, kind: str, spec: str) -> object:
        raise NotImplementedError

    def matcher(self, compiled: object) -> object:
        raise NotImplementedError

    def fill(self, matcher: object, bitmask: torch.Tensor) -> None:
        """Write the allowed tokens into ``bitmask`` (int32, (ceil(V / 32),))."""
        raise NotImplementedError

    def consume(self, matcher: object, token: int) -> bool:
        raise NotImplementedError


class LLGuidance(Library):
    name = "llguidance"

    def setup(self, tokenizer: Tokenizer) -> None:
        import llguidance
        import llguidance.tiktoken

        self.lib = llguidance
        self.tokenizer = llguidance.tiktoken.lltokenizer_from_encoding(
            tokenizer.encoding, n_vocab=tokenizer.vocab_size, eos_token=tokenizer.eot_token
        )

    def compile(self, kind: str, spec: str) -> object:
        matcher_class = self.lib.LLMatcher
        if kind == "regex":
            grammar = matcher_class.grammar_from_regex(spec)
        else:
            grammar = matcher_class.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False})
        matcher = matcher_class(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: object) -> object:
        return compiled.deep_copy()

    def fill(self, matcher: object, bitmask: torch.Tensor) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)

    def consume(self, matcher: object, token: int) -> bool:
        return matcher.consume_token(token)


class XGrammar(Library):
    name = "xgrammar"

    def setup(self, tokenizer: Tokenizer) -> None:
        import xgrammar

        self.lib = xgrammar
        vocabulary = [tokenizer.encoding.decode_single_token_bytes(i) for i in range(tokenizer.vocab_size)]
        info = xgrammar.TokenizerInfo(
            vocabulary, xgrammar.VocabType.RAW, vocab_size=tokenizer.vocab_size, stop_token_ids=[tokenizer.eot_token]
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, spec: str) -> object:
        if kind == "regex":
            return self.compiler.compile_regex(spec)
        return self.compiler.compile_json_schema(spec, any_whitespace=False)

    def matcher(self, compiled: object) -> object:
        return self.lib.GrammarMatcher(compiled)

    def fill(self, matcher: object, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask[None])

    def consume(self, matcher: object, token: int) -> bool:
        return matcher.accept_token(token)


class OutlinesCore(Library):
    name = "outlines-core"

    def setup(self, tokenizer: Tokenizer) -> None:
        import outlines_core

        self.lib = outlines_core
        tokens: dict[bytes, list[int]] = {}
        for token in range(tokenizer.vocab_size):
            if token != tokenizer.eot_token:
                tokens.setdefault(tokenizer.encoding.decode_single_token_bytes(token), []).append(token)
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eot_token, tokens)

    def compile(self, kind: str, spec: str) -> object:
        if kind != "regex":
            spec = self.lib.json_schema.build_regex_from_schema(spec)
        return self.lib.Index(spec, self.vocabulary)

    def matcher(self, compiled: object) -> object:
        return self.lib.Guide(compiled)

    def fill(self, matcher: object, bitmask: torch.Tensor) -> None:
        matcher.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def consume(self, matcher: object, token: int) -> bool:
        matcher.advance(token, return_tokens=False)
        return True


LIBRARIES = [LLGuidance, XGrammar, OutlinesCore]
BITS = torch.arange(32, dtype=torch.int32)


def allowed(bitmask: torch.Tensor, vocabulary: int) -> torch.Tensor:
    """The allowed token ids of a bitmask (ceil(V / 32),) int32."""
    return ((bitmask[:, None] >> BITS) & 1).flatten()[:vocabulary].nonzero()[:, 0]


def walk(
    library: Library, compiled: object, tokenizer: Tokenizer, rng: np.random.Generator, max_tokens: int = 48
) -> tuple[bytes | None, list[float]]:
    """A random walk: uniform over the allowed tokens, ending at the end-of-text token (chosen with probability 1/3
    when allowed) or when nothing else is allowed. Returns (the bytes, or None if cut at max_tokens; seconds per
    token of fill + consume)."""
    matcher, bitmask, out, seconds = (
        library.matcher(compiled),
        torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32),
        [],
        [],
    )
    for _ in range(max_tokens):
        started = time.perf_counter()
        library.fill(matcher, bitmask)
        fill_seconds = time.perf_counter() - started
        tokens = allowed(bitmask, tokenizer.vocab_size).tolist()
        if not tokens:
            return None, seconds
        ending = tokenizer.eot_token in tokens
        if ending and (len(tokens) == 1 or rng.random() < 1 / 3):
            return tokenizer.decode_bytes(out), seconds
        token = int(rng.choice([t for t in tokens if t != tokenizer.eot_token]))
        started = time.perf_counter()
        library.consume(matcher, token)
        seconds.append(fill_seconds + time.perf_counter() - started)
        out.append(token)
    return None, seconds


def accepts(library: Library, compiled: object, tokenizer: Tokenizer, text: str) -> bool:
    """Whether the library lets ``text`` (its byte tokens, one per byte) end: every byte allowed, then the
    end-of-text token allowed."""
    matcher, bitmask = library.matcher(compiled), torch.zeros((tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
    for byte in text.encode():
        token = tokenizer.encoding.encode_single_token(bytes([byte]))
        library.fill(matcher, bitmask)
        if token not in allowed(bitmask, tokenizer.vocab_size).tolist() or not library.consume(matcher, token):
            return False
    library.fill(matcher, bitmask)
    return tokenizer.eot_token in allowed(bitmask, tokenizer.vocab_size).tolist()


def timed(call, repeats: int = 3) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def speed(library: Library, tokenizer: Tokenizer, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    setup, _ = timed(lambda: library.setup(tokenizer))
    compile_ms, mask_us = {}, []
    cases = [("regex", name, plain_regex(p)) for name, p in REGEXES.items()]
    cases += [("json", name, json.dumps(schema)) for name, schema in SCHEMAS.items()]
    for kind, name, spec in cases:
        try:
            seconds, compiled = timed(lambda kind=kind, spec=spec: library.compile(kind, spec))
        except Exception as error:
            compile_ms[name] = f"refused: {str(error).splitlines()[0][:80]}"
            continue
        compile_ms[name] = round(seconds * 1000, 2)
        for _ in range(10):
            mask_us += walk(library, compiled, tokenizer, rng)[1]
    return {
        "setup_ms": round(setup * 1000, 1),
        "compile_ms": compile_ms,
        "mask_us_median": round(statistics.median(mask_us) * 1e6, 1),
        "mask_us_p99": round(float(np.percentile(mask_us, 99)) * 1e6, 1),
        "mask_tokens": len(mask_us),
    }


def agreement(library: Library, tokenizer: Tokenizer, patterns: int, seed: int) -> dict:
    """Disagreements with re.fullmatch over ``patterns`` random patterns, as given and in the plain dialect."""
    rng = np.random.default_rng(seed)
    counts = {"raw": {"refused": 0, "wrong": 0}, "plain": {"refused": 0, "wrong": 0}}
    examples = []
    for index in range(patterns):
        alphabet = ["ab", "abc", "a b", "0a\n"][index % 4]
        pattern = random_pattern(rng, alphabet)
        if index % 5 == 0:  # classes whose meaning differs between dialects
            pattern = "(" + pattern + ")" + str(rng.choice([r"\s", r"\w", r"\d", "{,2}", r"[^\S]"]))
        expected = re.compile(pattern)
        probes = ["".join(rng.choice(list(alphabet + "\x1c\u212a"), size=int(rng.integers(0, 6)))) for _ in range(12)]
        for form, spec in (("raw", pattern), ("plain", plain_regex(pattern))):
            try:
                compiled = library.compile("regex", spec)
            except Exception:
                counts[form]["refused"] += 1
                continue
            texts = [walk(library, compiled, tokenizer, rng)[0] for _ in range(4)]
            wrong = [t for t in texts if t is not None and not expected.fullmatch(t.decode())]
            wrong += [p for p in probes if accepts(library, compiled, tokenizer, p) != bool(expected.fullmatch(p))]
            if wrong:
                counts[form]["wrong"] += 1
                if len(examples) < 4:
                    examples.append({"form": form, "pattern": pattern, "text": repr(wrong[0])})
    return {**counts, "examples": examples}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default="checkpoints/text-lrnn")
    parser.add_argument("--patterns", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--library",
        choices=[library.name for library in LIBRARIES],
        action="append",
        help="only these (repeatable); default all",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = read_config(Path(args.checkpoint))
    tokenizer = load_tokenizer(config.tokenizer, args.checkpoint)
    print(json.dumps({"machine": platform.processor() or platform.machine(), "vocabulary": tokenizer.vocab_size}))
    for library_class in LIBRARIES:
        library = library_class()
        if args.library and library.name not in args.library:
            continue
        try:
            result = speed(library, tokenizer, args.seed)
        except ImportError as error:
            print(json.dumps({"library": library.name, "skipped": str(error)}))
            continue
        result["fullmatch"] = agreement(library, tokenizer, args.patterns, args.seed)
        print(json.dumps({"library": library.name, **result}))


if __name__ == "__main__":
    try:
        main()
    except PatternError as error:
        raise SystemExit(f"error: {error}") from None
