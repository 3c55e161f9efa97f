"""Co-located stage processes lease cores from one another (engine/model/cores.py).

flock(2) locks belong to open file descriptions, so two CoreLease objects in one
process contend exactly as two processes do.
"""

import os
import threading
import time

import pytest

from engine.core.cpu_share import CpuReading
from engine.model.cores import CoreLease, CpuReader, home_cores


def quiet():
    """A machine nobody else uses (these tests share a real, busy one): nothing but ours."""
    return CpuReading(time.monotonic(), 0.0, 0.0)


def lease(tmp_path, home, n=2, log=None, read_cpu=quiet):
    return CoreLease(str(tmp_path), home, n, borrow_min_tokens=16,
                     set_threads=(log.append if log is not None else (lambda t: None)), read_cpu=read_cpu)


class OneBusyProgram:
    """Readings of a machine where another program keeps one core busy: the machine's busy
    time grows a second per second more than ours."""

    def __init__(self):
        self.t0 = time.monotonic()

    def __call__(self):
        t = time.monotonic()
        return CpuReading(t, 1.0 * (t - self.t0), 0.0)


def test_home_cores_deal_out_the_machine():
    assert home_cores(0, 2, 2) == [0] and home_cores(1, 2, 2) == [1]
    assert home_cores(0, 2, 8) == [0, 1, 2, 3] and home_cores(1, 2, 8) == [4, 5, 6, 7]
    assert [home_cores(i, 3, 2) for i in range(3)] == [[0], [1], [0]]  # more stages than cores: share


def test_big_step_borrows_an_idle_core_small_step_does_not(tmp_path):
    log = []
    a = lease(tmp_path, [0], log=log)
    lease(tmp_path, [1])  # the other process, idle
    with a.hold(64) as threads:
        assert threads == 2
    with a.hold(4) as threads:
        assert threads == 1
    assert log == [2, 1] and a.borrowed_steps == 1


def test_a_busy_core_is_not_borrowed(tmp_path):
    a, b = lease(tmp_path, [0]), lease(tmp_path, [1])
    with b.hold(1):
        with a.hold(64) as threads:
            assert threads == 1


def test_owner_gets_a_lent_core_back_at_the_borrowers_next_layer(tmp_path):
    log = []
    a, b = lease(tmp_path, [0], log=log), lease(tmp_path, [1])
    got = threading.Event()
    with a.hold(64) as threads:
        assert threads == 2  # holds b's core too
        a.checkpoint()  # nobody waiting: keeps it
        assert log == [2]

        def owner():
            with b.hold(1):
                got.set()

        t = threading.Thread(target=owner)
        t.start()
        assert not got.wait(0.3)  # b waits while its core is lent out...
        a.checkpoint()  # ...until a's next layer boundary
        assert got.wait(10)
        assert log == [2, 1] and a.returned_cores == 1  # a finishes its step on one thread
        t.join()
    with a.hold(64) as threads:  # b is idle again: borrowable
        assert threads == 2


def test_processes_sharing_a_home_core_take_turns(tmp_path):
    a, c = lease(tmp_path, [0]), lease(tmp_path, [0])
    inside = []
    with a.hold(1):
        t = threading.Thread(target=lambda: c.hold(1).__enter__() and inside.append(1))
        t.daemon = True
        t.start()
        t.join(0.3)
        assert not inside


def test_bad_home_is_refused(tmp_path):
    with pytest.raises(ValueError):
        CoreLease(str(tmp_path), [2], 2, set_threads=lambda t: None)
    spec = CoreLease.spec(str(tmp_path), [1], 2)
    assert CoreLease.from_spec(spec).home == [1]


def test_local_pipeline_cpu_shares():
    from engine.pipeline.local import LocalStages

    n = __import__("os").cpu_count() or 1
    shares = LocalStages(2, share_cores=False).cpu_shares  # 3 processes
    assert len(shares) == 3 and sum(shares) <= n + 1e-9 and min(shares) > 0
    if n == 2:
        assert shares == [0.5, 1.0, 0.5]  # head and stage 2 take turns on core 0


