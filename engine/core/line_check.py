"""Whether a machine that dropped out can be taken back now, by what its line carries.

A friend whose upload collapsed (someone at home sends a video) stops answering in time
and is dropped; the pipeline serves on without it. Its heartbeat still answers (a ping
is a few bytes), so the watch used to take it straight back -- and replaying every
conversation over the collapsed line stalled them all until it dropped again.

Before a machine is taken back while the pipeline serves without it, the head asks it
for a few bytes twice (the stage answers `line_test` with `line_fill`): a byte, for the
round trip, then TEST_BYTES; their difference is what the line carries. Taking the
machine back replays the conversations: their tokens' activations cross its line. If
that would take longer than BUDGET_S, it is asked again later (HOLD_S). Sans-I/O: the
head measures, this decides and words it.
"""

from __future__ import annotations

from dataclasses import dataclass

# what the stage sends back for the measurement (and the most it will send: frames.py)
TEST_BYTES = 64 * 1024
# the longest a take-in's replay may keep every conversation waiting on the line
BUDGET_S = 10.0
# an idle pipeline's next prompt crosses the line too: at least this many tokens count
# (with 256 and a 15 s budget, a friend's upload collapsed to 256 kbit/s passed with no
# conversation running, was taken back, and dropped out again and again: home_faults)
FLOOR_TOKENS = 512
# how long a machine whose line is too slow waits before it is tested again, doubling
# each time up to the last (each test costs its line TEST_BYTES: a line slow all evening
# is not probed every few seconds)
HOLD_S = (10.0, 120.0)
# a fresh connection's TCP starts slow: TEST_BYTES take about this many round trips more
# than the line's rate alone would (the first round trip is the request's)
SLOW_START_TRIPS = 2
# the round trip's own answer: a line that takes longer than this for a byte is asleep
ROUND_TRIP_S = 5.0
# a round trip longer than this is a line too slow however fast it carries bytes: every
# step crossing it waits that long (and a collapsed uplink's full queue shows here first,
# which would otherwise pass for slow start's round trips below)
ROUND_TRIP_LIMIT_S = 0.5


@dataclass(frozen=True)
class LineCheck:
    """The test for one machine: replay_bytes is what its line would carry to take it back."""
    replay_bytes: int

    @classmethod
    def for_replay(cls, tokens: int, hidden: int, itemsize: int = 2) -> "LineCheck":
        return cls(max(tokens, FLOOR_TOKENS) * hidden * itemsize)

    def deadline_s(self, round_trip: float) -> float:
        """How long the TEST_BYTES answer may take: past it the line is too slow anyway."""
        return (1 + SLOW_START_TRIPS) * round_trip + BUDGET_S * TEST_BYTES / self.replay_bytes

    def verdict(self, round_trip: float, elapsed: float | None) -> str | None:
        """None when the line carries the replay within BUDGET_S; else why not, in words.
        elapsed: the TEST_BYTES answer's time (None: not within deadline_s)."""
        if round_trip > ROUND_TRIP_LIMIT_S:
            return (f"its round trip takes {round_trip * 1000:.0f} ms: every step across it would wait "
                    "that long")
        if elapsed is None:
            rate = TEST_BYTES / (BUDGET_S * TEST_BYTES / self.replay_bytes)
            return (f"its line carries under {_rate_words(rate)}: taking it back would keep every "
                    f"conversation waiting over {BUDGET_S:g} s")
        # the transfer's own time: less the round trips of the request and of slow start
        # (a far line's trips are most of a small test), never less than a quarter of it
        transfer = max(elapsed - (1 + SLOW_START_TRIPS) * round_trip, (elapsed - round_trip) / 4, 1e-3)
        rate = TEST_BYTES / transfer
        seconds = self.replay_bytes / rate
        if seconds <= BUDGET_S:
            return None
        return (f"its line carries {_rate_words(rate)}: taking it back would keep every conversation "
                f"waiting about {seconds:.0f} s")


def hold_s(times: int) -> float:
    """The wait before the next test, after `times` tests too slow in a row."""
    return min(HOLD_S[0] * 2 ** max(times - 1, 0), HOLD_S[1])


def _rate_words(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    return f"{bits / 1e6:.1f} Mbit/s" if bits >= 1e6 else f"{bits / 1e3:.0f} kbit/s"
