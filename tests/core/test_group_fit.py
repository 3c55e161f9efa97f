"""Which model a group can run, in words (engine/core/group_fit.py)."""

from __future__ import annotations

from engine.core.group_fit import group_fit
from engine.core.precision import USABLE

GB = 10**9
QWEN7 = {"bf16": int(16.5 * GB), "int8": int(8.7 * GB), "nf4": int(5.0 * GB)}


def test_a_model_that_fits_here_says_so_at_the_highest_precision():
    fit = group_fit(QWEN7, here=int(40 * GB))
    assert fit["fits_here"] and fit["weights"] == "bf16"
    assert fit["words"] == "fits on this computer: needs 28 GB"
    fit = group_fit(QWEN7, here=int(16 * GB))
    assert fit["weights"] == "int8" and fit["words"].startswith("fits on this computer as int8: needs 15 GB")


def test_with_friends_it_names_what_each_gives():
    fit = group_fit(QWEN7, here=int(12 * GB), friends=[("Ana", int(8 * GB))])
    assert not fit["fits_here"] and fit["fits"] and fit["weights"] == "int8"
    assert fit["words"] == "fits with your friends as int8: needs 15 GB, this computer gives 12 GB, Ana 8.0 GB"


def test_what_is_missing_is_said_as_the_friend_to_invite():
    big = {"bf16": int(140 * GB), "int8": int(70 * GB), "nf4": int(24 * GB)}    # 24 GB of nf4: needs 40 GB
    fit = group_fit(big, here=int(24 * GB), waiting=1)
    assert not fit["fits"] and fit["weights"] is None
    assert fit["missing_bytes"] == int(24 * GB / USABLE) - 24 * GB
    assert fit["words"] == ("needs 40 GB even as nf4 — your group has 24 GB: invite one more friend with a 16 GB GPU"
                            " (1 friend still to join)")
    # without bitsandbytes only full precision counts
    assert "even as" not in group_fit(big, here=int(24 * GB), quantized_ok=False)["words"]
