"""Where a decode round's time goes, process by process (POTLUCK_HOP_TRACE=DIR).

Two stage processes on one GPU ran at 0.69-0.78x one process in the GPU windows: about
2.5 ms a round that no kernel accounts for (bench/RESULTS.md). With POTLUCK_HOP_TRACE set,
the head and each stage process mark the points a decode round passes -- the head builds
its step, computes, frames the activations, hands them to the link; the stage receives,
checks, queues, computes, sends its tokens; the head reads them -- each mark a line
`<perf_counter_ns> <tag>` in DIR/<who>-<pid>.trace. perf_counter is CLOCK_MONOTONIC on
Linux, one clock for every process of a machine, so bench/hop_trace.py can line the
processes' marks up into rounds and print each segment's median.

Off (the default) a mark is one attribute test; on, a lock and an append (the lines are
written 512 at a time, or a second after the last write, and when flushed: a mark costs
no system call, and a pipeline still running has its marks on disk for bench/hop_trace.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("potluck.trace")

ENV = "POTLUCK_HOP_TRACE"
_BATCH = 512
_EVERY_NS = 1_000_000_000


class HopTrace:
    def __init__(self, folder: str | os.PathLike | None = None, who: str = "head"):
        self._path = None
        self._marks: list[tuple[int, str]] = []
        self._written = time.perf_counter_ns()
        self._lock = threading.Lock()
        if folder:
            path = Path(folder) / f"{who}-{os.getpid()}.trace"
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("")
            except OSError as exc:   # a diagnostic: the pipeline runs on without it
                log.warning("%s=%s: cannot write the trace there (%s); tracing is off", ENV, folder, exc)
            else:
                self._path = path

    @classmethod
    def from_env(cls, who: str) -> HopTrace:
        return cls(os.environ.get(ENV) or None, who)

    @property
    def on(self) -> bool:
        return self._path is not None

    def __call__(self, tag: str) -> None:
        if self._path is None:
            return
        now = time.perf_counter_ns()
        with self._lock:
            self._marks.append((now, tag))
            if len(self._marks) >= _BATCH or now - self._written >= _EVERY_NS:
                self._flush_locked()

    def flush(self) -> None:
        if self._path is None:
            return
        with self._lock:
            self._flush_locked()

    def _flush_locked(self) -> None:
        marks, self._marks = self._marks, []
        self._written = time.perf_counter_ns()
        if not marks:
            return
        try:
            with open(self._path, "a") as f:
                f.write("".join(f"{ns} {tag}\n" for ns, tag in marks))
        except OSError as exc:   # a full disk: stop marking rather than fail a step
            log.warning("%s: cannot write %s (%s); tracing is off", ENV, self._path, exc)
            self._path = None
