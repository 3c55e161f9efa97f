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


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character each byte is
    written as in a byte-level BPE vocabulary -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenPieces:
    """Each token's own bytes and text, as OpenAI's logprobs report them: the bytes the
    token stands for (a byte-level BPE token may hold part of a UTF-8 character), and
    their text (invalid UTF-8 shown as \\x escapes)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        try:
            decoder = tokenizer.backend_tokenizer.decoder
        except AttributeError:  # a slow tokenizer: pieces are read the SentencePiece way
            decoder = None
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._bytes = _byte_decoder() if self._byte_level else {}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token: int) -> tuple[str, bytes]:
        hit = self._cache.get(token)
        if hit is None:
            if len(self._cache) > 1 << 16:
                self._cache.clear()
            b = self._piece_bytes(token)
            hit = self._cache[token] = (b.decode("utf-8", errors="backslashreplace"), b)
        return hit

    def _piece_bytes(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if not isinstance(piece, str):  # outside the vocabulary
            return b""
        if self._byte_level:
            try:
                return bytes(self._bytes[c] for c in piece)
            except KeyError:  # an added token written as plain text
                return piece.encode()
        # SentencePiece: '▁' is a space, <0xNN> a byte of its own (byte fallback)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()
