"""structured_outputs (docs/api.md, Structured outputs): every returned text matches its regex (re.fullmatch),
choice or JSON schema, on /v1/generate and /v1/completions, streamed or not, for n > 1 and any sampling settings;
200+ random regexes whose constrained samples all match; refusals (422, 413); constrained and free sequences
decoding in one batch.

Tiny models with random weights: one with the shipped 8k BPE vocabulary (``checkpoints/text-lrnn``'s tiktoken
ranks and its end-of-text token), one byte-level model without an end-of-text token, and a transducer.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema
import llguidance
import numpy as np
import openai
import pytest
import regex
import torch
from fastapi.testclient import TestClient

import server.execution.generation
import server.structured.outputs
from model.checkpoint import save_checkpoint
from model.config import CheckpointConfig
from model.tokenizer import load_tokenizer
from server.api.app import create_app
from server.errors import InputTooLarge, ModelFailure
from server.structured.regex import plain_regex
from tests.model.tiny_models import ARCHITECTURE_OF, build_tiny
from tests.server.helpers import make_settings
from tests.server.live import serve

BPE_RANKS = Path(__file__).resolve().parents[3] / "checkpoints" / "text-lrnn" / "tokenizer.tiktoken"
BPE_END = 8191  # <|endoftext|>, the id after the last of the 8,191 ranks
BPE, BPE_GPT, BYTES = "bpe-lrnn", "bpe-regulargpt", "bytes-lstm"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


def write_models(directory: Path) -> Path:
    torch.manual_seed(0)
    for model_id, tiny_id in ((BPE, "lrnn"), (BPE_GPT, "regulargpt-c2")):
        model = build_tiny(tiny_id, vocab_size=8192, num_labels=0)
        config = CheckpointConfig(
            architecture=ARCHITECTURE_OF[type(model.config)],
            model=model.config,
            kind="generate",
            tokenizer="file:tokenizer.tiktoken",
        )
        save_checkpoint(model, config, directory / model_id)
        shutil.copy(BPE_RANKS, directory / model_id / "tokenizer.tiktoken")
    model = build_tiny("lstm", vocab_size=256, num_labels=0)
    config = CheckpointConfig(architecture="lstm", model=model.config, kind="generate", tokenizer="bytes")
    save_checkpoint(model, config, directory / BYTES)
    model = build_tiny("lrnn", vocab_size=2, num_labels=2)
    config = CheckpointConfig(
        architecture="lrnn", model=model.config, kind="transduce", task="parity_check", alphabet="01", labels=("0", "1")
    )
    save_checkpoint(model, config, directory / "parity-lrnn")
    return directory


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    return write_models(tmp_path_factory.mktemp("structured"))


@pytest.fixture(scope="module")
def client(models_dir):
    app = create_app(make_settings(models_dir, structured_max_chars=2000, structured_compile_timeout_s=10.0))
    with TestClient(app) as test_client:
        app.state.engine.wait_loaded()
        yield test_client


def complete(client: TestClient, structured: dict, model: str = BPE, **fields) -> list[tuple[str, str]]:
    """(text, finish_reason) of each choice of a /v1/completions request, streamed or not."""
    body = {"model": model, "prompt": "The", "max_tokens": 48, "structured_outputs": structured, **fields}
    if not body.get("stream"):
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return [(choice["text"], choice["finish_reason"]) for choice in response.json()["choices"]]
    texts, reasons = {}, {}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                    reasons[choice["index"]] = choice["finish_reason"] or reasons.get(choice["index"])
    return [(texts[index], reasons[index]) for index in sorted(texts)]


SAMPLINGS = [
    {"temperature": 0.0},
    {"temperature": 1.0, "seed": 1},
    {"temperature": 1.5, "top_k": 5, "seed": 2},
    {"temperature": 0.7, "top_p": 0.5, "seed": 3, "stream": True},
    {"temperature": 1.0, "stream": True},  # no seed: a random one
]
REGEXES = [
    r"[0-9]{3}-[a-z]{2,4}",
    r"(cat|dog)s? (and|or) [a-z]{1,5}\.",
    r"\d{1,6}(\.\d\d)?",
    r"(?i)yes|no",
    r"\w{1,8}@\w{1,8}\.(com|org)",
    r"[A-Z][a-z]{0,6}( [a-z]{1,6}){0,3}\.",
]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
@pytest.mark.parametrize("model", [BPE, BPE_GPT])
def test_regex_texts_fullmatch(client, model: str, sampling: dict) -> None:
    for pattern in REGEXES:
        for text, reason in complete(client, {"regex": pattern}, model=model, n=3, **sampling):
            assert re.fullmatch(pattern, text) and reason == "stop", (pattern, text, reason)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_choice_texts_are_one_of_the_strings(client, sampling: dict) -> None:
    choices = ["yes", "no", "Mr. Darcy", "Elizabeth Bennet", "ünïcödé 👋", "a.b*c", "line\u2028break\x85"]
    results = complete(client, {"choice": choices}, n=4, **sampling)
    assert all(text in choices and reason == "stop" for text, reason in results), results


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_json_texts_validate_against_the_schema(client, sampling: dict) -> None:
    for schema in (PERSON, json.dumps(PERSON), {"enum": [1, "two", None, [3]]}):
        results = complete(client, {"json": schema}, n=3, max_tokens=64, **sampling)
        for text, reason in results:
            jsonschema.validate(json.loads(text), json.loads(schema) if isinstance(schema, str) else schema)
            assert reason == "stop", (text, reason)


def test_generate_endpoint_streamed_and_not(client) -> None:
    body = {"model": BPE, "prompt": "Hi", "max_tokens": 32, "seed": 5, "structured_outputs": {"regex": "[a-c]{2,5}!"}}
    whole = client.post("/v1/generate", json=body).json()
    assert re.fullmatch("[a-c]{2,5}!", whole["text"]) and whole["finish_reason"] == "stop"
    with client.stream("POST", "/v1/generate", json={**body, "stream": True}) as response:
        chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    assert "".join(chunk["text"] for chunk in chunks) == whole["text"] and chunks[-1]["finish_reason"] == "stop"


def test_ends_as_soon_as_nothing_longer_can_match(client) -> None:
    """The text is complete after "abc": no end-of-text token is sampled, nothing runs to max_tokens."""
    response = client.post(
        "/v1/generate",
        json={"model": BPE, "prompt": "x", "max_tokens": 40, "temperature": 0, "structured_outputs": {"regex": "abc"}},
    ).json()
    assert response["text"] == "abc" and response["finish_reason"] == "stop"
    assert response["usage"]["completion_tokens"] <= 3


def test_end_of_text_only_where_the_text_matches(client) -> None:
    """With the end-of-text token's logit raised by 100, it is still taken only where the text is complete."""
    results = complete(client, {"regex": "(ab)+"}, n=4, seed=1, logit_bias={str(BPE_END): 100})
    assert [text for text, _ in results] == ["ab"] * 4
    results = complete(client, {"regex": ""}, n=2, seed=1)
    assert results == [("", "stop"), ("", "stop")]


