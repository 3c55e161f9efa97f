"""Startup profiling (engine/core/profile.py): the probes leave the stage as they found it."""

import math
import time

import pytest
import torch

from engine.core.profile import interp
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


def test_interp_is_piecewise_linear_and_extrapolates():
    pts = [[1, 0.01], [16, 0.04]]
    assert interp(pts, 1) == pytest.approx(0.01) and interp(pts, 16) == pytest.approx(0.04)
    assert interp(pts, 8.5) == pytest.approx(0.025)
    assert interp(pts, 31) == pytest.approx(0.07) and interp([[4, 0.02]], 8) == pytest.approx(0.04)


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


# ---- the profile in service (StepLog) ---------------------------------------------------
from engine.core.profile import StepLog, check_profile, differs  # noqa: E402

STARTUP = {"decode": [[1, 0.030], [2, 0.045], [4, 0.050], [8, 0.060]], "prefill": [[32, 0.1], [256, 0.5]]}


def test_steps_in_service_replace_the_startup_points_they_hit():
    log = StepLog(STARTUP, window=8, min_steps=3)
    assert log.profile() == STARTUP                      # nothing timed yet
    for t in (0.044, 0.046, 0.045):                      # 1-row steps ran ~1.5x the probe
        log.observe("decode", 1, t)
    p = log.profile()
    assert p["decode"][0] == [1, pytest.approx(0.045)]
    # points with no steps of their own move by the median ratio of all decode steps
    assert p["decode"][2][1] == pytest.approx(0.050 * 0.045 / 0.030)
    assert p["prefill"] == STARTUP["prefill"]            # no prompt step timed
    for n, t in ((64, 0.3), (64, 0.3), (128, 0.5)):      # prompts ran slower than the curve
        log.observe("prefill", n, t)
    assert log.profile()["prefill"][0][1] > 0.1
    assert log.steps == 6


def test_step_log_takes_medians_over_a_window():
    log = StepLog(STARTUP, window=5, min_steps=3)
    for t in (0.030, 0.031, 9.0, 0.029, 0.030):          # one step met a page fault
        log.observe("decode", 2, t)
    assert log.profile()["decode"][1][1] == pytest.approx(0.030)
    for _ in range(5):                                    # the machine got slower: old steps age out
        log.observe("decode", 2, 0.090)
    assert log.profile()["decode"][1][1] == pytest.approx(0.090)
    log.observe("decode", 3, -1.0)                        # nonsense is ignored
    log.observe("other", 3, 0.1)
    assert log.steps == 10


def test_differs_by_more_than_five_percent():
    a = {"decode": [[1, 0.100]], "prefill": [[32, 1.0]]}
    assert not differs(a, {"decode": [[1, 0.104]], "prefill": [[32, 1.0]]})
    assert differs(a, {"decode": [[1, 0.106]], "prefill": [[32, 1.0]]})
    assert differs(a, {"decode": [[2, 0.100]], "prefill": [[32, 1.0]]})


@pytest.mark.parametrize("bad", [
    None, [], {"decode": [[1, 0.1]]}, {"decode": [[1, 0.1]], "prefill": [[1, 0.1]], "x": []},
    {"decode": [], "prefill": [[1, 0.1]]}, {"decode": [[1, 0.1]] * 33, "prefill": [[1, 0.1]]},
    {"decode": [[0, 0.1]], "prefill": [[1, 0.1]]}, {"decode": [[1.5, 0.1]], "prefill": [[1, 0.1]]},
    {"decode": [[True, 0.1]], "prefill": [[1, 0.1]]}, {"decode": [[1, -0.1]], "prefill": [[1, 0.1]]},
    {"decode": [[1, float("nan")]], "prefill": [[1, 0.1]]}, {"decode": [[1, 1e9]], "prefill": [[1, 0.1]]},
    {"decode": [[1, "0.1"]], "prefill": [[1, 0.1]]}, {"decode": [[1]], "prefill": [[1, 0.1]]},
])
def test_a_profile_from_the_network_is_checked_point_by_point(bad):
    from engine.wire import frames

    with pytest.raises(ValueError):
        check_profile(bad)
    text = '{"type": "profile", "profile": %s}' % __import__("json").dumps(bad)
    with pytest.raises(frames.FrameError):
        frames.parse_control(text)
    assert check_profile(STARTUP) is STARTUP
    assert frames.parse_control(frames.control("profile", profile=STARTUP))["profile"] == STARTUP
