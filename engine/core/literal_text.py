"""A chat message's text stays text: control tokens written in it are not the model's.

A tokenizer reads "<|im_end|><|im_start|>system" anywhere in a rendered chat as the
model's own turn markers, so a message holding them could close its turn and open a
system one (an app that puts a web page or a file into a message hands that page the
pen). OpenAI's API reads message content literally; so does this: the template's own
markers stay markers, the messages' copies of them are tokenized as plain characters.

Only conversations whose text holds a marker take this path (the others are tokenized
exactly as before). Pure: the tokenizer comes in as two callables.
"""

from __future__ import annotations

from typing import Callable

# private-use characters: no template writes them, and each is one code point
_OPEN, _CLOSE = "\ue000", "\ue001"


class ControlTextError(ValueError):
    """A message holds control text that could not be kept literal (the chat template
    rewrote it): refused rather than read as the model's markers."""


def holds_control(text: object, markers: list[str]) -> bool:
    return isinstance(text, str) and any(m in text for m in markers)


def literal_chat_ids(messages: list[dict], markers: list[str], render: Callable[[list[dict]], str],
                     encode: Callable[[str, bool], list[int]]) -> list[int] | None:
    """The conversation's token ids with every message's markers taken as text, or None
    where no message holds one (tokenize as usual). render: messages -> the template's
    string; encode(text, literal): ids, markers split into plain tokens when literal.

    Each marked message's content is swapped for a sentinel, the template rendered around
    the sentinels, and the content tokenized literally in its place: the template's text
    and markers are the same as in the real rendering (checked: the sentinels put back
    must give it exactly, whitespace trimmed by the template included)."""
    marked = [i for i, m in enumerate(messages) if holds_control(m.get("content"), markers)]
    if not marked:
        return None
    real = render(messages)
    stand_in = [dict(m) for m in messages]
    for n, i in enumerate(marked):
        stand_in[i]["content"] = f"{_OPEN}{n}{_CLOSE}"
    frame = render(stand_in)
    pieces: list[tuple[str, bool]] = []     # (text, literal)
    rest = frame
    for n, i in enumerate(marked):
        sentinel = f"{_OPEN}{n}{_CLOSE}"
        if rest.count(sentinel) != 1:
            raise ControlTextError("a message holds the model's control text (such as "
                                   f"{_first_marker(messages[i]['content'], markers)!r}) and this model's chat "
                                   "template repeats or drops it, so it cannot be kept as plain text")
        before, rest = rest.split(sentinel, 1)
        pieces.append((before, False))
        pieces.append((messages[i]["content"], True))
    pieces.append((rest, False))
    # the template may trim a message (Llama 3's does): then the trimmed text is what it holds
    for trim in (False, True):
        candidate = [(t.strip() if trim and lit else t, lit) for t, lit in pieces]
        if "".join(t for t, _ in candidate) == real:
            ids: list[int] = []
            for text, literal in candidate:
                if text:
                    ids.extend(encode(text, literal))
            return ids
    raise ControlTextError("a message holds the model's control text (such as "
                           f"{_first_marker(messages[marked[0]]['content'], markers)!r}) and this model's chat "
                           "template changes it, so it cannot be kept as plain text")


def _first_marker(text: str, markers: list[str]) -> str:
    return min((m for m in markers if m in text), key=text.index)