def test_a_token_drawn_against_its_mask_is_replaced(client, monkeypatch) -> None:
    """Should the sampler ever return a forbidden token (a numerical corner), the row takes its best allowed one."""
    monkeypatch.setattr(
        server.execution.generation, "sample", lambda logits, params, generators: [0] * len(params)
    )  # "!"
    results = complete(client, {"regex": "[a-c]{3}"}, n=2, seed=1)
    assert [reason for _, reason in results] == ["stop", "stop"]
    assert all(re.fullmatch("[a-c]{3}", text) for text, _ in results)


def test_model_without_an_end_of_text_token(client) -> None:
    """The byte-level model has no end-of-text token: a text ends when nothing longer can match, or at max_tokens."""
    for text, reason in complete(client, {"regex": "ab?c?"}, model=BYTES, n=4, seed=2):
        assert text in ("abc", "ac") and reason == "stop"  # "a" and "ab" match too, but the model cannot end there
    assert complete(client, {"regex": ""}, model=BYTES) == [("", "stop")]
    results = complete(client, {"regex": "(x|y)*"}, model=BYTES, n=2, max_tokens=7, seed=3)
    assert all(re.fullmatch("[xy]{7}", text) and reason == "length" for text, reason in results)


def test_seeded_constrained_sampling_repeats(client) -> None:
    first = complete(client, {"regex": "[a-z]{3,9}"}, n=3, seed=11, temperature=1.2)
    assert complete(client, {"regex": "[a-z]{3,9}"}, n=3, seed=11, temperature=1.2) == first
    assert len({text for text, _ in first}) > 1


