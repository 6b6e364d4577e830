"""Size limits of a request body, checked on the parsed JSON before the request model validates it (413 naming the
setting); wrong types are left to the request model (422), limits that need the served model to
``server/api/serving.py``.
"""

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
    """An upper bound on the JSON values in ``body``, object keys included (separators inside strings counted too)."""
    return body.count(b",") + body.count(b"[") + body.count(b"{") + body.count(b":") + 1


async def check_body_values(body: bytes, settings: Settings) -> None:
    """413 if the body holds more than ``max_body_values`` JSON values (the exact count, when needed, on a thread)."""
    limit = settings.max_body_values
    if count_values(body) <= limit:
        return
    if await asyncio.to_thread(values_outside_strings, body, limit) > limit:
        raise InputTooLarge(f"the body holds more than {limit} JSON values, the limit (max_body_values)")


def values_outside_strings(body: bytes, limit: int) -> int:
    """:func:`count_values` without what strings hold: exact up to ``limit``; some count over ``limit`` once the part
    read so far exceeds it."""
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
    """Also: ``n`` and the prompts in a list (each at most ``max_inputs``), a token-id prompt's length
    (``max_input_symbols``) and all prompts' token ids together (``max_request_symbols``)."""
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
