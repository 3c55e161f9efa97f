"""Profile curves (engine/core/profile.py): interpolation, the profile in service
(StepLog), and a profile from the network checked point by point."""

import pytest

from engine.core.profile import StepLog, check_profile, differs, interp


def test_interp_is_piecewise_linear_and_extrapolates():
    pts = [[1, 0.01], [16, 0.04]]
    assert interp(pts, 1) == pytest.approx(0.01) and interp(pts, 16) == pytest.approx(0.04)
    assert interp(pts, 8.5) == pytest.approx(0.025)
    assert interp(pts, 31) == pytest.approx(0.07) and interp([[4, 0.02]], 8) == pytest.approx(0.04)


# ---- the profile in service (StepLog) ---------------------------------------------------

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


def test_a_profile_scaled_to_more_layers_takes_longer_in_proportion():
    from engine.core.profile import check_profile, interp, scaled

    p = {"decode": [[1, 0.02], [4, 0.03]], "prefill": [[32, 0.1], [256, 0.6]]}
    q = scaled(p, 1.5)
    assert check_profile(q) is q and p["decode"][0][1] == 0.02  # the original is untouched
    assert interp(q["decode"], 2) == pytest.approx(1.5 * interp(p["decode"], 2))
    assert interp(q["prefill"], 100) == pytest.approx(1.5 * interp(p["prefill"], 100))
