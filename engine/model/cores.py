"""Stage processes on one machine share its cores: each owns some, borrows idle ones.

A local pipeline (`potluck chat`, the tests, bench/overhead.py) runs its stages as
processes on the same CPU. Giving each a fixed share of the cores (1 thread each for
2 stages on 2 cores) keeps OpenMP threads from outnumbering cores -- they stall each
other at every barrier when they do -- but wastes half the machine whenever only one
stage has work: a lone prompt passes the stages one after another, each on one core,
and time to first token came out well above the single process's (bench/overhead.py
measures this; see bench/RESULTS.md).

So the cores are leases. Core i is a lock file; a process holds its *home* cores
while it computes a step and also takes whichever other cores are free at that
moment (non-blocking), running the step with one thread per core held. Every step
borrows, decode steps of one row included: with whichever matrix product this machine
runs faster for a step's few rows (engine/model/cpu_linear.py) a second thread speeds up
a decode step of the default model, of one row and of eight alike (steps under four rows
did not borrow once: a 3-stage pipeline's 1-request step period shortened by about a
tenth when they began to). So the head gives such a pipeline
one micro-batch: each stage in turn runs it on every core, as one process would
(bench/overhead.py, 8 concurrent requests: one micro-batch on both cores decodes
clearly closer to the single process's pace than 2 micro-batches of one core each;
see bench/RESULTS.md).

A borrowed core goes back as soon as its owner wants it, not at the end of the step:
an owner that finds its core lent out raises a flag (holds want-i.lock) and waits;
the borrower checks the flags before each decoder layer (`checkpoint`) and drops the
wanted core, finishing its step with fewer threads. So a stage with decode work waits
at most one layer for a neighbour's prompt, and the pipeline's cadence holds.
The thread count changes at most a few times per step (switching it before every
layer was markedly slower: OpenMP re-forms its team each time).

Taking turns needs OpenMP's idle threads to get out of the way. libgomp's worker
threads spin for a while after each parallel region (300,000 iterations by default,
milliseconds) before they sleep: a stage that has just handed its step on keeps both
cores busy spinning while the next stage computes on them, and every barrier of that
stage waits behind the spinners (a 2-stage pipeline fell well behind the single
process). A short spin (`OPENMP_ENV`) still covers the gaps between one step's
operators (microseconds) but ends long before the hop to the next stage does, and
brings the pipeline most of the way back (bench/overhead.py measures this; its runs
vary by as much as this machine drifts; see bench/RESULTS.md). Not spinning at all
(OMP_WAIT_POLICY=passive) made every step's operators slower too.

Each process computes on one thread (its compute executor's). libgomp gives every
thread that starts a parallel region a worker pool of its own, and once a process
manages more OpenMP threads than there are cores it cuts spinning short: after a
second thread had run one 2-thread matrix product, a stage's decode step became
markedly slower (a one-off scratch micro-benchmark). Computing decode steps on the
event loop to save two thread hand-offs did exactly that: bench/overhead.py measured
the 2- and 3-stage pipelines several percent further behind the single process than
before (see bench/RESULTS.md), and the change was reverted.

The machine is its owner's first. A step runs on no more threads than the cores other
programs leave free (engine/core/cpu_share.py decides, from the machine's busy time less
the pipeline's own: each process of the pipeline leaves its pid in the lease directory),
and borrows no core beyond them: with a busy program on one of two cores, a step on two
OpenMP threads waited at every operator's barrier for the one the scheduler had given
away, and the default 3-stage pipeline decoded 6.5x slower (bench/busy_cpu.py).

Locks are flock(2) on files in a directory the pipeline's parent creates; a process
that dies releases its locks with its file descriptors. Windows has no flock with shared
locks, so there (LEASES is False) local stages keep to their home cores and never borrow.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from typing import Callable

from engine.core.cpu_share import CpuReading, ForeignLoad, step_threads, usable_cores

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

LEASES = fcntl is not None

# steps of at least this many tokens borrow idle cores: every step does (see above)
BORROW_MIN_TOKENS = 1

# For every process of a pipeline that shares this CPU, set before torch is imported
# (libgomp reads it once, at load). A setting of the user's own wins.
OPENMP_ENV = {"GOMP_SPINCOUNT": "20000"}


def apply_openmp_env(env) -> None:
    """Put OPENMP_ENV into `env` (os.environ, or a child's environment) unless set there."""
    for k, v in OPENMP_ENV.items():
        env.setdefault(k, v)


def home_cores(index: int, processes: int, n_cores: int) -> list[int]:
    """Cores owned by process `index` of `processes` sharing n_cores.

    With at least a core each, the cores are dealt out in contiguous runs; with more
    processes than cores, processes share a home core (and so take turns on it).
    """
    if processes <= n_cores:
        per = n_cores // processes
        return list(range(index * per, (index + 1) * per))
    return [index % n_cores]


def cpu_shares(processes: int, n_cores: int) -> list[float]:
    """Each process's share of the CPU: its home cores, split among their co-owners."""
    homes = [home_cores(i, processes, n_cores) for i in range(processes)]
    return [sum(1 / sum(c in h for h in homes) for c in home) for home in homes]


class CpuReader:
    """CpuReadings of this machine for the pipeline whose lease directory this is: the
    machine's busy time from psutil (niced time is its own column, left out) and the CPU
    time of the processes that left their pid there.

    The pipeline's time is summed from each process's growth since the last reading, so
    it never falls: a stage that dies (killed, or let go) takes its whole past CPU time
    with it, and a plain sum of what the living have used would drop by that much. Such a
    drop made every busy core of the interval count as other programs' -- the interval
    that spans a rearrangement, both survivors loading layers -- and the head replayed its
    history on one thread instead of two."""

    def __init__(self, directory: str):
        self.directory = directory
        self._procs: dict[int, object] = {}
        self._last: dict[int, float] = {}   # pid -> its CPU seconds at the last reading
        self._ours = 0.0

    def __call__(self) -> CpuReading:
        import psutil

        t = time.monotonic()
        c = psutil.cpu_times()
        busy = c.user + c.system + sum(getattr(c, k, 0.0) for k in ("irq", "softirq", "steal"))
        seen: dict[int, float] = {}
        for name in os.listdir(self.directory):
            if not name.startswith("pid-"):
                continue
            try:
                pid = int(name[4:])
                p = self._procs.get(pid) or self._procs.setdefault(pid, psutil.Process(pid))
                times = p.cpu_times()
                seen[pid] = times.user + times.system
            except (psutil.Error, ValueError):  # ended (its file stays after a SIGKILL)
                self._procs.pop(pid, None)
        # a process first seen counts all its time: it ran in this interval, and counting
        # too much as ours only errs towards leaving the owner's programs their cores
        self._ours += sum(max(0.0, s - self._last.get(pid, 0.0)) for pid, s in seen.items())
        self._last = seen
        return CpuReading(t, busy, self._ours)


def no_others() -> CpuReading:
    """A reading of a machine with no other programs on it."""
    return CpuReading(time.monotonic(), 0.0, 0.0)


class CoreLease:
    def __init__(self, directory: str, home: list[int], n_cores: int,
                 borrow_min_tokens: int = BORROW_MIN_TOKENS, set_threads=None,
                 read_cpu: Callable[[], CpuReading] | None = None):
        """read_cpu: the machine's readings (a CpuReader over the directory by default)."""
        if not home or any(not 0 <= c < n_cores for c in home):
            raise ValueError(f"home cores {home} outside 0..{n_cores - 1}")
        self.n_cores = n_cores
        self.home = sorted(set(home))
        self.others = [c for c in range(n_cores) if c not in self.home]
        self.borrow_min_tokens = borrow_min_tokens
        def lock_file(name):
            return os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT, 0o600)

        self._fds = {c: lock_file(f"core-{c}.lock") for c in range(n_cores)}
        self._want = {c: lock_file(f"want-{c}.lock") for c in range(n_cores)}
        self._borrowed: list[int] = []
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self._set_threads = set_threads
        self._threads = None
        # other programs' load: this process is one of the pipeline's, whose time is not theirs
        self._pid_file = os.path.join(directory, f"pid-{os.getpid()}")
        with open(self._pid_file, "w"):
            pass
        if read_cpu is None:
            # POTLUCK_CPU_SHARE=0: every step borrows every idle core whatever else runs
            # (bench/busy_cpu.py --compare measures the difference side by side)
            read_cpu = CpuReader(directory) if os.environ.get("POTLUCK_CPU_SHARE", "1") != "0" else no_others
        self._read_cpu = read_cpu
        self.foreign = ForeignLoad(n_cores)
        self.usable = n_cores
        self._own_dir: str | None = None   # solo(): the directory is this lease's to remove
        self.capped_steps = 0     # steps that ran on fewer threads than cores held, for other programs
        self.borrowed_steps = 0   # steps that ran with borrowed cores
        self.returned_cores = 0   # borrowed cores handed back mid-step to a waiting owner

    @classmethod
    def solo(cls, **kw) -> "CoreLease | None":
        """A lease of every core for a process that computes alone on this machine (a head
        whose stages are elsewhere, a friend's shared stage): nobody to lend to or borrow
        from, but its steps still run on no more threads than other programs leave free.
        Without it such a process ran each step on every core whatever else was running:
        beside a busy program a 1-stage pipeline of a tiny model decoded over ten times
        slower than with one thread (bench/busy_cpu.py --stages 1). None where there are
        no leases (Windows). kw: the constructor's (a test's readings)."""
        if not LEASES:
            return None
        directory = tempfile.mkdtemp(prefix="potluck-cores-")
        n = os.cpu_count() or 1
        lease = cls(directory, list(range(n)), n, **kw)
        lease._own_dir = directory
        return lease

    @classmethod
    def from_spec(cls, spec: str) -> "CoreLease":
        """'DIR:HOME:N' as passed on a stage's command line (HOME: comma-separated)."""
        directory, home, n = spec.rsplit(":", 2)
        return cls(directory, [int(c) for c in home.split(",")], int(n))

    @staticmethod
    def spec(directory: str, home: list[int], n_cores: int) -> str:
        return f"{directory}:{','.join(map(str, home))}:{n_cores}"

    @contextmanager
    def hold(self, n_tokens: int):
        """Hold this process's cores (and idle ones, for a big step) while computing."""
        if not self._fds:   # closed (its owner stopped while a step still ran): lock nothing
            yield self._threads or 1
            return
        held = []
        try:
            for c in self.home:
                self._take_home(c)
                held.append(c)
            usable = self._usable()
            if n_tokens >= self.borrow_min_tokens:
                for c in self.others:
                    if len(held) + len(self._borrowed) >= usable:
                        break       # the rest are other programs'
                    try:
                        fcntl.flock(self._fds[c], fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except BlockingIOError:
                        continue
                    self._borrowed.append(c)
            if self._borrowed:
                self.borrowed_steps += 1
            threads = step_threads(len(held) + len(self._borrowed), usable)
            if threads < len(held):
                self.capped_steps += 1
            self._threads_for(threads)
            yield threads
        finally:
            # (a lease closed meanwhile has no descriptors left: its locks went with them)
            for c in self._borrowed:
                if c in self._fds:
                    fcntl.flock(self._fds[c], fcntl.LOCK_UN)
            self._borrowed.clear()
            for c in reversed(held):
                if c in self._fds:
                    fcntl.flock(self._fds[c], fcntl.LOCK_UN)

    def checkpoint(self) -> None:
        """Between layers: hand back every borrowed core whose owner is waiting for it."""
        if not self._borrowed or not self._fds:
            return
        keep = []
        for c in self._borrowed:
            try:
                fcntl.flock(self._want[c], fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # the owner holds its want flag: give the core back
                fcntl.flock(self._fds[c], fcntl.LOCK_UN)
                self.returned_cores += 1
                continue
            fcntl.flock(self._want[c], fcntl.LOCK_UN)
            keep.append(c)
        if len(keep) != len(self._borrowed):
            self._borrowed = keep
            self._threads_for(step_threads(len(self.home) + len(keep), self.usable))

    def _usable(self) -> int:
        """Cores free of other programs, from a fresh reading when the last is old enough."""
        if self.foreign.due(time.monotonic()):
            try:
                self.foreign.observe(self._read_cpu())
            except (OSError, ValueError):  # no reading this time: the estimate stands
                pass
        self.usable = usable_cores(self.n_cores, self.foreign.cores)
        return self.usable

    def _take_home(self, c: int) -> None:
        try:
            fcntl.flock(self._fds[c], fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        # lent out (or, with more processes than cores, in a co-owner's turn): raise
        # the flag so a borrower returns it at its next layer, then wait for it
        fcntl.flock(self._want[c], fcntl.LOCK_EX)
        try:
            fcntl.flock(self._fds[c], fcntl.LOCK_EX)
        finally:
            fcntl.flock(self._want[c], fcntl.LOCK_UN)

    def sync_threads(self) -> None:
        """Set this thread's torch thread count to the lease's (torch keeps one per
        thread: a decode step cutting into a parked step runs on another thread)."""
        if self._threads is not None:
            self._set_threads(self._threads)

    def _threads_for(self, n: int) -> None:
        if n != self._threads:
            self._set_threads(n)
            self._threads = n

    def close(self):
        try:
            os.unlink(self._pid_file)
        except OSError:
            pass
        for fd in (*self._fds.values(), *self._want.values()):
            os.close(fd)
        self._fds.clear()
        self._want.clear()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None