# --- refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("structured", "status", "words"),
    [
        ({"regex": "(ab"}, 422, "missing ), unterminated subpattern"),
        ({"regex": "(?=a)b"}, 422, "look-ahead"),
        ({"regex": r"(a)\1"}, 422, "back-references"),
        ({"regex": "^a$"}, 422, "anchors"),
        ({"regex": r"[^\s\S]"}, 422, "no text matches"),
        ({"json": {"type": "foo"}}, 422, "Invalid type: foo"),
        ({"json": {"type": "integer", "minimum": 5, "maximum": 3}}, 422, "minimum (5) is greater than maximum (3)"),
        ({"json": "{not json"}, 422, "not JSON"),
        ({"json": "[1]"}, 422, "JSON object"),
        ({"choice": []}, 422, "choice needs at least one string"),
        ({"regex": "a", "choice": ["a"]}, 422, "exactly one of regex, choice and json"),
        ({}, 422, "exactly one of regex, choice and json"),
        ({"grammar": "root ::= x"}, 422, "grammar: Extra inputs are not permitted"),
        ({"regex": "a" * 2001}, 413, "has 2001 characters; the limit is 2000"),
        ({"choice": ["a" * 1000, "b" * 1001]}, 413, "the limit is 2000"),
        ({"regex": "(" * 600 + ")" * 600}, 413, "nested too deeply"),
    ],
)
def test_invalid_or_too_large_constraints_are_refused(client, structured: dict, status: int, words: str) -> None:
    for route in ("/v1/generate", "/v1/completions"):
        response = client.post(route, json={"model": BPE, "prompt": "x", "structured_outputs": structured})
        assert response.status_code == status, response.text
        assert words in response.json()["error"]["message"]


def test_a_lone_surrogate_is_refused(client) -> None:
    """JSON can spell a lone surrogate ("\\ud800"), which no UTF-8 text holds."""
    for structured in ('{"choice": ["a", "\\ud800"]}', '{"regex": "a\\ud800"}'):
        body = f'{{"model": "{BPE}", "prompt": "x", "structured_outputs": {structured}}}'
        response = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 422, response.text


def test_a_constraint_over_a_limit_per_token_ends_alone(client, monkeypatch) -> None:
    """llguidance's work per token is bounded (lexer fuel); a sequence past it ends with 413, the others go on."""
    monkeypatch.setattr(server.structured.outputs, "_LIMITS", llguidance.LLParserLimits(step_lexer_fuel=1000))
    free = {"model": BPE, "prompt": "x", "max_tokens": 20, "seed": 1}
    costly = {**free, "structured_outputs": {"regex": r"(\w+\s){1,99}"}}
    with ThreadPoolExecutor(2) as pool:
        refused, answered = pool.map(lambda body: client.post("/v1/generate", json=body), [costly, free])
    assert refused.status_code == 413 and "too many expressions" in refused.json()["error"]["message"]
    assert answered.status_code == 200 and answered.json()["text"]


def test_a_lexer_out_of_fuel_is_refused_when_compiled(client) -> None:
    """(x{1000}){1000} spends llguidance's lexer fuel on its start, which llguidance reports only when a token is
    consumed: the compile finds it, so the answer is 413 (a stream never starts), not a 500 at the first token."""
    body = {"model": BPE, "prompt": "Answer:", "max_tokens": 64, "structured_outputs": {"regex": "(x{1000}){1000}"}}
    for route, stream in (("/v1/completions", False), ("/v1/generate", True)):
        response = client.post(route, json={**body, "stream": stream})
        assert response.status_code == 413, response.text
        assert "too many expressions constructed (a limit of llguidance's)" in response.json()["error"]["message"]


