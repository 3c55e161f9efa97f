"""The choice of a decode step's matrix product (engine/core/product_choice.py): pure."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import pytest  # noqa: E402

from engine.core.product_choice import PRODUCTS, ROW_BUCKETS, ProductChoice, row_bucket  # noqa: E402

KEY = (576, 576, 1)


def feed(choice, key, times: dict[str, list[float]]) -> list[str]:
    """Run the trials with these times per product, in the order pick() asks; returns that order."""
    asked, left = [], {p: list(ts) for p, ts in times.items()}
    while True:
        product, timed = choice.pick(key)
        if not timed:
            return asked
        asked.append(product)
        choice.observe(key, product, left[product].pop(0))


def test_trials_alternate_and_the_faster_median_wins():
    c = ProductChoice(trials=3)
    # "columns" has one slow outlier (a context switch): its median still wins
    asked = feed(c, KEY, {"rows": [3.0, 3.1, 2.9], "columns": [9.0, 1.0, 1.1]})
    assert asked == ["rows", "columns"] * 3
    assert c.pick(KEY) == ("columns", False) and c.chosen() == {KEY: "columns"}


def test_the_usual_product_when_they_tie_and_each_kind_of_call_on_its_own():
    c = ProductChoice(trials=2)
    feed(c, KEY, {"rows": [1.0, 1.0], "columns": [1.0, 1.0]})
    other = (576, 576, 4, 2)
    feed(c, other, {"rows": [5.0, 5.0], "columns": [1.0, 2.0]})
    assert c.chosen() == {KEY: "rows", other: "columns"}
    c.observe(KEY, "columns", 0.0)   # a late sample (another thread's) changes nothing
    assert c.pick(KEY) == ("rows", False)


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        ProductChoice(trials=0)
    with pytest.raises(ValueError):
        ProductChoice(fixed="sideways")
    with pytest.raises(ValueError):
        ProductChoice().observe(KEY, "sideways", 1.0)
    with pytest.raises(ValueError):
        ProductChoice().observe(KEY, PRODUCTS[0], -1.0)


def test_row_buckets():
    assert [row_bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 17, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 32, 32]
    assert all(row_bucket(b) == b for b in ROW_BUCKETS)


def test_a_fixed_product_is_never_timed():
    c = ProductChoice(fixed="columns")
    assert c.pick(KEY) == ("columns", False) and c.chosen() == {}
