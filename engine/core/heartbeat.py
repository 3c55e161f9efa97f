"""How long a peer has been silent, counted only in time this process was running.

A head pings each stage it opened a connection to (every HEARTBEAT_S) and gives up
on a stage that leaves a ping unanswered for HEARTBEAT_TIMEOUT_S: a friend's PC that
went to sleep is noticed within seconds and its layers move. But the clock that timed
the silence also ran while our own event loop was held: a swapping laptop, a
debugger, a test that generated its reference replies on the loop. When the loop came
back, the pong waiting in the socket and the timeout fired in the same turn, and the
head declared every stage dead at once (CI: a head whose loop was held for a few
seconds found its control link closed with "keepalive ping timeout", the stage
having answered all along).

So the waiter wakes every `tick` seconds, and a wake-up later than that counts as at
most 2 x `tick` of silence: the rest is time this process did not run, which says
nothing about the peer. A peer that stays silent while we run is still given up on
after `timeout` (to within 2 ticks); a loop that is held often stretches that, at
worst by the share of time it was held.
"""

from __future__ import annotations


class Silence:
    """Silence since a ping was sent at `now`: `advance(now)` at each wake-up of a waiter
    that sleeps `tick`; it says True once the silence has reached `timeout`."""

    def __init__(self, timeout: float, tick: float, now: float):
        if timeout <= 0 or tick <= 0:
            raise ValueError("a heartbeat needs a positive timeout and tick")
        self.timeout = timeout
        self.tick = tick
        self.last = now
        self.counted = 0.0   # silence that counts against the peer
        self.held = 0.0      # time our own process did not run: forgiven

    def advance(self, now: float) -> bool:
        gap = max(0.0, now - self.last)
        self.last = now
        counted = min(gap, 2 * self.tick)
        self.counted += counted
        self.held += gap - counted
        return self.expired

    @property
    def expired(self) -> bool:
        return self.counted >= self.timeout
