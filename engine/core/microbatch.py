"""How many micro-batches the head keeps in flight.

With M stages and slow links, M micro-batches leave bubbles: a stage finishes one and
waits for the next to cross the links. More micro-batches fill the bubbles but each is
smaller, so every stage pays its fixed per-step cost more often. Search K upward from M
to 2M and stop when one more micro-batch no longer raises the predicted throughput
(DESIGN.md, "More micro-batches than stages"). Pure: fed profiles, returns a number.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

Curve = Callable[[int], float]   # seconds for a micro-batch of b sequences


def predict_throughput(k: int, n_seqs: int, stage_time: Sequence[Curve], link_busy: Sequence[Curve],
                       link_latency: Sequence[float] = ()) -> float:
    """Tokens per second with n_seqs decoding sequences split into k micro-batches.

    A micro-batch of b sequences needs one pipeline loop to produce a token: its stage
    times, the links' serialization times (bytes / bandwidth) and their latencies. The
    stages and the links' bandwidth are resources the k micro-batches take turns on
    (latency is not: it overlaps), so a round of k tokens takes at least k x the busiest
    resource's time, and at least one loop.
    """
    b = max(1, math.ceil(n_seqs / k))
    stages = [t(b) for t in stage_time]
    links = [t(b) for t in link_busy]
    loop = sum(stages) + sum(links) + sum(link_latency)
    bottleneck = max(stages + links)
    cycle = max(k * bottleneck, loop)
    return min(n_seqs, k * b) / cycle


def choose(n_stages: int, n_seqs: int, stage_time: Sequence[Curve], link_busy: Sequence[Curve],
           link_latency: Sequence[float] = (), gain: float = 0.03) -> int:
    """Smallest K in [M, 2M] after which one more micro-batch gains less than `gain`."""
    m = max(1, n_stages)
    if n_seqs <= m:
        return m
    k = m
    best = predict_throughput(m, n_seqs, stage_time, link_busy, link_latency)
    while k < 2 * m and k < n_seqs:
        nxt = predict_throughput(k + 1, n_seqs, stage_time, link_busy, link_latency)
        if nxt < best * (1 + gain):
            break
        k, best = k + 1, nxt
    return k
