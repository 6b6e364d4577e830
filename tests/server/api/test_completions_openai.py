"""/v1/completions through the official ``openai`` client against a live server."""

from __future__ import annotations

import os
import re

import openai
import pytest

from server.api.completions import completion_id
from tests.server import reference


@pytest.fixture(scope="module")
def oai(live) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)


def test_greedy_completion(oai, live) -> None:
    completion = oai.completions.create(model="text-lrnn", prompt="Hello", max_tokens=10, temperature=0)
    path = live.engine.models["text-lrnn"].path
    assert completion.object == "text_completion" and completion.model == "text-lrnn"
    assert completion.choices[0].text == reference.text(reference.greedy_tokens(path, "Hello", 10))
    assert completion.choices[0].finish_reason == "length"
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (
        5,
        10,
        15,
    )


def test_stream_with_usage(oai) -> None:
    whole = oai.completions.create(model="text-lstm", prompt="Hi", max_tokens=12, seed=4)
    chunks = list(
        oai.completions.create(
            model="text-lstm", prompt="Hi", max_tokens=12, seed=4, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "length"
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_completion_ids_are_unique_and_shared_by_a_stream_s_chunks(oai) -> None:
    ids = [oai.completions.create(model="text-lrnn", prompt="Hi", max_tokens=1).id for _ in range(3)]
    chunks = list(oai.completions.create(model="text-lrnn", prompt="Hi", max_tokens=3, stream=True))
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", each) for each in ids) and len(set(ids)) == 3
    assert {chunk.id for chunk in chunks} == {chunks[0].id} and chunks[0].id not in ids


def test_a_forked_child_draws_other_completion_ids() -> None:
    """The id generator is seeded again in a forked child (a server forked after import would repeat the ids)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        os.write(write, completion_id().encode())
        os._exit(0)
    os.close(write)
    os.waitpid(child, 0)
    with os.fdopen(read) as pipe:
        assert pipe.read() != completion_id()


@pytest.mark.parametrize("model_id", ["text-lrnn", "text-transformer", "text-regulargpt"])
def test_echo_scores_any_text(model_id: str, oai, live) -> None:
    text = "Scoring any text, even ünïcödé 👋"
    scored = oai.completions.create(model=model_id, prompt=text, max_tokens=0, echo=True, logprobs=0)
    choice = scored.choices[0]
    assert choice.text == text
    token_logprobs = choice.logprobs.token_logprobs
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(
        reference.prompt_logprobs(live.engine.models[model_id].path, text), abs=1e-4
    )
    assert len(choice.logprobs.tokens) == len(text.encode())
    assert choice.logprobs.text_offset[:3] == [0, 1, 2]


def test_echo_with_generation_and_top_logprobs(oai) -> None:
    completion = oai.completions.create(model="text-lrnn", prompt="abc", max_tokens=4, echo=True, logprobs=2, seed=1)
    choice = completion.choices[0]
    assert choice.text.startswith("abc")
    assert len(choice.logprobs.token_logprobs) == 3 + 4
    assert choice.logprobs.top_logprobs[0] is None
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[1:])


def test_several_prompts_and_choices(oai) -> None:
    completion = oai.completions.create(model="text-lrnn", prompt=["one", "two"], n=2, max_tokens=6, seed=9)
    assert [choice.index for choice in completion.choices] == [0, 1, 2, 3]
    assert completion.choices[0].text != completion.choices[1].text  # each choice has its own seed
    again = oai.completions.create(model="text-lrnn", prompt=["one", "two"], n=2, max_tokens=6, seed=9)
    assert [choice.text for choice in again.choices] == [choice.text for choice in completion.choices]
    assert completion.usage.prompt_tokens == 6 and completion.usage.completion_tokens == 24


def test_stop_sequence(oai) -> None:
    full = oai.completions.create(model="text-lrnn", prompt="x", max_tokens=20, seed=2).choices[0].text
    stop = full[4:6]
    cut = oai.completions.create(model="text-lrnn", prompt="x", max_tokens=20, seed=2, stop=stop).choices[0]
    assert cut.text == full[: full.index(stop)] and cut.finish_reason == "stop"


def test_errors_map_to_openai_exceptions(oai) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.UnprocessableEntityError):
        oai.completions.create(model="text-lrnn", prompt="x", suffix="y")


def test_models_retrieve(oai) -> None:
    model = oai.models.retrieve("text-lrnn")
    assert model.id == "text-lrnn" and model.object == "model" and model.owned_by == "regularlm"
    assert {entry.id for entry in oai.models.list()} >= {"text-lrnn", "parity-lrnn"}
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("nope")


def test_prompts_as_token_ids(oai, live) -> None:
    tokenizer = live.engine.models["text-lrnn"].tokenizer
    ids = tokenizer.encode("Hello there")
    as_text = oai.completions.create(model="text-lrnn", prompt="Hello there", max_tokens=5, temperature=0)
    as_ids = oai.completions.create(model="text-lrnn", prompt=ids, max_tokens=5, temperature=0)
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage.prompt_tokens == len(ids)
    batch = oai.completions.create(model="text-lrnn", prompt=[ids, ids[:3]], max_tokens=2, temperature=0)
    assert len(batch.choices) == 2
    echoed = oai.completions.create(model="text-lrnn", prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert echoed.choices[0].text == "Hello there"
    with pytest.raises(openai.UnprocessableEntityError, match="prompt token 1 is id 99999"):
        oai.completions.create(model="text-lrnn", prompt=[ids[0], 99999], max_tokens=1)
    with pytest.raises(openai.UnprocessableEntityError, match="at least 1"):
        oai.completions.create(model="text-lrnn", prompt=[], max_tokens=1)


def test_penalties_and_logit_bias(oai, live) -> None:
    """A +100 bias forces its token; with large frequency and presence penalties greedy decoding never repeats a
    token (the text models here are byte-level: an ASCII character is one token), which it does without them;
    the penalties' ranges are OpenAI's."""
    biased = oai.completions.create(
        model="text-lrnn", prompt="Hello", max_tokens=5, temperature=0, logit_bias={str(ord("q")): 100}
    )
    assert biased.choices[0].text == "q" * 5
    free = oai.completions.create(model="text-lrnn", prompt="Hello", max_tokens=40, temperature=0)
    penalized = oai.completions.create(
        model="text-lrnn", prompt="Hello", max_tokens=40, temperature=0, frequency_penalty=2.0, presence_penalty=2.0
    )

    def most_repeated_ascii(text: str) -> int:
        return max(text.count(character) for character in set(text) if character.isascii())

    assert most_repeated_ascii(free.choices[0].text) > 1
    assert most_repeated_ascii(penalized.choices[0].text) == 1
    with pytest.raises(openai.UnprocessableEntityError):
        oai.completions.create(model="text-lrnn", prompt="x", frequency_penalty=2.5)


def test_chat_is_refused_clearly_without_a_chat_template(oai) -> None:
    with pytest.raises(openai.BadRequestError, match="has no chat template"):
        oai.chat.completions.create(model="text-lrnn", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
