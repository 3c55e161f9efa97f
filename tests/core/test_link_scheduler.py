"""The link scheduler decides alone, from events and a clock: no sockets needed."""

import pytest

from engine.core.link_scheduler import RTT_MIN_RISE, LinkScheduler, next_rtt_min


def drain(s, now=0.0, limit=10_000):
    out = []
    while (x := s.next_send(now)) is not None and len(out) < limit:
        out.append(x)
    return out


def test_fifo_sends_whole_volumes_in_arrival_order():
    s = LinkScheduler(mode="fifo")
    s.enqueue(1, "prefill", 10_000_000, 0.0)
    s.enqueue(2, "decode", 8192, 0.1)
    sends = drain(s)
    assert [(x.volume_id, x.length, x.last) for x in sends] == [(1, 10_000_000, True), (2, 8192, True)]


def test_decode_overtakes_a_queued_prefill():
    s = LinkScheduler(mode="fixed", fixed_chunk=1 << 20)
    s.enqueue(1, "prefill", 10 << 20, 0.0)
    first = s.next_send(0.0)
    assert (first.volume_id, first.length) == (1, 1 << 20)  # one chunk, not the whole prefill
    s.enqueue(2, "decode", 8192, 0.01)
    nxt = s.next_send(0.01)
    assert nxt.volume_id == 2 and nxt.last


def test_prefill_chunks_cover_the_volume_exactly():
    s = LinkScheduler(mode="fixed", fixed_chunk=3000)
    s.enqueue(7, "prefill", 10_000, 0.0)
    sends = drain(s)
    assert [x.offset for x in sends] == [0, 3000, 6000, 9000]
    assert sum(x.length for x in sends) == 10_000
    assert [x.last for x in sends] == [False, False, False, True]


def test_waiting_weight_sends_prefill_remainder_whole_after_n_decodes():
    n = 5
    s = LinkScheduler(mode="fixed", fixed_chunk=1000, n_wait=n)
    s.enqueue(1, "prefill", 100_000, 0.0)
    for i in range(n):
        s.enqueue(100 + i, "decode", 10, 0.0)
    s.enqueue(999, "decode", 10, 0.0)
    sends = [s.next_send(0.0) for _ in range(n)]
    assert all(x.kind == "decode" for x in sends) and s.w == n
    whole = s.next_send(0.0)
    assert whole.kind == "prefill" and whole.length == 100_000 and whole.last  # no starvation
    assert s.w == 0
    assert s.next_send(0.0).volume_id == 999


def test_decode_sends_without_waiting_prefill_do_not_count():
    s = LinkScheduler(mode="jit", n_wait=2)
    for i in range(5):
        s.enqueue(i, "decode", 10, 0.0)
    drain(s)
    assert s.w == 0


def test_jit_chunk_fits_the_running_decode_window():
    s = LinkScheduler(mode="jit", decode_time=lambda n: 0.050, min_chunk=1)
    s.link.observe_goodput(1e6)          # 1 MB/s
    s.decode_compute_started(10.0, 8)    # finishes at 10.05
    s.enqueue(1, "prefill", 10 << 20, 10.0)
    x = s.next_send(10.02)               # 30 ms left -> 30 kB
    assert x.length == pytest.approx(30_000, rel=0.01)


def test_jit_window_when_no_decode_runs_uses_the_pipeline_loop():
    s = LinkScheduler(mode="jit", decode_time=lambda n: 0.010, loop_time=0.200, min_chunk=1)
    s.link.observe_goodput(2e6)
    s.decode_compute_started(0.0, 4)
    s.decode_compute_finished(0.010)     # t_p = 0.01; next decode at 0.21
    assert s.window(0.110) == pytest.approx(0.100)
    s.enqueue(1, "prefill", 10 << 20, 0.11)
    assert s.next_send(0.110).length == pytest.approx(200_000, rel=0.01)


