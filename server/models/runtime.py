"""Models added while serving (``POST /v1/models``) and removed (``DELETE /v1/models/{id}``): a regular expression or a
DFA compiled into an exact transduce model labelling each prefix "1" when accepted, else "0". Compiling runs on a thread
of its own, one at a time, within ``runtime_compile_timeout_s``. 413 past ``runtime_models_max`` models,
``runtime_model_max_states`` states or RegularGPT's construction caps; 409 for a taken id or a shipped model.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from automata.automaton import DFA, AutomatonError, AutomatonTooLarge
from automata.compiler import COMPILERS, CompileError, CompileTooLarge
from automata.regex import regex_dfa
from model.device import resolve_device
from server.api.protocol import RuntimeModelRequest
from server.errors import Conflict, InputTooLarge, InvalidInput
from server.models.store import ServedModel, served_transducer
from server.settings import Settings

RUNTIME_PATH = Path("runtime")  # what a runtime model's ServedModel.path says (it has no folder)


class RuntimeCompiler:
    """Compiles runtime models off the event loop and the engine thread, one at a time."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._one_at_a_time: asyncio.Semaphore | None = None  # made on the event loop at first use

    async def compile(self, request: RuntimeModelRequest, device: str) -> ServedModel:
        if self._one_at_a_time is None:
            self._one_at_a_time = asyncio.Semaphore(1)
        async with self._one_at_a_time:
            work = asyncio.to_thread(compile_runtime_model, request, self.settings, device)
            try:
                return await asyncio.wait_for(work, self.settings.runtime_compile_timeout_s)
            except asyncio.TimeoutError:  # the thread finishes on its own; its result is dropped
                raise InputTooLarge(
                    f"compiling model {request.id!r} took longer than runtime_compile_timeout_s = "
                    f"{self.settings.runtime_compile_timeout_s} s; simplify the pattern or the automaton"
                ) from None


def compile_runtime_model(request: RuntimeModelRequest, settings: Settings, device: str) -> ServedModel:
    """The request's automaton compiled into a served transduce model (on ``device``)."""
    dfa = _automaton(request)
    most = settings.runtime_model_max_states
    if len(dfa.states) > most:
        raise InputTooLarge(
            f"the minimal DFA of model {request.id!r} has {len(dfa.states)} states; runtime models take at most "
            f"{most} (runtime_model_max_states)"
        )
    try:
        model, config = COMPILERS[request.architecture](dfa)
    except CompileTooLarge as error:  # past RegularGPT's caps
        raise InputTooLarge(str(error)) from None
    except CompileError as error:
        raise InvalidInput(str(error)) from None
    return served_transducer(request.id, model.to(resolve_device(device)).eval(), config, RUNTIME_PATH / request.id)


def _automaton(request: RuntimeModelRequest) -> DFA:
    if (request.regex is None) == (request.dfa is None):
        raise InvalidInput("give exactly one of 'regex' (with 'alphabet') and 'dfa'")
    try:
        if request.regex is not None:
            if request.alphabet is None:
                raise InvalidInput("'regex' needs 'alphabet': the symbols the model reads, e.g. \"01\"")
            return regex_dfa(request.regex, request.alphabet, name=request.id)
        if request.alphabet is not None:
            raise InvalidInput("'alphabet' goes with 'regex'; a DFA names its own alphabet")
        return DFA.from_json(request.dfa)
    except AutomatonTooLarge as error:
        raise InputTooLarge(str(error)) from None
    except AutomatonError as error:
        raise InvalidInput(str(error)) from None


def check_new_id(model_id: str, served: dict[str, ServedModel]) -> None:
    if model_id in served:
        raise Conflict(f"model {model_id!r} exists already; DELETE /v1/models/{model_id} first (runtime models only)")
