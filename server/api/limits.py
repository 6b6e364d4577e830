"""Size limits of a request body, checked on the parsed JSON before the request model validates it, so that a body
far past a limit costs a few ``len`` calls, not its validation (413 naming the setting). Fields of the wrong type
are left to the request model (422). The limits that need the served model (its context length) are checked
after validation, in ``server/api/serving.py``."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

from server.api.protocol import CompletionRequest, GenerateRequest, TransduceRequest
from server.errors import InputTooLarge
from server.settings import Settings

BodyCheck = Callable[[Any, Settings], None]
JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def count_values(body: bytes) -> int:
    """An upper bound on the JSON values in ``body``, object keys included: a value after the first of an array or
    object follows a comma, the first follows its bracket, and a key's value follows its colon (commas, brackets and
    colons inside strings are counted too). C speed: ~3 ms a MB."""
    return body.count(b",") + body.count(b"[") + body.count(b"{") + body.count(b":") + 1


async def check_body_values(body: bytes, settings: Settings) -> None:
    """413 if the body holds more than ``max_body_values`` JSON values: :func:`count_values`, and where that bound is
    over the limit, :func:`values_outside_strings` on a thread (a Python loop: the event loop runs between its steps)."""
    limit = settings.max_body_values
    if count_values(body) <= limit:
        return
    if await asyncio.to_thread(values_outside_strings, body, limit) > limit:
        raise InputTooLarge(f"the body holds more than {limit} JSON values, the limit (max_body_values)")


def values_outside_strings(body: bytes, limit: int) -> int:
    """:func:`count_values` of ``body`` without what its strings hold: exact up to ``limit``; a count over ``limit``
    as soon as the part read so far holds more (what strings hold is only taken away as they are read)."""
    inside = prefix = read = 0
    for number, match in enumerate(JSON_STRING.finditer(body)):
        start, end = match.span()
        inside += _separators(body, start, end)
        if number % 4096 == 4095:
            prefix, read = prefix + _separators(body, read, end), end
            if prefix - inside + 1 > limit:
                return prefix - inside + 1
    return count_values(body) - inside


def _separators(body: bytes, start: int, end: int) -> int:
    return (
        body.count(b",", start, end)
        + body.count(b"[", start, end)
        + body.count(b"{", start, end)
        + body.count(b":", start, end)
    )


def check_sampling(data: dict[str, Any], settings: Settings) -> None:
    """stop strings (count and characters) and logit_bias entries."""
    stop = data.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    if len(stops) > settings.max_stop_strings:
        raise InputTooLarge(
            f"stop has {len(stops)} strings; the limit is {settings.max_stop_strings} (max_stop_strings)"
        )
    characters = sum(len(each) for each in stops if isinstance(each, str))
    if characters > settings.max_stop_chars:
        raise InputTooLarge(
            f"the stop strings have {characters} characters together; the limit is {settings.max_stop_chars} "
            "(max_stop_chars)"
        )
    bias = data.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > settings.max_logit_bias:
        raise InputTooLarge(
            f"logit_bias has {len(bias)} entries; the limit is {settings.max_logit_bias} (max_logit_bias)"
        )


def check_generate(data: Any, settings: Settings) -> None:
    if isinstance(data, dict):
        check_sampling(data, settings)


def check_completion(data: Any, settings: Settings) -> None:
    """Also: prompts in a list and ``n`` (each at most ``max_inputs``), a token-id prompt's length (at most
    ``max_input_symbols``) and the token ids of all prompts together (at most ``max_request_symbols``)."""
    if not isinstance(data, dict):
        return
    check_sampling(data, settings)
    n, prompt = data.get("n"), data.get("prompt")
    if isinstance(n, int) and n > settings.max_inputs:
        raise InputTooLarge(f"n is {n}; the limit is {settings.max_inputs} (max_inputs)")
    if not isinstance(prompt, list) or not prompt:
        return
    if isinstance(prompt[0], (str, list)):
        if len(prompt) > settings.max_inputs:
            raise InputTooLarge(
                f"the prompt lists {len(prompt)} prompts; the limit is {settings.max_inputs} (max_inputs)"
            )
        token_lists = [each for each in prompt if isinstance(each, list)]
    else:
        token_lists = [prompt]
    for position, tokens in enumerate(token_lists):
        if len(tokens) > settings.max_input_symbols:
            raise InputTooLarge(
                f"prompt {position} has {len(tokens)} token ids; the limit is {settings.max_input_symbols} "
                "(max_input_symbols)"
            )
    total = sum(map(len, token_lists))
    if total > settings.max_request_symbols:
        raise InputTooLarge(
            f"the prompts have {total} token ids together; the limit is {settings.max_request_symbols} "
            "(max_request_symbols)"
        )


def check_transduce(data: Any, settings: Settings) -> None:
    """inputs: at most ``max_inputs`` (their symbols are counted after validation)."""
    inputs = data.get("inputs") if isinstance(data, dict) else None
    if isinstance(inputs, list) and len(inputs) > settings.max_inputs:
        raise InputTooLarge(f"{len(inputs)} inputs; the limit is {settings.max_inputs} per request (max_inputs)")


BODY_CHECKS: dict[type, BodyCheck] = {
    CompletionRequest: check_completion,
    GenerateRequest: check_generate,
    TransduceRequest: check_transduce,
}