def test_a_limit_met_while_decoding_is_413_not_500(client, monkeypatch) -> None:
    """A token that llguidance refuses because one of its limits was reached (not because the mask forbade it) ends
    the sequence with 413; llguidance's own wording (``Constraint.failure``) is checked with a real matcher below."""
    original = server.structured.outputs.Constraint.consume

    def consume(self, token: int) -> bool:  # the third token meets the limit
        self.consumed = getattr(self, "consumed", 0) + 1
        if self.consumed < 3:
            return original(self, token)
        self.limit_met = "lexer error: too many expressions constructed"
        return False

    monkeypatch.setattr(server.structured.outputs.Constraint, "consume", consume)
    monkeypatch.setattr(
        server.structured.outputs.Constraint, "error", property(lambda self: getattr(self, "limit_met", None))
    )
    # 40 letters: no two tokens of the model complete it (with 10, a sample of two long tokens matched before the third)
    response = client.post(
        "/v1/generate",
        json={"model": BPE, "prompt": "x", "max_tokens": 60, "structured_outputs": {"regex": "[a-z]{40}"}},
    )
    assert response.status_code == 413, response.text
    assert "too many expressions constructed (a limit of llguidance's)" in response.json()["error"]["message"]


def test_llguidance_limit_errors_are_413_and_others_500() -> None:
    vocabulary = server.structured.outputs.ConstraintVocabulary(
        load_tokenizer("file:tokenizer.tiktoken", BPE_RANKS.parent)
    )
    text = llguidance.LLMatcher.grammar_from_regex(plain_regex("(ab{500}){200}"))
    limits = llguidance.LLParserLimits(initial_lexer_fuel=10_000, verbose_errors=False)  # spent on the start
    matcher = llguidance.LLMatcher(vocabulary.lltokenizer, text, log_level=0, limits=limits)
    budget = server.structured.outputs.MaskBudget(per_token_s=10.0, total_s=10.0)
    constraint = server.structured.outputs.CompiledConstraint(matcher, vocabulary, budget).start()
    constraint.fill(np.empty(vocabulary.words, dtype=np.int32))  # spends the fuel (allows "ab" all the same)
    ab = vocabulary.lltokenizer.tokenize_str("ab")[0]
    assert not constraint.consume(ab)
    failure = constraint.failure(ab)
    assert isinstance(failure, InputTooLarge) and "too many expressions constructed" in failure.message
    other = server.structured.outputs.CompiledConstraint(
        llguidance.LLMatcher(vocabulary.lltokenizer, text, log_level=0), vocabulary, budget
    ).start()
    assert not other.consume(vocabulary.lltokenizer.tokenize_str("b")[0])  # not allowed: the sampler's bug, a 500
    assert isinstance(other.failure(), ModelFailure)


