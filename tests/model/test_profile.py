"""Measuring a stage's profile (engine/model/measure.py): the probes leave the stage as they
found it, and a profile takes its turn on the machine."""

import math
import time

import torch

from engine.model.measure import context_cost, measure
from engine.model.stage import StageModel


def test_probes_leave_no_kv_and_the_budget_as_it_was(default_source):
    torch.set_num_threads(1)
    stage = StageModel(default_source, 10, 12)
    stage.kv.budget_tokens = 4096
    prof = measure(stage, repeats=1)
    cost = context_cost(stage, rows=4, context=64, repeats=1)
    assert [n for n, _ in prof["decode"]] == [1, 2, 3, 4, 8, 16] and all(t > 0 for _, t in prof["decode"])
    assert math.isfinite(cost) and cost >= 0
    assert not stage.kv.seqs and stage.kv.budget_tokens == 4096


def test_a_profile_waits_for_the_machine_and_loads_share_it(tmp_path):
    """machine_turn: loads (shared) run side by side; a profile (exclusive) waits until
    no load or profile holds the machine, and holds off the next one meanwhile."""
    import threading

    from engine.model.measure import machine_turn

    path = str(tmp_path / "turn.lock")
    events = []
    loading, profiling = threading.Event(), threading.Event()
    with machine_turn(exclusive=False, path=path):
        with machine_turn(exclusive=False, path=path):  # a second load: no wait
            events.append("two loads")

        def profile():
            loading.set()
            with machine_turn(exclusive=True, path=path):
                events.append("profile")
                profiling.set()
                time.sleep(0.2)
                events.append("profile done")  # before the next load can get in

        t = threading.Thread(target=profile)
        t.start()
        loading.wait()
        time.sleep(0.2)
        events.append("load done")  # the profile is still waiting for this load
    assert profiling.wait(30)
    with machine_turn(exclusive=False, path=path):  # waits for the running profile
        events.append("next load")
    t.join()
    assert events == ["two loads", "load done", "profile", "profile done", "next load"]
