"""The head's recovery decisions (engine/core/recovery.py), fed plain events: no
sockets, no model, no clock but the numbers passed in."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.core.recovery import describe_layers, missing_ranges, waiting_status  # noqa: E402

THREE = [(0, 12), (12, 27), (27, 30)]   # head, stage 1, stage 2 of the default model's 30 layers


def test_two_stages_lost_at_once_every_missing_layer_is_named():
    missing = missing_ranges(THREE, [True, False, False])
    assert missing == [(12, 30)]
    status, what = waiting_status(missing, need=30, have=21)
    assert what == "layers 12–29"
    assert status == "waiting for a GPU to hold layers 12–29 (the machines left have room for 21 of the model's 30 layers)"


def test_missing_ranges_apart_are_each_named():
    four = [(0, 5), (5, 12), (12, 20), (20, 30)]
    assert missing_ranges(four, [True, False, True, False]) == [(5, 12), (20, 30)]
    assert describe_layers([(5, 12), (20, 30)]) == "layers 5–11 and 20–29"
    assert describe_layers([(1, 2), (5, 12), (20, 30)]) == "layers 1, 5–11 and 20–29"
    assert describe_layers([(4, 5)]) == "layer 4"
    assert missing_ranges(THREE, [True, True, True]) == []


def test_a_shortfall_that_is_no_stage_s_layers_says_how_many():
    status, what = waiting_status([], need=30, have=26)
    assert what == "4 more layers" and "room for 26 of the model's 30 layers" in status
    # the pool has room in total, but one machine cannot take even one layer
    status, _ = waiting_status([], need=30, have=40)
    assert "no room for even one layer" in status