def test_a_mask_past_its_budget_ends_its_sequence_alone(models_dir, monkeypatch) -> None:
    """A mask that takes too long (here: held until the test lets it go, as (ab{500}){200}'s took 5 s
    each) ends its sequence with 413 after structured_mask_timeout_s; the engine does not wait for it, so a plain
    request beside it answers while it is still held. Its request's other sequences end without computing theirs
    (one held mask, not three); the same constraint is then refused at once, and another one gets 429 while
    MAX_LEFT_BEHIND masks are still held."""
    entered, release, released_by_test = threading.Event(), threading.Event(), []
    original = server.structured.outputs.Constraint.fill

    def held_fill(self, bitmask) -> None:
        if threading.current_thread().name == "regularlm-masks":  # decoding (the compile's first mask is not held)
            entered.set()
            released_by_test.append(release.wait(60))
        original(self, bitmask)

    monkeypatch.setattr(server.structured.outputs.Constraint, "fill", held_fill)
    monkeypatch.setattr(server.structured.outputs, "MAX_LEFT_BEHIND", 1)
    app = create_app(make_settings(models_dir, structured_mask_timeout_s=0.05))
    try:
        with TestClient(app) as test_client, ThreadPoolExecutor(1) as pool:
            app.state.engine.wait_loaded()
            plain = {"model": BPE, "prompt": "Answer:", "max_tokens": 8}
            costly = {**plain, "structured_outputs": {"regex": "[a-z]{5}"}, "n": 3}
            refused = pool.submit(test_client.post, "/v1/completions", json=costly)
            assert entered.wait(60)
            answered = test_client.post("/v1/completions", json=plain)
            assert answered.status_code == 200 and answered.json()["choices"][0]["text"]
            assert refused.result().status_code == 413, refused.result().text
            assert "took longer than 0.05 s (REGULARLM_STRUCTURED_MASK_TIMEOUT_S)" in refused.result().text
            again = test_client.post("/v1/completions", json=costly)
            assert again.status_code == 413 and "for an earlier request" in again.text
            other = test_client.post("/v1/completions", json={**plain, "structured_outputs": {"regex": "[0-9]+"}})
            assert other.status_code == 429 and "past their time budget" in other.text
            assert not release.is_set() and server.structured.outputs._MASK_THREADS.left_behind == 1
    finally:
        release.set()
    for _ in range(600):  # the held mask's thread ends once it is let go
        if server.structured.outputs._MASK_THREADS.left_behind == 0:
            break
        threading.Event().wait(0.01)
    assert server.structured.outputs._MASK_THREADS.left_behind == 0
    assert released_by_test == [True]  # every answer above came while the mask was held


def test_masks_past_the_budget_in_all_end_the_sequence(models_dir) -> None:
    app = create_app(make_settings(models_dir, structured_mask_budget_s=1e-6))
    with TestClient(app) as test_client:
        app.state.engine.wait_loaded()
        body = {"model": BPE, "prompt": "x", "max_tokens": 8, "structured_outputs": {"regex": "[a-z]{5}"}}
        response = test_client.post("/v1/generate", json=body)
        assert response.status_code == 413 and "over the 1e-06 s a sequence may take" in response.text
        with test_client.stream("POST", "/v1/generate", json={**body, "stream": True}) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert streamed.status_code == 200 and "over the 1e-06 s a sequence may take" in events[-2], events
        assert events[-1] == "data: [DONE]"
        free = test_client.post("/v1/generate", json={"model": BPE, "prompt": "x", "max_tokens": 3})
        assert free.status_code == 200


def test_transducers_have_no_structured_outputs(client) -> None:
    body = {"model": "parity-lrnn", "prompt": "01", "structured_outputs": {"regex": "a"}}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 422 and "applies to language models" in response.json()["error"]["message"]


def test_a_slow_compile_is_refused_and_does_not_hold_the_engine(models_dir) -> None:
    app = create_app(make_settings(models_dir, structured_compile_timeout_s=0.05))
    with TestClient(app) as test_client:
        app.state.engine.wait_loaded()
        slow = "(?i)" + "".join(chr(0x4E00 + index) for index in range(40))  # 40 case-folded scans of every character
        body = {"model": BPE, "prompt": "x", "structured_outputs": {"regex": slow}}
        response = test_client.post("/v1/generate", json=body)
        assert response.status_code == 413 and "did not compile within 0.05 s" in response.json()["error"]["message"]
        free = test_client.post("/v1/generate", json={"model": BPE, "prompt": "x", "max_tokens": 3})
        assert free.status_code == 200


# --- batching ------------------------------------------------------------------------------------------------


def test_constrained_and_free_sequences_share_decode_steps(client, monkeypatch) -> None:
    steps: list[tuple[int, int]] = []  # (rows, constrained rows) of each sampling call with a constrained row
    original = server.execution.generation._constrain

    def recording(sequences, logits, metrics, masks=None):
        steps.append((len(sequences), sum(sequence.constraint is not None for sequence in sequences)))
        return original(sequences, logits, metrics, masks)

    # long enough that the constrained request (its regex compiled off the engine thread first) joins its decoding
    free_body = {"model": BPE, "prompt": "Once", "max_tokens": 1500, "seed": 8, "n": 2}
    alone = client.post("/v1/completions", json=free_body).json()["choices"]
    monkeypatch.setattr(server.execution.generation, "_constrain", recording)
    constrained_body = {**free_body, "structured_outputs": {"regex": "[0-9]{30,40}"}, "seed": 9}
    with ThreadPoolExecutor(2) as pool:
        free, constrained = pool.map(
            lambda body: client.post("/v1/completions", json=body).json()["choices"], [free_body, constrained_body]
        )
    assert [choice["text"] for choice in free] == [choice["text"] for choice in alone]  # masks stay in their rows
    assert all(re.fullmatch("[0-9]{30,40}", choice["text"]) for choice in constrained)
    assert any(rows > constrained_rows > 0 for rows, constrained_rows in steps), steps


