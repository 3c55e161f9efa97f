"""Prompt lookup: the longest earlier suffix match, its latest occurrence, up to k tokens
after it; incremental (extending in pieces gives the same proposals as all at once)."""

from __future__ import annotations

import random

import pytest

from engine.core.drafts import Draft, PromptLookup


def lookup(tokens, **kw) -> PromptLookup:
    pl = PromptLookup(**kw)
    pl.extend(tokens)
    return pl


def brute(tokens, k, max_ngram=3, min_ngram=1):
    """The definition, by scanning: for n from max_ngram down, the latest start j < L - n
    with tokens[j:j+n] == the suffix; the copy runs on through its own output."""
    L = len(tokens)
    for n in range(min(max_ngram, L), min_ngram - 1, -1):
        suffix = tokens[L - n:]
        for j in range(L - n - 1, -1, -1):
            if tokens[j:j + n] == suffix:
                seq = list(tokens)
                for i in range(j + n, j + n + k):
                    seq.append(seq[i])
                return seq[L:]
    return []


def test_copies_what_followed_the_suffix_before():
    #      0  1  2  3  4  5  6  7  8
    toks = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert lookup(toks).propose(2) == [8, 9]
    assert lookup(toks).propose(5) == [8, 9, 1, 5, 6]


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # the suffix (1, 2, 3) occurred at 0; "3" alone occurred more recently, followed by 9
    toks = [1, 2, 3, 4, 3, 9, 1, 2, 3]
    assert lookup(toks).propose(1) == [4]
    # with trigrams off, the bigram (2, 3) still points at 4; unigrams only: the latest 3 -> 9
    assert lookup(toks, max_ngram=2).propose(1) == [4]
    assert lookup(toks, max_ngram=1).propose(1) == [9]


def test_latest_occurrence_of_the_same_ngram_wins():
    toks = [1, 2, 10, 1, 2, 20, 1, 2]
    assert lookup(toks).propose(1) == [20]


def test_no_match_no_proposal_and_min_ngram_is_respected():
    assert lookup([1, 2, 3, 4]).propose(3) == []
    assert lookup([]).propose(3) == []
    toks = [7, 1, 2, 7]          # only a unigram (7) matches
    assert lookup(toks).propose(2) == [1, 2]
    assert lookup(toks, min_ngram=2).propose(2) == []
    assert lookup(toks).propose(0) == []


def test_a_repeating_pattern_runs_on_past_the_end():
    toks = [4, 5, 4, 5, 4]
    # suffix (5, 4) last seen at 1..2, followed by (5, 4) then the end: the copy continues
    assert lookup(toks).propose(5) == [5, 4, 5, 4, 5]
    assert lookup([3, 3]).propose(4) == [3, 3, 3, 3]


def test_the_suffix_never_matches_itself():
    # a single occurrence of everything: nothing to copy, even though the suffix is "in" it
    assert lookup([1, 2, 3]).propose(2) == []


@pytest.mark.parametrize("max_ngram,min_ngram", [(3, 1), (4, 2), (1, 1)])
def test_matches_the_brute_force_definition_and_is_incremental(max_ngram, min_ngram):
    rng = random.Random(1234)
    for trial in range(60):
        toks = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        whole = lookup(toks, max_ngram=max_ngram, min_ngram=min_ngram)
        pieces = PromptLookup(max_ngram, min_ngram)
        i = 0
        while i < len(toks):
            j = i + rng.randrange(1, 5)
            pieces.extend(toks[i:j])
            i = j
            k = rng.randrange(1, 7)
            want = brute(toks[:len(pieces)], k, max_ngram, min_ngram)
            assert pieces.propose(k) == want, (trial, toks[:len(pieces)], k)
        assert whole.propose(5) == brute(toks, 5, max_ngram, min_ngram)


def test_after_reads_through_unverified_tokens_without_storing_them():
    toks = [1, 2, 3, 4, 5, 9, 1, 2]
    pl = lookup(toks)
    assert pl.propose(2) == [3, 4]
    # assuming (3, 4) gets accepted, the next round's guess continues the quote
    assert pl.propose(2, after=[3, 4]) == [5, 9]
    assert pl.propose(3, after=[3, 4]) == brute(toks + [3, 4], 3)
    # nothing was stored: the plain proposal is unchanged, and so is the length
    assert pl.propose(2) == [3, 4] and len(pl) == len(toks)
    # a continuation that only matches within the unverified tokens: not indexed, no guess
    assert lookup([8]).propose(2, after=[6, 7]) == []


def test_a_long_context():
    rng = random.Random(0)
    toks = [rng.randrange(32000) for _ in range(100_000)]
    pl = lookup(toks)
    # the index holds at most (max - min + 1) entries per token, and a proposal is a
    # handful of lookups: compare against a quoted tail, found at its latest occurrence
    assert len(pl._next) <= 3 * len(toks)
    pl.extend(toks[500:520])
    assert pl.propose(4) == toks[520:524]


def test_draft_record():
    d = lookup([1, 2, 1]).draft(3)
    assert d == Draft((2, 1, 2)) and d.deterministic and len(d) == 3
    with pytest.raises(ValueError):
        Draft((1, 2), probs=[[1.0]])
    with pytest.raises(ValueError):
        PromptLookup(max_ngram=1, min_ngram=2)
