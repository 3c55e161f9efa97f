"""Which matrix product a decode step's few rows take on this CPU, from timing both; pure.

A linear layer's x @ W^T is what BLAS does for any number of rows. For the few rows of
a decode step W @ x^T is sometimes much faster -- and sometimes much slower: which one
wins depends on the machine's BLAS build, its vector units and its caches, not on the
model. On the 2-core machine this engine was first tuned on, W @ x^T halved the default
model's LM head at 8 rows; on today's (AVX-512, the same torch 2.13.0) it takes a lone
row of every matrix about three times as long as x @ W^T, and it had halved a single
user's decode speed (bench/RESULTS.md, 2026-12-03). So
neither is wired in: the first call of each kind of product (a matrix shape, a bucket
of rows) times the two in turn, a few times each, and answers with the faster, which
every later call of that kind runs. The trials all happen inside that first call, so no
result ever comes from the product a kind did not keep: a step gives the same bits on its
first call as on its thousandth (trials spread over calls had two asks of one greedy
reply read different logprobs). The load's own profile steps make most of these first
calls.

Not a kind per thread count: the two products' last bits differ (~3e-5 at four rows of
the default model's matrices), and a step's thread count follows what the owner's other
programs leave free (core/cpu_share.py). A kind per thread count was timed anew whenever
the machine got busier, and could keep the other product: the same seeded request, sent
again to one server, drew another token at a near tie (found by an API tester while
another program ran). Each product alone gives the same bits on any number of threads.

A ProductChoice is fed the times and answers the choice; cpu_linear.py does the calls.
Calls may come from two threads (a decode step cutting into a prompt step): a sample
counted twice or once too few changes nothing that matters.
"""

from __future__ import annotations

PRODUCTS = ("rows", "columns")     # x @ W^T, BLAS's usual way round | W @ x^T
ROW_BUCKETS = (1, 2, 4, 8, 16, 32)
# timed calls of each product before choosing, all in a kind's first call: one each.
# Three each (a median) cost that first call seven products, and every stage built anew
# after a rearrangement paid it again: CI's chaos evening answered too few requests
# twice in three runs. The differences this choice exists for are 2-3x, which one
# timing tells.
TRIALS = 1

# (out features, in features, row bucket)
Key = tuple[int, int, int]


def row_bucket(rows: int) -> int:
    """The smallest bucket holding `rows` (rows above the last bucket: the last)."""
    for b in ROW_BUCKETS:
        if rows <= b:
            return b
    return ROW_BUCKETS[-1]


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


class ProductChoice:
    def __init__(self, trials: int = TRIALS, fixed: str | None = None):
        """fixed: one product for every call, never timed (a test that needs every step
        to run the same operators; a side-by-side benchmark of the two)."""
        if trials < 1:
            raise ValueError("at least one trial of each product")
        if fixed is not None and fixed not in PRODUCTS:
            raise ValueError(f"fixed: one of {PRODUCTS}")
        self.trials, self.fixed = trials, fixed
        self._samples: dict[Key, dict[str, list[float]]] = {}
        self._chosen: dict[Key, str] = {}

    def pick(self, key: Key) -> tuple[str, bool]:
        """(the product to run, whether to time it and report it to observe())."""
        if self.fixed is not None:
            return self.fixed, False
        chosen = self._chosen.get(key)
        if chosen is not None:
            return chosen, False
        samples = self._samples.setdefault(key, {p: [] for p in PRODUCTS})
        # the product with fewer trials so far (alternating; ties: the usual way round)
        return min(PRODUCTS, key=lambda p: len(samples[p])), True

    def observe(self, key: Key, product: str, seconds: float) -> None:
        if product not in PRODUCTS or seconds < 0:
            raise ValueError(f"a time of one of {PRODUCTS}")
        if key in self._chosen:
            return
        samples = self._samples.setdefault(key, {p: [] for p in PRODUCTS})
        samples[product].append(seconds)
        if all(len(samples[p]) >= self.trials for p in PRODUCTS):
            # ties go to the usual way round: nothing to gain from the other
            self._chosen[key] = min(PRODUCTS, key=lambda p: (_median(samples[p]), PRODUCTS.index(p)))
            del self._samples[key]

    def chosen(self) -> dict[Key, str]:
        """The choices made so far (for a report)."""
        return dict(self._chosen)
