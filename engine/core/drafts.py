"""Drafts the host proposes for speculative decoding (issue 34): what a draft is, and the
free one, prompt lookup.

A *draft* is up to k tokens the host guesses will come next; the pipeline checks all of
them in one trip (engine/core/spec_verify.py) and keeps the longest correct prefix. A
model draft also carries its own distribution per position, which the sampled
verification needs; a deterministic draft (prompt lookup) carries none, and is then
verified as a draft with all its mass on the proposed token.

Prompt lookup copies from the context: replies quote their prompt (code edits,
summaries, RAG) and repeat themselves, so the tokens that followed the last earlier
occurrence of the context's suffix are a good guess for what follows now. It costs no
GPU and no memory worth mentioning, so it is the draft every host has.

Cost: the index maps every n-gram (min_ngram <= n <= max_ngram) to the position of
the token that followed its most recent occurrence, kept up to date as tokens are
appended (max_ngram - min_ngram + 1 dict writes per token), so a proposal is
max_ngram - min_ngram + 1 lookups and a copy of k tokens whatever the context's length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence

DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 1


@dataclass(frozen=True)
class Draft:
    """One round's proposal.

    tokens: the proposed ids, in order; may be fewer than asked (or none: no guess, and
        the round is a plain decode step).
    probs: for a model draft, its distribution at each proposed position, a
        [len(tokens), V] tensor whose rows sum to 1 (spec_verify.verify_sampled's
        draft_probs); None for a deterministic draft such as prompt lookup. Typed Any
        because core does not import torch (tests/test_layers.py).
    """
    tokens: tuple[int, ...]
    probs: Any = None

    def __post_init__(self):
        if self.probs is not None and len(self.probs) != len(self.tokens):
            raise ValueError(f"a draft of {len(self.tokens)} tokens carries {len(self.probs)} distributions")

    @property
    def deterministic(self) -> bool:
        return self.probs is None

    def __len__(self) -> int:
        return len(self.tokens)


class Drafter(Protocol):
    """What the head asks of a draft source, per sequence: it is told every token the
    sequence has (the prompt, then each emitted token; never a rejected guess) and asked
    for up to k next tokens."""

    def extend(self, tokens: Iterable[int]) -> None: ...

    def draft(self, k: int) -> Draft: ...


class PromptLookup:
    """N-gram prompt lookup over one sequence's tokens (prompt + generated so far).

    propose(k): the longest suffix n-gram (max_ngram down to min_ngram) that occurred
    earlier, and the up to k tokens that followed its most recent earlier occurrence.
    The most recent, because a reply that is quoting is quoting the latest thing it
    quoted; and the longest n-gram, because a longer match is a likelier continuation
    (a unigram match is weak, which is why min_ngram may be raised to 2).
    """

    def __init__(self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM):
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._tokens: list[int] = []
        # n-gram (a tuple; its length is n, so one dict holds every n) -> the position of
        # the token that followed its latest occurrence. An n-gram enters only once a token
        # follows it, so the context's own suffix never matches itself.
        self._next: dict[tuple[int, ...], int] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        toks, index = self._tokens, self._next
        for t in tokens:
            i = len(toks)   # the new token's position: it follows the n-grams ending at i - 1
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                index[tuple(toks[i - n:i])] = i
            toks.append(int(t))

    def propose(self, k: int, after: Sequence[int] = ()) -> list[int]:
        """Up to k guessed next tokens ([] when no suffix n-gram occurred before).

        after: tokens assumed appended but not yet known to be right (a draft still
        being verified, issue 34's overlap): the suffix and the copy read through them,
        but n-grams inside them are not in the index, and nothing is stored.
        """
        if k <= 0:
            return []
        toks = self._tokens
        base, total = len(toks), len(toks) + len(after)

        def at(i: int) -> int:
            return toks[i] if i < base else after[i - base]

        for n in range(min(self.max_ngram, total), self.min_ngram - 1, -1):
            pos = self._next.get(tuple(at(i) for i in range(total - n, total)))
            if pos is None:
                continue
            out: list[int] = []
            for j in range(k):
                i = pos + j
                # past the end, the copy continues with its own first tokens: a repeating
                # pattern (a b a b ...) proposes its continuation rather than stopping short
                out.append(at(i) if i < total else out[i - total])
            return out
        return []

    def draft(self, k: int) -> Draft:
        return Draft(tuple(self.propose(k)))