def test_jit_learns_the_loop_from_decode_cadence():
    s = LinkScheduler(mode="jit", decode_time=lambda n: 0.010)
    t = 0.0
    for _ in range(6):                   # a decode every 100 ms
        s.decode_compute_started(t, 1)
        s.decode_compute_finished(t + 0.010)
        t += 0.100
    # last decode ended at t-0.09; the next one ends (needs the link) 100 ms later
    assert s.window(t - 0.100 + 0.010 + 0.030) == pytest.approx(0.070, abs=0.005)


def test_jit_chunk_never_below_minimum_and_never_beyond_volume():
    s = LinkScheduler(mode="jit", decode_time=lambda n: 0.0, min_chunk=4096)
    s.enqueue(1, "prefill", 1000, 0.0)
    x = s.next_send(0.0)
    assert x.length == 1000 and x.last
    s.enqueue(2, "prefill", 1 << 20, 0.0)
    assert s.next_send(0.0).length == 4096


def test_bad_events_are_refused():
    s = LinkScheduler()
    with pytest.raises(ValueError):
        s.enqueue(1, "other", 10, 0.0)
    with pytest.raises(ValueError):
        s.enqueue(1, "decode", 0, 0.0)
    s.enqueue(1, "decode", 10, 0.0)
    with pytest.raises(ValueError):
        s.enqueue(1, "decode", 10, 0.0)
    with pytest.raises(ValueError):
        LinkScheduler(mode="lifo")
    with pytest.raises(ValueError):
        LinkScheduler(n_wait=0)


def test_goodput_and_rtt_estimates_follow_the_link():
    s = LinkScheduler()
    for _ in range(20):
        s.link.observe_goodput(1e6)
        s.link.observe_rtt(0.03)
    assert s.link.bandwidth == pytest.approx(1e6, rel=0.01)
    for _ in range(20):
        s.link.observe_goodput(4e6)     # the link got faster: the estimate follows
    assert s.link.bandwidth == pytest.approx(4e6, rel=0.02)
    assert s.link.rtt == pytest.approx(0.03)


# ---- goodput from acknowledgements ------------------------------------------------------
def test_goodput_is_measured_only_while_the_link_has_a_backlog():
    from engine.core.link_scheduler import GOODPUT_SPAN, GoodputMeter, LinkEstimate

    est = LinkEstimate()
    meter = GoodputMeter(est)
    meter.on_ack(0.0, 1000, backlog=True)              # opens the window: its bytes came before
    meter.on_ack(GOODPUT_SPAN / 2, 50_000, backlog=True)
    assert est.samples == 0                             # too short a span to say anything
    meter.on_ack(0.1, 50_000, backlog=True)
    assert est.samples == 1 and est.bandwidth == pytest.approx(100_000 / 0.1)
    meter.on_ack(0.2, 10, backlog=False)                # the last ack before the link went idle
    assert est.samples == 2                             # ... still counts, then the window closes
    meter.on_ack(5.0, 10, backlog=True)                 # a new window, not 4.8 idle seconds
    meter.on_ack(5.1, 20_000, backlog=True)
    assert est.samples == 3
    assert est.bandwidth == pytest.approx(0.75 * (0.75 * 1e6 + 0.25 * 100) + 0.25 * 200_000)


def test_the_rtt_floor_rises_at_once_only_by_what_our_own_bytes_cannot_explain():
    # first figure: taken as it is
    assert next_rtt_min(None, 0.05, ahead=0.02) == 0.05
    # a ping that waited behind 40 ms of our own bytes: 70 ms says no more than 30 ms of path
    assert next_rtt_min(0.030, 0.070, ahead=0.040) == pytest.approx(0.030 * RTT_MIN_RISE)
    # ... but 130 ms behind 10 ms of ours: the receiver answers 100 ms later than it did
    assert next_rtt_min(0.030, 0.130, ahead=0.010) == pytest.approx(0.120)
    # nothing of ours ahead: the round trip is the path's
    assert next_rtt_min(0.030, 0.130, ahead=0.0) == pytest.approx(0.130)
    # and a shorter round trip is always the floor
    assert next_rtt_min(0.130, 0.030, ahead=0.0) == pytest.approx(0.030)
    assert next_rtt_min(0.130, 0.030, ahead=0.5) == pytest.approx(0.030)