# --- fuzzing -------------------------------------------------------------------------------------------------


def random_regex(rng: np.random.Generator, alphabet: str, depth: int = 0) -> str:
    """A random pattern over ``alphabet``: symbols, classes (also \\d and \\s), concatenation, alternation, ?, *, +,
    {m,n}, (?i:...)."""
    if depth >= 3 or rng.random() < 0.35:
        kind = rng.integers(6)
        if kind == 0:
            return "[" + "".join(sorted(set(rng.choice(list(alphabet), size=2)))) + "]"
        if kind == 1 and depth:
            return str(rng.choice([r"\d", r"\s", "[0-2]"]))
        return re.escape(str(rng.choice(list(alphabet))))
    parts = [random_regex(rng, alphabet, depth + 1) for _ in range(int(rng.integers(1, 4)))]
    kind = rng.integers(7)
    if kind == 0:
        return "".join(parts)
    if kind == 1:
        return "(" + "|".join(parts) + ")"
    if kind == 2:
        return "(?i:" + "".join(parts) + ")"
    lower = int(rng.integers(0, 3))
    suffix = ["*", "+", "?", f"{{{lower},{lower + int(rng.integers(0, 3))}}}"][kind - 3]
    return "(" + "".join(parts) + ")" + suffix


def test_random_regexes_constrained_samples_all_fullmatch(client) -> None:
    """220 random patterns, 2 seeded samples each (temperatures 0 to 1.5, top-k, top-p, streamed every fifth); the
    end-of-text token's logit is raised so that samples end soon, but only where the constraint allows it. A sample
    cut at max_tokens ("length": its pattern rarely lets it end) must be a prefix of a match (the ``regex``
    package's partial matching; re has none); all others must fullmatch."""
    rng = np.random.default_rng(0)
    finished = []
    for index in range(220):
        pattern = random_regex(rng, ["ab", "abc", "a b", "xy.", "AbC"][index % 5])
        sampling = {"seed": index, **SAMPLINGS[index % len(SAMPLINGS)]}
        results = complete(
            client,
            {"regex": pattern},
            model=BPE if index % 3 else BPE_GPT,
            n=2,
            max_tokens=64,
            logit_bias={str(BPE_END): 4},
            **sampling,
        )
        for text, reason in results:
            if reason == "length":  # a character cut in the middle by max_tokens decodes as U+FFFD
                assert regex.fullmatch(pattern, text.rstrip("\ufffd"), partial=True), (pattern, text, sampling)
            else:
                assert reason == "stop" and re.fullmatch(pattern, text), (pattern, text, reason, sampling)
            finished.append(reason == "stop")
    assert len(finished) == 440 and sum(finished) >= 420


def test_openai_client_sends_structured_outputs_through_extra_body(models_dir) -> None:
    with serve(make_settings(models_dir)) as live:
        oai = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        completion = oai.completions.create(
            model=BPE,
            prompt="Answer:",
            max_tokens=16,
            n=3,
            seed=1,
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
        )
        assert [choice.text in ("yes", "no") for choice in completion.choices] == [True] * 3
        stream = oai.completions.create(
            model=BPE,
            prompt="{",
            max_tokens=64,
            stream=True,
            seed=2,
            extra_body={"structured_outputs": {"json": PERSON}},
        )
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        jsonschema.validate(json.loads(text), PERSON)
        with pytest.raises(openai.UnprocessableEntityError, match="look-ahead"):
            oai.completions.create(model=BPE, prompt="x", extra_body={"structured_outputs": {"regex": "(?!a)"}})
