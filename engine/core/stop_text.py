"""A reply's text against its stop sequences, released only once it cannot be a stop's start.

A stop sequence ends a reply before it: `"stop": ["How can I"]` on "Hello! How can I
help?" answers "Hello! ". Tokens come one at a time, and a stop of several tokens shows
only when its last one arrives: released at once, "How" and " can" would already have
been streamed by then, and no later step can take them back. So a token's text is held
while the reply's end could still be the start of a stop (as vLLM and TGI do), and
released as soon as it cannot: a reply with no stop sequence is released token by token,
as before.

Each token's text goes in with what travels with it (its id and log-probability: the
payload), and comes out whole with it, so what a client reads still lines each token up
with its text; the one cut is the piece a stop begins in, released up to the stop. The
pieces after a stop are dropped with theirs, as the token that completes a stop always
was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StopText:
    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.text = ""            # the reply so far, up to a stop once one is found
        self.stopped = False
        self._released = 0        # characters of text handed out
        self._held: list[tuple[str, Any]] = []

    def add(self, piece: str, payload: Any) -> list[tuple[str, Any]]:
        """One token's text: the pieces that may be released now, in order."""
        if self.stopped:
            raise ValueError("the reply already ended at a stop sequence")
        before = len(self.text)
        self.text += piece
        self._held.append((piece, payload))
        at = self._first_stop(before)
        if at is not None:
            self.stopped = True
            self.text = self.text[:at]
            return self._release(at, cut=True)
        return self._release(len(self.text) - self._holdback())

    def flush(self) -> list[tuple[str, Any]]:
        """The reply ended otherwise (its end token, max_tokens): all that is held is reply."""
        return self._release(len(self.text))

    def _first_stop(self, before: int) -> int | None:
        """Where the earliest stop that this piece completes begins (a stop wholly
        before the piece would have ended the reply already)."""
        found = [at for stop in self.stops
                 if (at := self.text.find(stop, max(0, before - len(stop) + 1))) != -1]
        return min(found) if found else None

    def _holdback(self) -> int:
        """How many of the text's last characters could begin a stop."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def _release(self, upto: int, cut: bool = False) -> list[tuple[str, Any]]:
        """Hand out the held pieces that end by `upto`; with cut (a stop at `upto`), the
        piece it begins in up to it, and none after."""
        out: list[tuple[str, Any]] = []
        pos = self._released
        while self._held:
            piece, payload = self._held[0]
            end = pos + len(piece)
            if end <= upto:
                out.append(self._held.pop(0))
                pos = end
            elif cut and pos < upto:
                out.append((piece[:upto - pos], payload))
                pos = upto
                self._held.clear()
            else:
                if cut:
                    self._held.clear()
                break
        self._released = pos
        return out
