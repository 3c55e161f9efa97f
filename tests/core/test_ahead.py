"""engine/core/ahead.py: a step's rows matched with the positions launched ahead of it."""

from engine.core.ahead import AheadRow, Rest, launchable, split


def test_a_plain_step_launched_whole_is_all_done():
    ahead = [AheadRow(1, 10, 7), AheadRow(2, 20, 8)]
    sp = split(ahead, [1, 2], [10, 20], [1, 1], [7, 8])
    assert sp.done == [0, 1] and sp.use_logits == [True, True]
    assert sp.rest == [] and sp.drop == []


def test_a_finished_row_is_dropped_and_a_newcomer_computed():
    ahead = [AheadRow(1, 10, 7), AheadRow(2, 20, 8)]
    # row 1 finished (not in the step), sequence 3 joins with its prompt
    sp = split(ahead, [2, 3], [20, 0], [1, 5], [8, 100])
    assert sp.done == [1, None] and sp.use_logits == [True, False]
    assert sp.rest == [Rest(1, 0, 5, 1)]
    assert sp.drop == [AheadRow(1, 10, 7)]


def test_a_row_that_starts_elsewhere_or_with_another_token_is_computed_as_built():
    ahead = [AheadRow(1, 10, 7), AheadRow(2, 20, 8)]
    # 1: replayed from its start (failover); 2: another token at the same place
    sp = split(ahead, [1, 2], [0, 20], [11, 1], [3, 9])
    assert sp.done == [None, None]
    assert sp.rest == [Rest(0, 0, 11, 1), Rest(1, 20, 1, 1)]
    assert sp.drop == ahead


def test_a_draft_checked_behind_a_launched_position():
    # sequence 1's step: its last token (launched ahead) and a 3-token draft, every
    # position's logits kept; the launched position's logits come first
    sp = split([AheadRow(1, 10, 7)], [1], [10], [4], [7], keep=[4])
    assert sp.done == [0] and sp.use_logits == [True]
    assert sp.rest == [Rest(0, 11, 3, 3)]


def test_a_chunk_that_keeps_its_last_position_only_skips_the_launched_one():
    sp = split([AheadRow(1, 10, 7)], [1], [10], [4], [7])
    assert sp.done == [0] and sp.use_logits == [False]
    assert sp.rest == [Rest(0, 11, 3, 1)]


def test_which_rows_launch_ahead():
    # a prompt step, a plain decode row, a verification row, a row at its limit
    rows = launchable([0, 30, 40, 50], [12, 1, 3, 1], [1, 1, 3, 1], [True, True, True, False])
    assert rows == [(0, 12), (1, 31)]
    assert launchable([5], [1], None, [True]) == [(0, 6)]
