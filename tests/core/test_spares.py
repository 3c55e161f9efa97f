"""Spare layers (engine/core/spares.py): what each machine loads beside its slice so that a
stage lost without notice costs no loading, and which plan a loss then takes."""

from __future__ import annotations

import pytest

from engine.core.spares import Spares, spare_count, spare_ranges


def test_each_machine_holds_every_slice_a_loss_would_give_it():
    current = [(0, 10), (10, 20), (20, 30)]
    plans = {1: [(0, 15), (15, 30)],      # stage 1 lost: the head and stage 2 split its layers
             2: [(0, 14), (14, 30)]}      # stage 2 lost
    spares = spare_ranges(current, plans)
    # the head grows up to 15 (either loss); stage 1 down to nothing, up to 30; stage 2 down to 15
    assert spares == [(0, 15), (10, 30), (15, 30)]
    assert spare_count(current, spares) == 5 + 10 + 5


def test_a_slice_that_shifts_away_keeps_what_it_serves_and_adds_the_rest():
    # four stages: losing stage 3 shifts stage 1's share up; its spare range spans both
    current = [(0, 8), (8, 16), (16, 24), (24, 32)]
    plans = {1: [(0, 11), (11, 22), (22, 32)], 2: [(0, 11), (11, 21), (21, 32)],
             3: [(0, 10), (10, 21), (21, 32)]}
    assert spare_ranges(current, plans) == [(0, 11), (8, 21), (11, 32), (21, 32)]
    assert spare_ranges(current, {}) == current      # no plan (no loss leaves room): no spares


def test_a_plan_that_does_not_fit_the_arrangement_is_refused():
    with pytest.raises(ValueError):
        spare_ranges([(0, 10), (10, 20), (20, 30)], {1: [(0, 30)]})


def test_a_loss_takes_its_plan_only_while_the_survivors_are_those():
    split = ([1, 2], "bf16", [(0, 15), (15, 30)])
    s = Spares({"ws://b": (["ws://c"], split)}, "bf16")
    assert s.for_loss("ws://b", ["ws://c"]) == (["ws://c"], split)
    assert s.for_loss("ws://b", ["ws://c", "ws://d"]) is None    # someone else came meanwhile
    assert s.for_loss("ws://c", ["ws://b"]) is None                # no plan for that loss
    assert Spares({"ws://b": (["ws://c"], split)}, "int8").for_loss("ws://b", ["ws://c"]) is None
