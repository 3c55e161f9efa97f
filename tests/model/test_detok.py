"""Incremental detokenization: the pieces add up to a whole decode, at a bounded cost."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.model.detok import MAX_SPLIT, Detokenizer  # noqa: E402

TEXTS = [
    "The capital of France is Paris.",
    "emoji 😀🎉 and accents: café, naïve — “quotes” … 日本語のテキスト",
    "  leading spaces\n\nnewlines\ttabs   and    runs",
    "code: def f(x):\n    return x ** 2  # square",
]


def pieces(tok, ids):
    d = Detokenizer(tok)
    out = [d.add(i) for i in ids]
    assert d.text == "".join(out)
    return out


def test_pieces_add_up_to_the_whole_decode(default_source):
    tok = default_source.tokenizer()
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert "".join(pieces(tok, ids)) == tok.decode(ids, skip_special_tokens=True) == text


def test_random_tokens_and_special_tokens_match_the_whole_decode(default_source):
    tok = default_source.tokenizer()
    rng = random.Random(0)
    special = list(tok.all_special_ids)
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 50))]
        ids[rng.randrange(len(ids))] = rng.choice(special)
        full = tok.decode(ids, skip_special_tokens=True)
        got = "".join(pieces(tok, ids))
        # a trailing split character is held back until a token completes it
        assert got == full or (full.endswith("\ufffd") and full.startswith(got)), (ids, got, full)


def test_a_split_character_waits_for_its_last_byte(default_source):
    tok = default_source.tokenizer()
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits it
    out = pieces(tok, ids)
    assert out[:-1] == [""] * (len(ids) - 1) and out[-1] == "😀"


def test_each_token_decodes_a_short_window(default_source):
    tok = default_source.tokenizer()
    calls = []

    class Counting:
        def decode(self, ids, skip_special_tokens):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(" ".join(["word"] * 400), add_special_tokens=False)
    d = Detokenizer(Counting())
    for i in ids:
        d.add(i)
    assert max(calls) <= MAX_SPLIT + 2  # not the whole sequence
    assert d.text == tok.decode(ids, skip_special_tokens=True)
