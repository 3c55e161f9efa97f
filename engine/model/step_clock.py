"""How long a GPU stage's steps took, read from CUDA events once the steps have passed.

A stage times its steps in service (engine/core/profile.py StepLog): the link scheduler
and the head's micro-batch count follow what it measures. On a GPU a step's launches
return long before its kernels finish, so a clock read around them needs a synchronize
after every step, and a last stage's draw then launched its kernels only once the step
was done: the chat's sampled draw is some thirty small launches, with the GPU idle
between them. Two events around the step time it on the device instead. A step's figure
is read at a later step, once its end has passed, and nothing waits for it: whatever
reads the step's output (its tokens, its activations for the next stage) waits for the
step anyway.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

# steps whose figures are kept waiting to be read; older ones are dropped unread (a
# stage stepping faster than it reads back would otherwise grow the queue)
MAX_PENDING = 64


def cuda_event():
    import torch

    return torch.cuda.Event(enable_timing=True)


class StepClock:
    def __init__(self, event: Callable = cuda_event, max_pending: int = MAX_PENDING):
        self._event = event
        self._pending: deque = deque()
        self.max_pending = max_pending
        # a stage steps from two threads when decode steps cut into prompt steps
        # (engine/core/step_gate.py): one reader at a time takes what has passed
        self._lock = threading.Lock()

    def start(self):
        """Marks the start of a step on the current stream; give it to stop()."""
        e = self._event()
        e.record()
        return e

    def stop(self, start, kind: str, n: int) -> None:
        """Marks the end of the step begun at `start`, counted as a `kind` step of n."""
        end = self._event()
        end.record()
        with self._lock:
            self._pending.append((start, end, kind, n))
            while len(self._pending) > self.max_pending:
                self._pending.popleft()

    def passed(self) -> list[tuple[str, int, float]]:
        """(kind, n, seconds) of every step whose end has passed, oldest first. Steps end
        in the order they were queued on the stream, so the first still running holds
        the ones behind it back."""
        out = []
        with self._lock:
            while self._pending and self._pending[0][1].query():
                start, end, kind, n = self._pending.popleft()
                out.append((kind, n, start.elapsed_time(end) / 1e3))
        return out
