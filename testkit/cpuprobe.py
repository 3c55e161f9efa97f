"""How much of the machine other processes used while a benchmark measured (bench/)."""

from __future__ import annotations

import time


class CpuProbe:
    """CPU time the rest of the machine used while we measured, in cores.

    Machine-wide busy time minus this process tree's (stage processes included). Two
    OpenMP threads sharing a core with someone else's process stall at every barrier,
    so even half a core of foreign load skews a run badly.
    """

    def __init__(self):
        import psutil

        self.psutil = psutil
        self.me = psutil.Process()

    def sample(self) -> tuple[float, float, float]:
        t = self.psutil.cpu_times()
        busy = t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)
        own = 0.0
        for p in [self.me] + self.me.children(recursive=True):
            try:
                c = p.cpu_times()
                own += c.user + c.system
            except self.psutil.Error:
                pass
        return time.perf_counter(), busy, own

    @staticmethod
    def foreign(a, b) -> float:
        return max(0.0, (b[1] - a[1]) - (b[2] - a[2])) / max(b[0] - a[0], 1e-9)
