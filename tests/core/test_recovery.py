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
    assert what == "layers 13–30"   # counted from 1, as the joiner's own line
    assert status == "waiting for a computer to hold layers 13–30 (the machines left have room for 21 of the model's 30 layers)"


def test_missing_ranges_apart_are_each_named():
    four = [(0, 5), (5, 12), (12, 20), (20, 30)]
    assert missing_ranges(four, [True, False, True, False]) == [(5, 12), (20, 30)]
    assert describe_layers([(5, 12), (20, 30)]) == "layers 6–12 and 21–30"
    assert describe_layers([(1, 2), (5, 12), (20, 30)]) == "layers 2, 6–12 and 21–30"
    assert describe_layers([(4, 5)]) == "layer 5"
    assert missing_ranges(THREE, [True, True, True]) == []


def test_a_shortfall_that_is_no_stage_s_layers_says_how_many():
    status, what = waiting_status([], need=30, have=26)
    assert what == "4 more layers" and "room for 26 of the model's 30 layers" in status
    # the pool has room in total, but one machine cannot take even one layer
    status, _ = waiting_status([], need=30, have=40)
    assert "no room for even one layer" in status


# ---- the Recovery object: plain events in, decisions out -----------------------------

from engine.core.recovery import (LOST_ATTEMPTS, SURVIVOR_ATTEMPTS, Recovery)  # noqa: E402

A, B, C = "ws://a:1", "ws://b:1", "ws://c:1"


def running(addresses=(A, B), wait_timeout=300.0, **kw) -> Recovery:
    rec = Recovery(list(addresses), wait_timeout, wall=lambda: 1000.0, **kw)
    rec.formed(list(addresses))
    return rec


def test_a_stage_that_left_is_asked_back_briefly_and_the_others_to_go_on():
    rec = running()
    assert rec.lost(1, A, "stage 1 (ws://a:1) disconnected", epoch=0)
    assert rec.status == "stage 1 (ws://a:1) disconnected"
    asks = rec.begin([A, B], THREE, now=10.0, lost=1)
    assert rec.epoch == 1  # what was computed for the old arrangement is void
    assert [(a.address, a.lost) for a in asks] == [(A, True), (B, False)]
    assert asks[0].attempts == LOST_ATTEMPTS < SURVIVOR_ATTEMPTS == asks[1].attempts
    assert asks[0].timeout < asks[1].timeout
    rec.unanswered(asks[0], "cannot reach", now=12.0)
    rec.answered(asks[1])
    assert rec.missing() == [(12, 27)]
    assert rec.away == {A: 12.0}  # the watch asks it later
    rec.forming(12.5)
    e = rec.recovered(15.0, stages=2, ranges=[(0, 19), (19, 30)], replayed=4)
    assert rec.status is None
    assert (e["event"], e["seconds"], e["replan_s"], e["load_s"], e["replayed"]) == ("recovered", 5.0, 2.5, 2.5, 4)
    assert [x["event"] for x in rec.events] == ["left", "recovered"]


def test_news_of_an_older_arrangement_or_during_a_rearrangement_is_ignored():
    rec = running()
    assert rec.lost(1, A, "a left", epoch=0)
    assert not rec.lost(2, B, "b left", epoch=0)       # one rearrangement at a time
    rec.begin([A, B], THREE, now=0.0, lost=1)
    assert not rec.lost(2, B, "b's old link failed", epoch=0)   # an arrangement that is gone
    rec.recovered(1.0, 2, [(0, 15), (15, 30)], 0)
    assert rec.lost(1, B, "b left", epoch=1)
    assert [e["why"] for e in rec.events if e["event"] == "left"] == ["a left", "b left"]
    rec.fail("b left; the stages left cannot go on")
    assert not rec.lost(1, B, "again", epoch=1)
    rec2 = running()
    rec2.close()
    assert not rec2.lost(1, A, "closing", epoch=0)


def test_a_stage_that_said_it_is_leaving_is_not_asked_back():
    rec = running()
    rec.lost(1, A, "stage 1 is leaving: sharing off", epoch=0)
    asks = rec.begin([A, B], THREE, now=5.0, lost=1, ask_back=False)
    assert [a.address for a in asks] == [B]
    assert rec.away == {A: 5.0}
    assert rec.missing() == [(12, 30)]  # before anyone answers: every old stage's layers


