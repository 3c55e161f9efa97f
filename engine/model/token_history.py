"""A sequence's tokens for the repetition penalty, and its distinct tokens as an array.

The repetition penalty acts on every distinct token of a sequence's history (its prompt
and what it drew). Collected afresh each step, that is a set of the whole history and
Python lists of every (row, token) pair turned into tensors element by element: at 16
rows of 192 tokens, most of a millisecond of a small CPU core per step (bench/sampling.py),
spent while the GPU waits for its next step. Here the distinct tokens are kept as they
change: one token per step is counted, an array of them grows by the tokens new to it,
and a step's penalties are concatenated arrays (engine/model/sampler.py `_penalties`).
"""

from __future__ import annotations

import numpy as np


class TokenHistory:
    def __init__(self, tokens=()):
        self.tokens: list[int] = list(tokens)
        self._count: dict[int, int] = {}
        for t in self.tokens:
            self._count[t] = self._count.get(t, 0) + 1
        self._distinct: np.ndarray | None = None   # None: rebuilt from _count when asked
        self._new: list[int] = []                  # distinct tokens since the array was built

    def __len__(self) -> int:
        return len(self.tokens)

    def __iter__(self):
        return iter(self.tokens)

    def __contains__(self, token: int) -> bool:
        return token in self._count

    def append(self, token: int) -> None:
        self.tokens.append(token)
        c = self._count.get(token, 0)
        self._count[token] = c + 1
        if c == 0 and self._distinct is not None:
            self._new.append(token)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens (a verification step's rejected picks leave)."""
        for t in self.tokens[n:]:
            c = self._count[t] - 1
            if c:
                self._count[t] = c
            else:
                del self._count[t]
                self._distinct = None   # a token left the set: rebuilt once, when next asked
        del self.tokens[n:]

    def distinct(self) -> np.ndarray:
        """Every token the history holds, once each (int64, in no particular order)."""
        if self._distinct is None:
            self._distinct = np.fromiter(self._count, dtype=np.int64, count=len(self._count))
            self._new = []
        elif self._new:
            self._distinct = np.concatenate([self._distinct, np.asarray(self._new, dtype=np.int64)])
            self._new = []
        return self._distinct
