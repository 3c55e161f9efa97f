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
BUDGET_S = 15.0
# an idle pipeline's next prompt crosses the line too: at least this many tokens count
FLOOR_TOKENS = 512
# how long a machine whose line is too slow waits before it is tested again (the test
# costs its line TEST_BYTES each time)
HOLD_S = 10.0
# the round trip's own answer: a line that takes longer than this for a byte is asleep
ROUND_TRIP_S = 5.0


@dataclass(frozen=True)
class LineCheck:
    """The test for one machine: replay_bytes is what its line would carry to take it back."""
    replay_bytes: int

    @classmethod
    def for_replay(cls, tokens: int, hidden: int, itemsize: int = 2) -> "LineCheck":
        return cls(max(tokens, FLOOR_TOKENS) * hidden * itemsize)

    def deadline_s(self, round_trip: float) -> float:
        """How long the TEST_BYTES answer may take: past it the line is too slow anyway."""
        return round_trip + BUDGET_S * TEST_BYTES / self.replay_bytes

    def verdict(self, round_trip: float, elapsed: float | None) -> str | None:
        """None when the line carries the replay within BUDGET_S; else why not, in words.
        elapsed: the TEST_BYTES answer's time (None: not within deadline_s)."""
        if elapsed is None:
            rate = TEST_BYTES / (BUDGET_S * TEST_BYTES / self.replay_bytes)
            return (f"its line carries under {_rate_words(rate)}: taking it back would keep every "
                    f"conversation waiting over {BUDGET_S:g} s")
        rate = TEST_BYTES / max(elapsed - round_trip, 1e-3)
        seconds = self.replay_bytes / rate
        if seconds <= BUDGET_S:
            return None
        return (f"its line carries {_rate_words(rate)}: taking it back would keep every conversation "
                f"waiting about {seconds:.0f} s")


def _rate_words(bytes_per_s: float) -> str:
    bits = bytes_per_s * 8
    return f"{bits / 1e6:.1f} Mbit/s" if bits >= 1e6 else f"{bits / 1e3:.0f} kbit/s"
