"""Generated tokens -> text deltas, with stop strings.

Text is released as soon as it can neither split a UTF-8 character nor be the start of a stop string. When a stop string
appears, the text before it is released and generation stops; the stop string is not part of the output (as in OpenAI's
API). Matching (:class:`StopStrings`, Aho-Corasick) costs O(1) amortized per character.
"""

from __future__ import annotations

from functools import lru_cache

from model.tokenizer import Tokenizer


class StopStrings:
    """An Aho-Corasick automaton over non-empty stop strings; state 0 is the root. ``depth[s]``: the length of the
    longest tail of the text read that begins some stop string; ``match[s]``: the length of the longest stop string
    ending the text read, 0 for none."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth, ends = [0], [False]
        for stop in stops:
            state = 0
            for char in stop:
                following = goto[state].get(char)
                if following is None:
                    following = len(goto)
                    goto[state][char] = following
                    goto.append({})
                    depth.append(depth[state] + 1)
                    ends.append(False)
                state = following
            ends[state] = True
        fail, match = [0] * len(goto), [0] * len(goto)
        frontier = list(goto[0].values())
        for state in frontier:  # breadth first: a state's failure link is shallower, so already linked
            match[state] = depth[state] if ends[state] else 0
        while frontier:
            deeper = []
            for state in frontier:
                for char, child in goto[state].items():
                    link = fail[state]
                    while link and char not in goto[link]:
                        link = fail[link]
                    fail[child] = goto[link].get(char, 0) if goto[link].get(char) != child else 0
                    match[child] = depth[child] if ends[child] else match[fail[child]]
                    deeper.append(child)
            frontier = deeper
        self._goto, self._fail, self.depth, self.match = goto, fail, depth, match

    def step(self, state: int, char: str) -> int:
        """The state after reading ``char`` in ``state``."""
        goto, fail = self._goto, self._fail
        while True:
            following = goto[state].get(char)
            if following is not None:
                return following
            if state == 0:
                return 0
            state = fail[state]


@lru_cache(maxsize=64)
def stop_strings(stops: tuple[str, ...]) -> StopStrings:
    """The automaton of ``stops``, shared by the sequences of a request (``n``) and by repeated requests."""
    return StopStrings(stops)


class TextAssembler:
    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._decoder = tokenizer.stream_decoder()
        self._stop = stop_strings(tuple(stop)) if stop else None
        self._state = 0
        self._eot = tokenizer.eot_token
        self._pending = ""

    def push(self, token: int) -> tuple[str, bool]:
        """Add a generated token: (text to release now, whether a stop string was reached)."""
        text = self._decoder.push(token)
        if self._stop is None:  # nothing to hold back (the common case: once per token of every sequence)
            return text, False
        automaton, state = self._stop, self._state
        for position, char in enumerate(text):
            state = automaton.step(state, char)
            if automaton.match[state]:  # the first stop string to end, the longest of those ending here
                cut = len(self._pending) + position + 1 - automaton.match[state]
                released, self._pending, self._state = (self._pending + text)[:cut], "", 0
                return released, True
        self._state = state
        pending = self._pending + text
        held = automaton.depth[state]
        released, self._pending = pending[: len(pending) - held], pending[len(pending) - held :]
        return released, False

    def whole_answer(self, tokens: list[int]) -> str:
        """A whole answer's text (no stop strings), decoded at its end: its tokens' text but a final end-of-text token,
        then :meth:`finish`'s."""
        assert self._stop is None, "stop strings are looked for token by token"
        return self._decoder.push_many(tokens[:-1] if tokens[-1:] == [self._eot] else tokens) + self.finish()

    def finish(self) -> str:
        """The rest of the text when generation ends without a stop string."""
        released, self._pending = self._pending + self._decoder.flush(), ""
        return released
