"""WriteStall: when a peer counts as having read nothing (engine/wire/write_watch.py)."""

from engine.wire.write_watch import WriteStall


def test_bytes_that_never_leave_for_the_stall_time_are_a_stall_and_any_progress_resets_it():
    w = WriteStall(10.0)
    assert not w.stalled(0.0, 0)                 # nothing waiting: fine however long
    assert not w.stalled(100.0, 0)
    assert not w.stalled(101.0, 5000)            # waiting from here
    assert not w.stalled(105.0, 9000)            # more written, nothing read
    assert w.stalled(111.0, 9000)                # 10 s without a byte leaving
    w = WriteStall(10.0)
    w.stalled(0.0, 5000)
    assert not w.stalled(8.0, 4000)              # the peer read some: counted afresh
    assert not w.stalled(17.0, 4500)
    assert w.stalled(18.5, 4500)
