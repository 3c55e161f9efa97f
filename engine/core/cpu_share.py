"""How many cores a local pipeline may compute on while its owner uses the machine too.
Fed readings of CPU time (the machine's, and the pipeline's own processes'); pure.

A home machine is never idle: a browser tab or a game keeps a core busy. A stage that
computes a step on as many OpenMP threads as the machine has cores then waits at every
barrier of every operator for the thread the scheduler gave to that program, a few
milliseconds a time slice: on 2 cores with one busy program, a 3-stage pipeline's decode
went 6.5x slower, where losing one of two cores should cost at most 2x. So a step runs
on no more threads than there are cores the other programs leave free.

Other programs' load is the machine's busy time less the pipeline's own, over the last
second or so. Time at a raised nice value is not counted: a niced program (a build, an
indexer) yields its core to ours whenever we want it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.core.sizes import counted

# a reading this soon after the last one is too short to tell load from noise
MIN_INTERVAL_S = 0.25
# how long a burst of other programs' work keeps counting (an exponential average's time constant)
TIME_CONSTANT_S = 1.0
# other programs' cores below this are scheduler noise and short daemons, not a lost core
SLACK_CORES = 0.35


@dataclass(frozen=True)
class CpuReading:
    """Cumulative CPU seconds at time t: the machine's busy time (all cores, niced time
    left out) and the pipeline's own processes' (user + system)."""
    t: float
    machine_busy_s: float
    ours_s: float


class ForeignLoad:
    """The cores other programs keep busy, from a series of CpuReadings."""

    def __init__(self, n_cores: int):
        if n_cores < 1:
            raise ValueError("a machine has at least one core")
        self.n_cores = n_cores
        self.cores = 0.0            # other programs' busy cores, averaged
        self._last: CpuReading | None = None

    def due(self, t: float) -> bool:
        """Whether a reading at time t would count (so a caller can skip taking one)."""
        return self._last is None or t - self._last.t >= MIN_INTERVAL_S

    def observe(self, r: CpuReading) -> float:
        """Take a reading; returns the averaged estimate."""
        last = self._last
        if last is None:
            self._last = r
            return self.cores
        dt = r.t - last.t
        if dt < MIN_INTERVAL_S:
            return self.cores
        # a process of ours that ended drops its time from the sum: never count that as
        # the machine's programs giving cores back, nor below zero
        ours = max(0.0, r.ours_s - last.ours_s)
        busy = max(0.0, r.machine_busy_s - last.machine_busy_s)
        now = min(float(self.n_cores), max(0.0, (busy - ours) / dt))
        w = 1.0 - math.exp(-dt / TIME_CONSTANT_S)
        self.cores += w * (now - self.cores)
        self._last = r
        return self.cores


def usable_cores(n_cores: int, foreign_cores: float) -> int:
    """Cores a step may run threads on: those other programs leave, one core lost for each
    busy core of theirs beyond the slack, and never fewer than one."""
    lost = max(0, math.ceil(foreign_cores - SLACK_CORES))
    return max(1, n_cores - lost)


def step_threads(held: int, usable: int) -> int:
    """Threads for a step holding `held` cores when `usable` are free of other programs."""
    return max(1, min(held, usable))


def asked_threads(asked: int, n_cores: int) -> tuple[int, str | None]:
    """A --threads the owner gave, against the machine's cores: (the threads to use, what
    to tell them or None). OpenMP threads beyond the cores wait on each other at every
    barrier: `--threads 999` on two cores answered at 2.6 tok/s against 49.5 with 2,
    after a silent minute and a half."""
    if n_cores >= 1 and asked > n_cores:
        return n_cores, (f"--threads {asked} is more than this computer's {counted(n_cores, 'core')}: "
                         f"using {n_cores} (threads beyond the cores wait on each other)")
    return asked, None
