"""Decode first on the compute too: a decode step may cut into a prompt's step between layers.

The link scheduler (link_scheduler.py) keeps a decode volume from waiting behind a
prompt's activations on the wire; at the stage the same volume then met the same
head-of-line blocking on the compute thread: a 64-token prompt chunk takes several
decode steps' time on a CPU stage, and every decode step that arrived meanwhile waited
for all of it, on every stage, once per chunk (bench/simulator.py on a cell measured at
the paper's 100 Mbit/s / 30 ms point, 2 stages, predicts a TPOT several percent lower
when a decode step goes ahead of a running prompt step; see bench/RESULTS.md).

So with Head(compute="decode-first") (`--compute decode-first`) a stage computes on
two threads that take turns through this gate: prompt steps on one, decode steps on
the other. One step computes at a time. A decode step that arrives while a prompt
step runs raises `wants`; the prompt step's thread checks it before each of its
decoder layers but the first (`checkpoint`, a layer pre-hook of StageModel) and
parks there until the decode step is done. A waiting prompt step starts only when no
decode step waits. After MAX_CUT_INS decode steps a prompt step stops yielding, so a
steady stream of decode steps cannot starve it.

Why this is safe: the two steps never share a sequence (a sequence's decode step
exists only once its prompt has passed every stage and its token came back), the KV
store only grows while they interleave (growth copies what the parked step wrote:
kv.py `_ensure`), and frees, which can shrink it, take the gate as an exclusive step.
Anything that is not a decode step (frees included) is exclusive: it waits for the
gate to be free and lets decode steps cut in only at its checkpoints.

The price is the first token: a prompt step that decode steps cut into finishes
later, and decode steps that would have queued up behind it and gone as one batch
now go one by one. bench/weaklink.py at the paper's reference point (2 stages,
~100 Mbit/s, ~30 ms, medium load) measured TPOT a few percent lower with cut-ins
(end-to-end latency slightly lower too) but TTFT higher: by a tenth, and by more than
a third in a run while the machine was slower (see bench/RESULTS.md). So it is not
the default (compute="in-order"); a host whose users read long answers may want it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

# decode steps that may cut into one prompt step
MAX_CUT_INS = 8
# a pipeline's compute order (Head(compute=...)): decode steps cut in, or arrival order
COMPUTE_ORDERS = ("decode-first", "in-order")


class StepGate:
    def __init__(self, max_cut_ins: int = MAX_CUT_INS):
        self.max_cut_ins = max_cut_ins
        self._cv = threading.Condition()
        self._owner: str | None = None   # "step" (a prompt step or exclusive op) | "decode" | None
        self._parked = False             # the owner "step" waits at a checkpoint
        self._decoding = False           # a decode step runs (alone, or cut into a parked step)
        self._wants = 0                  # decode steps waiting for the compute
        self._cut_ins = 0                # decode steps cut into the current owner step
        self._owner_ident = 0            # the owner step's thread: only it parks
        self._local = threading.local()
        self.cut_ins = 0                 # total, for stats and tests

    @contextmanager
    def step(self, decode: bool):
        """Hold the compute for one step. Yields True for a decode step that cut into
        a parked step (which holds this process's cores, engine/model/cores.py)."""
        cv = self._cv
        with cv:
            if decode:
                self._wants += 1
                try:
                    cv.wait_for(lambda: not self._decoding and (
                        self._owner is None or self._parked and self._cut_ins < self.max_cut_ins))
                finally:
                    self._wants -= 1
                self._decoding = True
                nested = self._owner is not None
                if nested:
                    self._cut_ins += 1
                    self.cut_ins += 1
                else:
                    self._owner = "decode"
            else:
                cv.wait_for(lambda: self._owner is None and self._wants == 0)
                self._owner, self._cut_ins = "step", 0
                self._owner_ident = threading.get_ident()
        cut_in = decode and nested
        self._local.cut_in = cut_in
        try:
            yield cut_in
        finally:
            self._local.cut_in = False
            with cv:
                if decode:
                    self._decoding = False
                    if not nested:
                        self._owner = None
                else:
                    self._owner = None
                cv.notify_all()

    def checkpoint(self) -> bool:
        """Between layers of the owner step: park while decode steps want the compute.
        True if it parked (the decode steps may have changed this process's threads)."""
        if not self._wants or self._decoding:   # unlocked read: the common case costs nothing
            return False
        cv = self._cv
        with cv:
            if self._owner != "step" or self._owner_ident != threading.get_ident() \
                    or self._cut_ins >= self.max_cut_ins:
                return False
            self._parked = True
            cv.notify_all()
            try:
                cv.wait_for(lambda: not self._decoding and (self._wants == 0 or self._cut_ins >= self.max_cut_ins))
            finally:
                self._parked = False
        return True

    def cut_in_here(self) -> bool:
        """Is this thread's step a decode step cut into a parked one?"""
        return getattr(self._local, "cut_in", False)