def test_a_busy_program_keeps_its_core_a_step_runs_on_what_is_left(tmp_path):
    """With another program busy on one of two cores, a big step borrows nothing and runs
    on one thread (two would wait at every barrier for the core the scheduler gave away)."""
    log = []
    busy = OneBusyProgram()
    a = lease(tmp_path, [0], log=log, read_cpu=busy)
    lease(tmp_path, [1])                      # the other stage, idle: its core is free to borrow
    with a.hold(64) as threads:               # the first reading only starts the clock
        assert threads == 2
    deadline = time.monotonic() + 30
    while a.usable == 2 and time.monotonic() < deadline:
        time.sleep(0.3)
        with a.hold(64) as threads:
            pass
    assert a.usable == 1 and threads == 1 and log[-1] == 1
    assert a.foreign.cores > 0.35          # past the slack: a core lost, within a second or so


def test_two_home_cores_run_on_one_thread_beside_a_busy_program(tmp_path):
    busy = OneBusyProgram()
    a = lease(tmp_path, [0, 1], log=[], read_cpu=busy)
    deadline = time.monotonic() + 30
    while a.usable == 2 and time.monotonic() < deadline:
        time.sleep(0.3)
        with a.hold(1) as threads:
            pass
    assert threads == 1 and a.capped_steps >= 1


def test_the_reader_counts_the_pipelines_own_processes_not_the_machines_others(tmp_path):
    """CpuReader: this process left its pid (the lease did), so the CPU it burns is ours."""
    a = CoreLease(str(tmp_path), [0], 2, set_threads=lambda t: None)
    assert os.path.exists(tmp_path / f"pid-{os.getpid()}")
    read = CpuReader(str(tmp_path))
    r0 = read()
    spin_until = time.process_time() + 0.5
    while time.process_time() < spin_until:
        pass
    r1 = read()
    assert r1.ours_s - r0.ours_s >= 0.4          # our spin
    assert r1.machine_busy_s - r0.machine_busy_s >= 0.4   # the machine saw it too
    a.close()
    assert not os.path.exists(tmp_path / f"pid-{os.getpid()}")
    r2 = read()
    spin_until = time.process_time() + 0.3
    while time.process_time() < spin_until:
        pass
    assert read().ours_s - r2.ours_s < 0.1        # gone from the pipeline with its lease


def test_a_process_of_the_pipeline_that_dies_takes_nothing_back(tmp_path):
    """A stage killed mid-pipeline: its past CPU time leaves the sum with it. The reading
    after must not fall: a fall made the survivors' work count as other programs' (the
    machine's busy time less ours, over an interval where ours went down) and the
    rearranged pipeline computed on one thread."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time() + 1.5\n"
                              "while time.process_time() < t: pass\ntime.sleep(60)"])
    try:
        (tmp_path / f"pid-{child.pid}").touch()
        (tmp_path / f"pid-{os.getpid()}").touch()    # this process: the stage that survives
        read = CpuReader(str(tmp_path))
        read()
        import psutil

        proc = psutil.Process(child.pid)
        deadline = time.monotonic() + 30
        while sum(proc.cpu_times()[:2]) < 1.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        r1 = read()
        child.kill()
        child.wait()
        r2 = read()
        spin_until = time.process_time() + 0.6
        while time.process_time() < spin_until:
            pass
        r3 = read()
        assert r2.ours_s >= r1.ours_s            # the dead stage's 1.5 s did not leave the sum
        assert r3.ours_s >= r2.ours_s + 0.5      # and the survivor's spin is counted as ours
    finally:
        child.kill()


def test_a_process_alone_leases_every_core_and_keeps_off_a_busy_one():
    """CoreLease.solo: a head whose stages are elsewhere, a friend's shared stage."""
    n = os.cpu_count() or 1
    log = []
    a = CoreLease.solo(set_threads=log.append, read_cpu=OneBusyProgram())
    directory = a._own_dir
    assert a.home == list(range(n)) and a.others == [] and os.path.isdir(directory)
    deadline = time.monotonic() + 30
    threads = n
    while n > 1 and a.usable == n and time.monotonic() < deadline:
        time.sleep(0.3)
        with a.hold(1) as threads:
            pass
    assert threads == max(1, n - 1), (threads, a.usable)
    a.close()
    assert not os.path.exists(directory)
    with a.hold(1) as after:    # a step that was still running when its owner stopped
        pass
    assert after >= 1


async def test_a_stage_server_alone_on_its_cpu_leases_them_and_lets_go_when_closed():
    from engine.pipeline.stage_server import StageServer

    alone = StageServer()
    fixed = StageServer(threads=1)
    try:
        assert alone.cores is not None and alone.cores.home == list(range(os.cpu_count() or 1))
        assert fixed.cores is None      # --threads fixes it: no lease
        directory = alone.cores._own_dir
    finally:
        await alone.close()
        await fixed.close()
    assert not os.path.exists(directory)