def test_two_stages_gone_at_once_both_recorded_and_both_ranges_missing():
    rec = running()
    rec.lost(2, B, "stage 2 disconnected", epoch=0)
    asks = rec.begin([A, B], THREE, now=0.0, lost=2)
    for ask in asks:
        rec.unanswered(ask, f"cannot reach stage at {ask.address}", now=1.0)
    left = [e for e in rec.events if e["event"] == "left"]
    assert [(e["stage"], e["address"]) for e in left] == [(2, B), (None, A)]  # the other one, noticed at hello
    assert rec.missing() == [(12, 30)]
    status = rec.no_room(need=30, have=21, now=2.0)
    assert status.startswith("waiting for a computer to hold layers 13–30 ")
    assert rec.status == status and rec.events[-1] == {"t": 1000.0, "event": "waiting", "why": status}


def test_waiting_for_room_asks_who_left_then_gives_up_at_the_host_s_timeout():
    rec = running(wait_timeout=10.0, watch_s=2.0)
    rec.lost(1, A, "stage 1 (ws://a:1) left: switched off", epoch=0)
    asks = rec.begin([A], [(0, 4), (4, 6)], now=100.0, lost=1)
    rec.unanswered(asks[0], "no answer", now=101.0)
    rec.no_room(6, 4, now=101.0)
    assert rec.to_ask(101.0) == [A]
    assert rec.gave_up(105.0) is None
    assert rec.wait_s(105.0) == 2.0 and rec.wait_s(110.5) == 0.5   # never past the deadline
    why = rec.gave_up(111.0)
    assert why == ("stage 1 (ws://a:1) left: switched off; no machine joined within 10 s to hold layers 5–6: "
                   "the machines left cannot hold the model")
    assert rec.fail(why) and rec.failed == why and rec.status is None
    assert not rec.fail("something else") and rec.failed == why
    assert not rec.watching  # a failed pipeline asks nobody back


def test_machines_that_left_are_asked_for_the_grace_period_then_forgotten():
    rec = running([A, B, C], grace_s=600.0)
    rec.lost(2, B, "b left", epoch=0)
    asks = rec.begin([A, B, C], [(0, 5), (5, 10), (10, 20), (20, 30)], now=0.0, lost=2, ask_back=False)
    for ask in asks:
        rec.answered(ask)
    rec.recovered(3.0, 3, [(0, 10), (10, 20), (20, 30)], 0)
    rec.formed([A, C])
    assert rec.watching and rec.may_ask
    assert rec.to_ask(599.0) == [B]
    assert rec.to_ask(601.0) == [] and not rec.watching


def test_one_that_comes_back_takes_its_old_place_a_newcomer_goes_last():
    rec = running([A, B, C])
    rec.lost(2, B, "b left", epoch=0)
    rec.begin([A, B, C], THREE + [(30, 31)], now=0.0, lost=2, ask_back=False)
    rec.recovered(1.0, 3, [], 0)
    rec.formed([A, C])
    assert rec.offer("ws://new:1", now=2.0)
    assert not rec.offer(A, now=2.0)  # holds layers already
    assert rec.to_ask(3.0) == [B, "ws://new:1"]
    assert sorted(["ws://new:1", C, B, A], key=rec.rank) == [A, B, C, "ws://new:1"]
    # the watch finds B: it was served here, so it is "back"
    assert rec.may_ask
    assert rec.came(B, now=4.0) == "ws://b:1 is back: loading its layers while the pipeline serves"
    # it loads ahead while the pipeline serves: not a rearrangement yet, but one at a time
    assert rec.status is None and not rec.may_ask and rec.joining == B
    rec.ahead("layers 10–19")
    assert rec.joining_status == "ws://b:1 is back: loading layers 10–19 while the pipeline serves"
    rec.ahead("layers 10–19", 48, 160)
    assert rec.joining_progress == 0.3 and "loading layers 10–19 (30%)" in rec.joining_status
    asks = rec.begin([A, C], [(0, 10), (10, 20), (20, 30)], now=5.5, joined=B)
    assert rec.status == "ws://b:1 is back: rearranging the pipeline" and rec.joining is None
    assert all(not a.lost for a in asks) and B not in rec.away
    for ask in asks:
        rec.answered(ask)
    done = rec.recovered(6.0, 4, [], 0)
    assert done["event"] == "rejoined" and done["ahead_s"] == 1.5 and done["seconds"] == 0.5
    rec.formed([A, B, C])
    assert rec.came("ws://new:1", now=7.0).startswith("ws://new:1 joined")
    assert [e["event"] for e in rec.events] == ["left", "recovered", "back", "rejoined", "joined"]


