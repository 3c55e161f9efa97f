"""TokenHistory (engine/model/token_history.py): the distinct tokens it keeps as they
change are the set of its tokens, after appends, truncations and tokens that come back."""

import random

import numpy as np

from engine.model.token_history import TokenHistory


def _same(h: TokenHistory) -> bool:
    d = h.distinct()
    return d.dtype == np.int64 and len(d) == len(set(d.tolist())) and set(d.tolist()) == set(h.tokens)


def test_distinct_tokens_follow_appends_and_truncations():
    h = TokenHistory([5, 7, 5])
    assert sorted(h.distinct().tolist()) == [5, 7] and 5 in h and 9 not in h
    h.append(9)
    h.append(5)
    assert sorted(h.distinct().tolist()) == [5, 7, 9] and list(h) == [5, 7, 5, 9, 5] and len(h) == 5
    h.truncate(3)   # 9 left: gone from the set; 5 is still in the prompt
    assert sorted(h.distinct().tolist()) == [5, 7] and 9 not in h and list(h) == [5, 7, 5]
    h.append(9)     # back again, after the set was rebuilt
    assert sorted(h.distinct().tolist()) == [5, 7, 9]


def test_an_empty_history_and_random_edits_keep_the_set_exact():
    h = TokenHistory()
    assert len(h.distinct()) == 0 and not h
    rng = random.Random(0)
    for _ in range(2000):
        if h.tokens and rng.random() < 0.15:
            h.truncate(rng.randrange(len(h.tokens) + 1))
        else:
            h.append(rng.randrange(40))
        if rng.random() < 0.3:   # asked for now and then, as steps ask
            assert _same(h)
    assert _same(h)
