"""The ring in people's words (engine/node/ring_view.py), from a hosting status as the
node builds it."""

from __future__ import annotations

from engine.core.sizes import size_words
from engine.node.ring_view import TokenRate, gives_words, memory_words, ring, ring_text

ANA = "ws://127.0.0.1:41001"
BEN = "ws://127.0.0.1:41002"


def hosting(stages, events=(), friends=()):
    return {"stages": stages, "events": list(events), "friends": list(friends)}


def test_each_machine_its_share_device_path_and_round_trip():
    h = hosting([{"address": "head (this process)", "layers": [0, 19], "device_name": "CPU"},
                 {"address": ANA, "layers": [19, 30], "device_name": "NVIDIA GeForce RTX 4090", "name": "Ana",
                  "via": "direct (punched)", "tunnel": {"rtt_ms": 23.4}}])
    rows = ring(h, tokens_per_s=12.46)
    assert [(r["who"], r["share"], r["path"], r["rtt_ms"]) for r in rows] == [
        ("This computer", "19 of 30 layers", None, None), ("Ana", "11 of 30 layers", "direct", 23.4)]
    text = ring_text(rows)
    assert text == ("This computer (CPU): 19 of 30 layers → Ana (NVIDIA GeForce RTX 4090): 11 of 30 layers, "
                    "direct, 23 ms · 12.5 tokens/s")
    for engine_word in ("ws://", "KV", "head", "stage"):
        assert engine_word not in text


def test_one_computer_holding_every_layer_holds_the_whole_model():
    # a host alone (the chat's default) read "30 of 30 layers"
    rows = ring(hosting([{"address": "head (this process)", "layers": [0, 30], "device_name": "CPU"}]))
    assert [(r["who"], r["share"]) for r in rows] == [("This computer", "the whole model")]
    assert ring_text(rows) == "This computer (CPU): the whole model"


def test_a_friend_who_left_is_shown_as_such_with_why_until_back():
    left = {"event": "left", "address": BEN, "why": f"stage 2 ({BEN}) is leaving: sharing switched off by the owner"}
    friends = [{"name": "Ana", "address": ANA}, {"name": "Ben", "address": BEN}]
    stages = [{"address": "head (this process)", "layers": [0, 15], "device_name": "CPU"},
              {"address": ANA, "layers": [15, 30], "device_name": "CPU", "name": "Ana", "via": "relay"}]
    rows = ring(hosting(stages, [left], friends))
    assert rows[-1] == {"who": "Ben", "device": None, "layers": None, "share": None, "path": None, "rtt_ms": None,
                        "state": "left", "why": "sharing switched off by the owner", "memory": None}
    assert rows[1]["path"] == "through the relay"
    assert "Ben: left (sharing switched off by the owner)" in ring_text(rows)
    silent = {"event": "left", "address": BEN, "why": f"stage 2 ({BEN}) disconnected"}
    assert ring(hosting(stages, [silent], friends))[-1]["why"] == "its connection closed"
    asleep = {"event": "left", "address": BEN, "why": f"stage 2 ({BEN}) is leaving: this computer is going to sleep"}
    assert ring(hosting(stages, [asleep], friends))[-1]["why"] == "their computer is going to sleep"
    # the head's own words for a link that went quiet, as a friend's faded card showed them
    frozen = {"event": "left", "address": BEN, "why": "the link to stage 1 failed: the receiver stopped answering"}
    assert ring(hosting(stages, [frozen], friends))[-1]["why"] == "it stopped answering (asleep, or its network went)"
    back = ring(hosting(stages, [left, {"event": "back", "address": BEN}], friends))
    assert [r["who"] for r in back] == ["This computer", "Ana"]
    # it answers, but its line cannot carry its share yet (engine/core/line_check.py)
    slow = {"event": "slow", "address": BEN, "why": "its line carries 256 kbit/s: taking it back would keep "
                                                    "every conversation waiting about 43 s"}
    row = ring(hosting(stages, [frozen, slow], friends))[-1]
    assert row["state"] == "left" and row["why"].startswith("answers again, but its line carries 256 kbit/s"), row


def test_tokens_per_second_over_a_sliding_window():
    now = [0.0]
    rate = TokenRate(clock=lambda: now[0])
    assert rate.update(0) is None
    now[0] = 2.0
    assert rate.update(20) == 10.0
    now[0] = 30.0
    rate.update(20)
    now[0] = 40.0
    assert rate.update(20) == 0.0          # a pause reads as zero, not as the old figure
    assert rate.update(0) is None           # a new pipeline starts over


def test_each_machine_shows_the_memory_its_share_takes_of_what_it_offered():
    h = hosting([{"address": "head (this process)", "layers": [0, 19], "device_name": "CPU",
                  "memory": {"weights": 300_000_000, "cache": 2_800_000_000, "offered": 20_000_000_000}},
                 {"address": ANA, "layers": [19, 30], "device_name": "NVIDIA GeForce RTX 4090", "name": "Ana",
                  "memory": {"weights": 9_000_000_000, "cache": 12_000_000_000, "offered": 23_500_000_000}}])
    rows = ring(h)
    assert [r["memory"] for r in rows] == ["3.1 GB of 20 GB", "21 GB of 24 GB"]
    assert "Ana (NVIDIA GeForce RTX 4090): 11 of 30 layers in 21 GB of 24 GB" in ring_text(rows)
    # a stage still loading has no memory figure yet
    assert memory_words(None) is None
    assert memory_words({"weights": 1, "cache": 499_999_999, "offered": None}) == "500 MB"
    assert size_words(1_500_000_000) == "1.5 GB"
    # what something needs is rounded up, never said smaller
    assert (size_words(1_410_000_000, up=True), size_words(9_600_000_000, up=True),
            size_words(270_100_000, up=True)) == ("1.5 GB", "10 GB", "271 MB")


def test_a_friend_who_joins_says_what_their_computer_gives():
    assert gives_words({"device": "NVIDIA GeForce RTX 4090", "memory": 24_000_000_000}) == \
        "NVIDIA GeForce RTX 4090, 24 GB free"
    assert gives_words({"device": "CPU"}) == "CPU"
    assert gives_words({}) is None