def test_a_stage_lost_while_a_machine_loads_ahead_comes_first():
    """The loss is dealt with at once (the head lets the machine loading ahead go), and
    the machine stays among those asked, to be taken in later."""
    rec = running([A, B])
    rec.offer(C, now=0.0)
    rec.came(C, now=1.0)
    assert rec.lost(1, A, "stage 1 (ws://a:1) disconnected", epoch=0)
    assert rec.joining is None and rec.joining_status is None and C in rec.away
    asks = rec.begin([A, B], THREE, now=2.0, lost=1)
    assert [a.address for a in asks] == [A, B]
    for ask in asks:
        rec.answered(ask)
    assert rec.recovered(3.0, 3, THREE, 0)["event"] == "recovered"
    rec.formed([A, B])
    assert rec.may_ask and rec.to_ask(4.0) == [C]


def test_a_stage_leaving_with_notice_is_lost_once_the_others_loaded_its_layers():
    rec = running([A, B])
    assert rec.leaving(2, B, "stage 2 (ws://b:1) is leaving: sleep", epoch=0)
    # the pipeline serves meanwhile, and nothing else starts
    assert rec.status is None and "the others load its layers" in rec.parting_status and not rec.may_ask
    assert not rec.leaving(1, A, "stage 1 is leaving too", epoch=0)   # one at a time: A is lost at once
    assert rec.lost(2, B, "stage 2 (ws://b:1) is leaving: sleep", epoch=0)
    assert rec.parting is None and rec.status
    assert [e["event"] for e in rec.events] == ["leaving", "left"]
    assert not rec.leaving(1, A, "x", epoch=0)   # a rearrangement under way


def test_a_machine_that_goes_while_loading_ahead_is_asked_again():
    rec = running([A, B])
    rec.offer(C, now=0.0)
    rec.came(C, now=1.0)
    assert not rec.may_ask
    assert "asked again" in rec.joined_gone(C, "its connection closed", now=2.0)
    assert rec.may_ask and rec.to_ask(3.0) == [C] and rec.status is None


def test_failure_messages_lead_with_who_left():
    rec = running()
    rec.lost(1, A, "stage 1 (ws://a:1) disconnected", epoch=0)
    assert rec.cannot_go_on("stage 1: out of memory") == \
        "stage 1 (ws://a:1) disconnected; the stages left cannot go on: stage 1: out of memory"
    assert rec.broke(KeyError("x")) == "stage 1 (ws://a:1) disconnected; rearranging the pipeline failed: 'x'"


def test_a_survivor_lost_while_waiting_for_room_adds_its_layers_to_the_wait():
    """Issue 44: the second loss while the pipeline waits is recorded, the machine is asked
    back like the first, and the status names both machines' layers."""
    rec = running()
    assert rec.lost(1, A, "stage 1 (ws://a:1) disconnected", epoch=0)
    asks = rec.begin([A, B], THREE, now=10.0, lost=1)
    rec.unanswered(asks[0], "cannot reach", now=12.0)
    rec.answered(asks[1])
    rec.no_room(30, 20, now=13.0)
    assert "layers 13–27" in rec.status
    status = rec.gone_meanwhile(B, "its connection closed", now=20.0)
    assert status == rec.status and "layers 13–30" in status and "left meanwhile" in status, status
    assert set(rec.away) == {A, B}
    assert [e["event"] for e in rec.events] == ["left", "waiting", "left"]


def _drops_out(rec: Recovery, address: str, now: float) -> None:
    """`address` stops answering and the pipeline rearranges over the others."""
    assert rec.lost(1, address, f"stage 1 ({address}) stopped answering", epoch=rec.epoch)
    for ask in rec.begin([address, B], THREE, now=now, lost=1, ask_back=False):
        rec.answered(ask)
    rec.recovered(now + 1.0, 2, [(0, 15), (15, 30)], 1)
    rec.formed([B])


