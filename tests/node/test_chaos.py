"""Five minutes of an evening with friends coming and going (testkit/chaos.py, fixed seed):
three homes in network namespaces, each running `potluck node` as the app does, clients
on the host's API the whole time, and faults one episode after another. Every request
must end right (the undisturbed pipeline's reply, token for token) or fail saying why;
none may be lost, hang, come back shortened or twice; the ring must be whole after each
episode, and no process may outlive the run. `bench/chaos.py --minutes 60` is the long
version, with every fault kind and the growth figures.
"""

from __future__ import annotations

import json

import pytest

from testkit.chaos import chaos_available, evening

ok, why = chaos_available()
pytestmark = pytest.mark.skipif(not ok, reason=f"the chaos homes cannot be built here: {why}")

# the kinds the five minutes cycle through (short faults, so several fit); the hour has all
KINDS = ("kill", "freeze", "cut", "share", "nat_flush", "during_recovery")


def test_five_minutes_of_friends_coming_and_going_lose_nothing(tmp_path):
    lines = []
    report = evening(seed=5, seconds=300, clients=3, workdir=tmp_path, short=True, kinds=KINDS,
                     say=lines.append, subnet=53)
    summary = json.dumps({k: report[k] for k in ("injected", "episodes", "recoveries", "outlived")}, indent=1)
    c = report["verdict"]["counts"]
    assert c["lost"] == 0 and c["wrong"] == 0, json.dumps(report["verdict"]["bad"][:5], indent=1) + summary
    assert c["ok"] >= 20, summary                          # the clients were served all along
    assert len(report["episodes"]) >= 4, summary
    assert all(e["whole_after_s"] is not None for e in report["episodes"]), summary
    assert report["whole_at_end"] and not report["outlived"], summary
    assert report["recoveries"], summary                    # the faults were felt, and recovered from
    # the clients were held for quiet samples (nothing in flight) and went on afterwards
    assert report["quiet_samples"] >= 2, summary
    quiet_host = [s for s in report["quiet"] if s["role"] == "host node"]
    assert quiet_host and all(s.get("layers") for s in quiet_host), report["quiet"]
    for g in report["growth"]:
        assert g["fds_last"] <= g["fds"] + 16, g            # descriptors do not pile up
