"""A sequence's text, one sampled token at a time, at a cost that does not grow with it.

Decoding the whole generated sequence after every token (what the head did first)
costs O(length) per token: for 8 streams of 1,000 tokens, milliseconds per decode
step, spent on the event loop before the next step is launched. As vLLM's incremental
detokenizer does, this decodes a short window instead: the tokens since the last text
that came out whole, plus the ones before them as context (so a tokenizer that drops a
word's leading space at the start of a decode sees the word before it), and emits the
difference. A window that ends inside a multi-byte character (byte-level BPE splits
them) decodes to U+FFFD: nothing is emitted until the next token completes it.

The emitted pieces add up to `tokenizer.decode(tokens, skip_special_tokens=True)`
(tests/test_detok.py checks that on the default model's tokenizer).
"""

from __future__ import annotations


MAX_SPLIT = 8


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.text = ""            # emitted so far
        self._prefix = 0          # window start: context tokens already emitted
        self._read = 0            # tokens up to here are in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> str:
        """Append one token; returns the new text it completes ("" while a character is split)."""
        self.tokens.append(token)
        before = self._decode(self.tokens[self._prefix:self._read])
        window = self._decode(self.tokens[self._prefix:])
        # a UTF-8 character is at most 4 bytes: a longer run that still ends in U+FFFD is
        # invalid output, emitted as such rather than re-decoded at every token
        if window.endswith("\ufffd") and len(self.tokens) - self._read < MAX_SPLIT:
            return ""
        delta = window[len(before):]
        self.text += delta
        self._prefix, self._read = self._read, len(self.tokens)
        return delta