def _taken_back(rec: Recovery, address: str, now: float) -> None:
    rec.came(address, now)
    for ask in rec.begin([B], [(0, 15), (15, 30)], now=now + 0.5, joined=address):
        rec.answered(ask)
    rec.recovered(now + 1.0, 3, THREE, 1)
    rec.formed([address, B])


def test_a_machine_that_keeps_dropping_out_is_asked_back_later_each_time():
    """A friend on a collapsed line was dropped, taken back 4 s later, and its replay over
    the same line stalled every reply 31 s until it dropped again, over and over: its
    second drop within DROPS_WINDOW_S holds it HOLD_S[0], later ones HOLD_S[1]."""
    from engine.core.recovery import DROPS_WINDOW_S, HOLD_S

    rec = running()
    _drops_out(rec, A, now=0.0)
    assert rec.to_ask(2.0) == [A]                      # the first time: asked back at once (a lid, a blip)
    _taken_back(rec, A, now=4.0)
    _drops_out(rec, A, now=40.0)
    assert rec.to_ask(42.0) == [] and rec.watching     # the second: held
    assert rec.to_ask(40.0 + HOLD_S[0]) == [A]
    _taken_back(rec, A, now=75.0)
    _drops_out(rec, A, now=100.0)
    assert rec.to_ask(100.0 + HOLD_S[0]) == []         # the third: longer
    assert rec.to_ask(100.0 + HOLD_S[1]) == [A]
    # a pipeline waiting for room asks it at once: it cannot serve without it
    rec.lost(1, B, "stage 1 (ws://b:1) stopped answering", epoch=rec.epoch)
    rec.begin([B], [(0, 15), (15, 30)], now=101.0, lost=1, ask_back=False)
    rec.no_room(30, 15, now=101.0)
    assert A in rec.to_ask(102.0)
    # drops long ago are forgotten
    assert rec.hold_s(A, 100.0 + DROPS_WINDOW_S + 50.0) == 0.0


def test_a_machine_whose_line_cannot_carry_its_take_in_is_asked_again_after_a_hold():
    """It answers the watch, but its line is too slow for the replay (line_check.py): the
    pipeline serves on without it; asked again after the hold, recorded once an absence."""
    rec = running()
    _drops_out(rec, A, now=0.0)
    assert rec.to_ask(2.0) == [A]
    said = rec.too_slow(A, "its line carries 200 kbit/s", now=2.0)
    assert "200 kbit/s" in said and "10 s" in said
    assert rec.to_ask(5.0) == [] and rec.watching and rec.may_ask
    assert rec.to_ask(12.0) == [A]
    said = rec.too_slow(A, "its line carries 300 kbit/s", now=12.0)
    assert "20 s" in said                  # later each time: a line slow all evening is not probed on and on
    assert rec.to_ask(25.0) == [] and rec.to_ask(32.0) == [A]
    assert [e["event"] for e in rec.events].count("slow") == 1     # said once, not every ten seconds
    assert rec.events[-1]["back"] is True  # it held layers here: "answers again", not "asked to join"
    assert rec.hold_s(A, 12.0) == 0.0      # slow is no drop: its line, not the machine, is the matter
    _taken_back(rec, A, now=33.0)
    assert A not in rec.slow_until and A not in rec.slow_times
    _drops_out(rec, A, now=40.0)
    assert "10 s" in rec.too_slow(A, "its line carries 100 kbit/s", now=70.0)    # a new absence: anew
    assert [e["event"] for e in rec.events].count("slow") == 2                   # and said again


def test_leaving_with_notice_is_no_drop():
    """Sharing switched off and on again (the app's toggle, a laptop put to sleep with
    notice) is asked back at once every time."""
    rec = running()
    for t in (0.0, 50.0, 100.0):
        assert rec.leaving(1, A, "stage 1 is leaving: sharing off", epoch=rec.epoch)
        assert rec.lost(1, A, "stage 1 is leaving: sharing off", epoch=rec.epoch)
        for ask in rec.begin([A, B], THREE, now=t, lost=1, ask_back=False):
            rec.answered(ask)
        rec.recovered(t + 1.0, 2, [(0, 15), (15, 30)], 0)
        rec.formed([B])
        assert rec.to_ask(t + 2.0) == [A]
        _taken_back(rec, A, now=t + 3.0)
