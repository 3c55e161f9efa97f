import pytest

from engine.core.heartbeat import Silence


def test_a_peer_silent_while_we_run_is_given_up_after_the_timeout():
    s = Silence(timeout=5.0, tick=0.25, now=100.0)
    t = 100.0
    while not s.advance(t := t + 0.25):
        pass
    assert t - 100.0 == pytest.approx(5.0)
    assert s.held == 0.0


def test_a_held_loop_counts_two_ticks_at_most():
    s = Silence(timeout=5.0, tick=0.25, now=0.0)
    assert not s.advance(0.25)
    assert not s.advance(30.25)        # our process did not run for 30 s
    assert s.counted == pytest.approx(0.75) and s.held == pytest.approx(29.5)
    t = 30.25
    while not s.advance(t := t + 0.25):
        pass
    assert t - 30.25 == pytest.approx(4.25)   # the rest of the timeout, in time we ran


def test_a_loop_held_often_stretches_the_wait_by_the_share_it_was_held():
    s = Silence(timeout=5.0, tick=0.25, now=0.0)
    t = 0.0
    while not s.advance(t := t + 1.0):       # every wake-up 0.75 s late
        pass
    assert t == pytest.approx(10.0)            # 0.5 counted a second: twice as long, not forever


def test_a_clock_that_steps_back_counts_nothing():
    s = Silence(timeout=1.0, tick=0.25, now=10.0)
    assert not s.advance(9.0) and s.counted == 0.0


@pytest.mark.parametrize("timeout,tick", [(0, 0.25), (5.0, 0)])
def test_nonsense_is_refused(timeout, tick):
    with pytest.raises(ValueError):
        Silence(timeout, tick, 0.0)
