"""Generated tokens -> text deltas, with stop strings.

Text is released as soon as it can neither split a UTF-8 character (``StreamDecoder``) nor be the start of
a stop string: a tail that matches the beginning of some stop string is held back until the next token
decides. When a stop string appears, the text before it is released and generation stops; the stop string
itself is not part of the output (as in OpenAI's API).
"""

from __future__ import annotations

from model.tokenizer import Tokenizer


class TextAssembler:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._decoder = tokenizer.stream_decoder()
        self._stop = stop
        self._eot = tokenizer.eot_token
        self._pending = ""

    def push(self, token: int) -> tuple[str, bool]:
        """Add a generated token: (text to release now, whether a stop string was reached)."""
        if not self._stop:  # nothing to hold back (the common case: once per token of every sequence)
            return self._decoder.push(token), False
        self._pending += self._decoder.push(token)
        first_stop = min((i for i in (self._pending.find(stop) for stop in self._stop) if i >= 0), default=-1)
        if first_stop >= 0:
            released, self._pending = self._pending[:first_stop], ""
            return released, True
        held = self._held_back()
        released, self._pending = self._pending[: len(self._pending) - held], self._pending[len(self._pending) - held :]
        return released, False

    def whole_answer(self, tokens: list[int]) -> str:
        """A whole answer's text, decoded at its end (``GenerationRequest.whole_answer``: no stop strings): its
        tokens' text, but for a final end-of-text token, then what :meth:`finish` releases."""
        assert not self._stop, "stop strings are looked for token by token"
        return self._decoder.push_many(tokens[:-1] if tokens[-1:] == [self._eot] else tokens) + self.finish()

    def finish(self) -> str:
        """The rest of the text when generation ends without a stop string."""
        released, self._pending = self._pending + self._decoder.flush(), ""
        return released

    def _held_back(self) -> int:
        """Length of the longest tail of the pending text that begins some stop string."""
        for size in range(min(len(self._pending), max((len(s) for s in self._stop), default=1) - 1), 0, -1):
            tail = self._pending[-size:]
            if any(stop.startswith(tail) for stop in self._stop):
                return size
        return 0
