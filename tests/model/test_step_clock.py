"""StepClock (engine/model/step_clock.py): a GPU stage's steps timed by events and read
once they have passed, so no step waits to be timed. The events are the one part that
needs a GPU: here they are stand-ins that pass when told; the GPU test runs a stage."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.core.profile import StepLog
from engine.model.step_clock import StepClock


class Event:
    """A stand-in for torch.cuda.Event: recorded at a time, passed once released."""

    now = 0.0

    def __init__(self):
        self.at = None
        self.done = False

    def record(self):
        self.at = Event.now

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "Event") -> float:
        assert self.done and end.done, "elapsed_time on an event still pending raises on a GPU"
        return (end.at - self.at) * 1e3


def test_a_step_is_read_once_its_end_has_passed_in_order():
    clock = StepClock(Event)
    Event.now = 1.0
    a = clock.start()
    Event.now = 1.25
    clock.stop(a, "decode", 1)
    b = clock.start()
    Event.now = 1.75
    clock.stop(b, "prefill", 32)
    assert clock.passed() == []                    # nothing has passed: nothing waits
    pending = list(clock._pending)
    pending[1][0].done = pending[1][1].done = True  # the second is done, the first is not
    assert clock.passed() == []                    # the first holds the second back
    pending[0][0].done = pending[0][1].done = True
    assert clock.passed() == [("decode", 1, 0.25), ("prefill", 32, 0.5)]
    assert clock.passed() == []


def test_steps_never_read_are_dropped_beyond_the_limit():
    clock = StepClock(Event, max_pending=3)
    for i in range(5):
        s = clock.start()
        clock.stop(s, "decode", i + 1)
    assert [p[3] for p in clock._pending] == [3, 4, 5]


def test_two_threads_reading_take_each_step_once():
    clock = StepClock(Event, max_pending=1000)
    for i in range(400):
        s = clock.start()
        clock.stop(s, "decode", 1)
    for start, end, _, _ in clock._pending:
        start.done = end.done = True
    got = []
    threads = [threading.Thread(target=lambda: got.extend(clock.passed())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 400


@pytest.mark.gpu
def test_a_gpu_stage_in_service_times_its_steps_by_events(tmp_path, monkeypatch):
    """The steps of a stage in service reach its profile on a GPU, each read at a later
    step, with the step's device time: positive and no longer than the wall clock around
    the steps."""
    import time

    from engine.model.sources import resolve
    from engine.model.stage import StageBatch, StageModel
    from testkit.tiny_models import build_tiny_model

    build_tiny_model("llama", tmp_path)
    source = resolve(str(tmp_path))
    s = StageModel(source, 0, source.config().num_hidden_layers, device="cuda")
    s.step_log = log = StepLog({"decode": [[1, 1.0]], "prefill": [[8, 1.0]]})
    prompt = list(range(5, 13))
    t0 = time.perf_counter()
    out = s.forward(StageBatch([0], [0], [len(prompt)]), torch.tensor(prompt))
    for _ in range(6):
        tok = out.argmax(-1)
        out = s.forward(StageBatch([0], [s.kv.seqs[0].length], [1]), tok)
        out.cpu()                                   # the step's output read: it has passed
    wall = time.perf_counter() - t0
    assert log.steps >= 6                           # the prompt step and every decode step but the last
    own = log._exact.get(1, [])
    assert own and all(0 < t <= wall for t in own), own
