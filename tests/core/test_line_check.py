"""Whether a machine's line carries its take-in (engine/core/line_check.py): plain
numbers in, a verdict in words out."""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.core.line_check import (BUDGET_S, FLOOR_TOKENS, HOLD_S, SLOW_START_TRIPS, TEST_BYTES,  # noqa: E402
                                     LineCheck, hold_s)


def test_the_replay_counts_every_conversations_tokens_and_at_least_a_prompts():
    assert LineCheck.for_replay(1200, 576).replay_bytes == 1200 * 576 * 2
    assert LineCheck.for_replay(0, 576).replay_bytes == FLOOR_TOKENS * 576 * 2    # an idle pipeline
    assert LineCheck.for_replay(1200, 576, itemsize=4).replay_bytes == 1200 * 576 * 4


def test_a_home_uplink_passes_and_a_collapsed_one_does_not():
    check = LineCheck.for_replay(1200, 576)          # the default model, a 1.2k-token prompt: 1.4 MB
    rt = 0.03
    # 10 Mbit/s: 64 KiB in ~52 ms more than the round trip
    assert check.verdict(rt, rt + TEST_BYTES * 8 / 10e6) is None
    # 256 kbit/s: the replay would take ~43 s
    why = check.verdict(rt, rt + TEST_BYTES * 8 / 256e3)
    rate, seconds = (float(x) for x in re.search(r"carries (\d+) kbit/s.* about (\d+) s", why).groups())
    assert 250 <= rate <= 270 and 40 <= seconds <= 45, why
    # nothing within the deadline: said as a bound
    assert "under" in check.verdict(rt, None)


def test_the_deadline_is_what_the_budget_allows_the_test_plus_its_round_trips():
    check = LineCheck(replay_bytes=10 * TEST_BYTES)
    assert abs(check.deadline_s(0.05) - ((1 + SLOW_START_TRIPS) * 0.05 + BUDGET_S / 10)) < 1e-9
    # a test that takes just under the deadline passes; the verdict and the deadline agree
    assert check.verdict(0.05, check.deadline_s(0.05) - 0.01) is None
    assert check.verdict(0.05, check.deadline_s(0.05) + 0.5) is not None


def test_a_far_line_is_judged_by_its_rate_not_by_its_round_trips():
    """A fresh connection's 64 KiB take a few round trips of TCP's slow start: on a 100 ms
    relay path at 20 Mbit/s that is most of the test, and a big model's replay (hidden
    8192, 4k tokens: 67 MB) must not read as a slow line for it."""
    rt = 0.1
    elapsed = rt + SLOW_START_TRIPS * rt + TEST_BYTES * 8 / 20e6
    fits = LineCheck.for_replay(600, 8192)        # 10 MB over 20 Mbit/s: ~4 s
    assert elapsed < fits.deadline_s(rt) and fits.verdict(rt, elapsed) is None
    big = LineCheck.for_replay(4000, 8192)        # 67 MB: ~27 s, over the budget
    assert elapsed > big.deadline_s(rt) and "under" in big.verdict(rt, None)


def test_a_line_too_slow_is_tested_later_each_time():
    assert [hold_s(n) for n in (1, 2, 3, 4, 5, 9)] == [HOLD_S[0], 2 * HOLD_S[0], 4 * HOLD_S[0], 8 * HOLD_S[0],
                                                       HOLD_S[1], HOLD_S[1]]


def test_a_round_trip_over_the_limit_is_too_slow_whatever_the_rate():
    """A collapsed uplink's full queue delays the one-byte answer too; subtracting slow
    start's trips from the test would then pass it for a fast line."""
    check = LineCheck.for_replay(1200, 576)
    why = check.verdict(0.8, 0.8 + 0.05)
    assert why is not None and "800 ms" in why
