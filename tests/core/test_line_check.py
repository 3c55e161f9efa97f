"""Whether a machine's line carries its take-in (engine/core/line_check.py): plain
numbers in, a verdict in words out."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.core.line_check import BUDGET_S, FLOOR_TOKENS, TEST_BYTES, LineCheck  # noqa: E402


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
    assert why is not None and "256 kbit/s" in why and "43 s" in why, why
    # nothing within the deadline: said as a bound
    assert "under" in check.verdict(rt, None)


def test_the_deadline_is_what_the_budget_allows_the_test_plus_its_round_trip():
    check = LineCheck(replay_bytes=10 * TEST_BYTES)
    assert abs(check.deadline_s(0.5) - (0.5 + BUDGET_S / 10)) < 1e-9
    # a test that takes just under the deadline passes; the verdict and the deadline agree
    assert check.verdict(0.5, check.deadline_s(0.5) - 0.01) is None
    assert check.verdict(0.5, check.deadline_s(0.5) + 0.5) is not None
