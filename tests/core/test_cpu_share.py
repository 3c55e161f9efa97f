"""engine/core/cpu_share.py: other programs' load from CPU-time readings, and the
threads a step may use beside them."""

import pytest

from engine.core.cpu_share import (MIN_INTERVAL_S, CpuReading, ForeignLoad, asked_threads, step_threads,
                                   usable_cores)


def feed(load: ForeignLoad, seconds: float, machine_cores: float, our_cores: float, t0=0.0, m0=0.0, o0=0.0, dt=0.5):
    """Readings every dt for `seconds`: the machine busy on machine_cores, ours on our_cores."""
    t, m, o = t0, m0, o0
    load.observe(CpuReading(t, m, o))
    while t < t0 + seconds:
        t, m, o = t + dt, m + machine_cores * dt, o + our_cores * dt
        load.observe(CpuReading(t, m, o))
    return t, m, o


def test_a_quiet_machine_has_no_foreign_load():
    load = ForeignLoad(2)
    feed(load, 5, machine_cores=1.9, our_cores=1.9)       # all the busy time is ours
    assert load.cores == pytest.approx(0.0, abs=1e-9)
    assert usable_cores(2, load.cores) == 2


def test_one_busy_program_takes_one_core_and_gives_it_back():
    load = ForeignLoad(2)
    t, m, o = feed(load, 5, machine_cores=2.0, our_cores=1.0)
    assert load.cores == pytest.approx(1.0, abs=0.02)
    assert usable_cores(2, load.cores) == 1
    feed(load, 5, machine_cores=1.0, our_cores=1.0, t0=t, m0=m, o0=o)   # the program ended
    assert load.cores < 0.05 and usable_cores(2, load.cores) == 2


def test_a_short_burst_does_not_cost_a_core():
    load = ForeignLoad(2)
    t, m, o = feed(load, 5, machine_cores=1.0, our_cores=1.0)
    load.observe(CpuReading(t + 0.25, m + 0.5, o + 0.25))     # a quarter second of a daemon
    assert usable_cores(2, load.cores) == 2


def test_readings_too_close_together_are_skipped_and_ended_processes_are_not_a_gift():
    load = ForeignLoad(2)
    load.observe(CpuReading(0.0, 0.0, 10.0))
    assert not load.due(MIN_INTERVAL_S / 2) and load.due(MIN_INTERVAL_S)
    assert load.observe(CpuReading(MIN_INTERVAL_S / 2, 5.0, 10.0)) == 0.0   # too soon: ignored
    # a stage of ours ended: its 10 s left our sum; nothing foreign follows from that
    load.observe(CpuReading(1.0, 0.5, 0.0))
    assert load.cores == pytest.approx(0.5 * (1 - 2.718281828 ** -1.0), rel=0.01)
    with pytest.raises(ValueError):
        ForeignLoad(0)


def test_usable_cores_and_step_threads():
    assert usable_cores(2, 0.3) == 2            # noise
    assert usable_cores(2, 0.9) == 1
    assert usable_cores(2, 2.0) == 1            # never fewer than one
    assert usable_cores(8, 1.0) == 7
    assert usable_cores(8, 3.2) == 5
    assert step_threads(2, 1) == 1 and step_threads(1, 2) == 1 and step_threads(4, 7) == 4
    assert step_threads(0, 1) == 1


def test_threads_asked_beyond_the_cores_are_the_cores_and_said():
    threads, note = asked_threads(999, 2)
    assert threads == 2 and "--threads 999" in note and "2 cores" in note
    assert asked_threads(2, 2) == (2, None) and asked_threads(1, 8) == (1, None)
