"""The chaos run's decisions (testkit/chaos_plan.py): the seeded schedule, the checker's
verdicts, and the growth summary."""

from __future__ import annotations

from testkit.chaos_plan import COMBOS, KINDS, FAILED, LOST, OK, WRONG, check, grew, judge, requests, schedule


def test_the_schedule_is_the_seeds_and_each_kind_comes_before_any_repeats():
    a, b = schedule(7, 300), schedule(7, 300)
    assert a == b and schedule(8, 300) != a
    kinds = KINDS + COMBOS
    first = [e.name for e in a[:len(kinds)]]
    assert sorted(first) == sorted(kinds)
    for e in a:
        for f in e.faults:
            if f.kind in ("kill", "freeze", "cut", "slow", "share"):
                assert f.target in (1, 2)
            if f.kind in ("freeze", "cut"):
                assert 2.0 <= f.duration_s <= 60.0
        if e.name == "two":
            assert len(e.faults) == 2 and e.faults[0].kind != e.faults[1].kind
        if e.name == "during_recovery":
            assert e.after_recovery_starts and e.faults[0].kind == "kill"
            assert e.faults[0].target != e.faults[1].target   # the other friend, while the first is missed
    assert max(f.duration_s for e in schedule(7, 3600, short=True) for f in e.faults) <= 20.0


def test_the_pool_has_every_kind_of_request_and_keys_are_unique():
    pool = requests()
    assert {r.kind for r in pool} == {"chat", "seeded", "tool", "long"}
    assert len({r.key for r in pool}) == len(pool)
    assert all(r.body.get("n") == 2 and r.body.get("seed") is not None for r in pool if r.kind == "seeded")


def _done(*texts, finish="stop"):
    return {"status": "done", "choices": [{"text": t, "tool_calls": "", "finish_reason": finish} for t in texts]}


def test_the_checker_judges_every_kind_of_outcome():
    ref = (("Paris.", "", "stop"),)
    assert judge(_done("Paris."), ref) == (OK, "")
    assert judge(_done("Par"), ref)[0] == WRONG                      # shortened and called finished
    assert judge(_done("Paris.", finish=None), ref)[0] == WRONG      # no finish reason
    assert judge(_done("Paris.", "Paris."), ref)[0] == WRONG         # a second choice nobody asked for
    assert judge({"status": "error", "error": "the host restarted"}, ref) == (FAILED, "the host restarted")
    assert judge({"status": "error", "error": " "}, ref)[0] == LOST  # an error that says nothing
    assert judge({"status": "hang", "deadline_s": 300}, ref)[0] == LOST
    assert judge({**_done("Paris."), "dupes": ["a second [DONE]"]}, ref)[0] == LOST
    v = check({"a": ref}, [{"key": "a", "kind": "chat", **_done("Paris.")},
                           {"key": "a", "kind": "chat", "status": "error", "error": "generation failed: x y"},
                           {"key": "a", "kind": "chat", **_done("Rome.")}])
    assert v["counts"] == {OK: 1, WRONG: 1, FAILED: 1, LOST: 0}
    assert v["reasons"] == {"generation failed: x y": 1} and v["bad"][0]["verdict"] == WRONG
    # the longest pause inside a completed reply, and when it ended (to find its episode)
    v = check({"a": ref}, [{"key": "a", "kind": "chat", **_done("Paris."), "max_gap_s": 2.0, "gap_at": 1000.0},
                           {"key": "a", "kind": "chat", **_done("Paris."), "max_gap_s": 9.5, "gap_at": 1300.0}])
    assert (v["worst_stall_s"], v["worst_stall_at"]) == (9.5, 1300.0)
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("chaos_bench", Path(__file__).parents[2] / "bench" / "chaos.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    report = {"verdict": v, "wall0": 1000.0, "episodes": [{"name": "kill", "t": 100.0, "faults": ["kill@1"]},
                                                          {"name": "cut", "t": 250.0, "faults": ["cut@2 9s"]}]}
    assert bench.stall_episode(report) == " (ended 50 s into the episode 'cut': cut@2 9s)"


def test_growth_is_measured_after_warm_up_per_process():
    mb = 2**20
    samples = [{"t": t, "pid": 1, "role": "host node", "rss": (100 + t) * mb, "fds": 20, "threads": 9, "children": 0}
               for t in range(0, 100, 10)]
    samples += [{"t": 95, "pid": 2, "role": "friend1 node", "rss": 50 * mb, "fds": 10, "threads": 5, "children": 0}]
    # started again at 40 s: it loads until 90 s, and from there it is flat
    samples += [{"t": t, "pid": 3, "role": "friend2 node", "rss": (300 if t >= 90 else 50 + t) * mb, "fds": 10,
                 "threads": 5, "children": 0} for t in range(40, 200, 10)]
    rows = grew(samples, warmup_s=50, min_life_s=10)
    assert [r["pid"] for r in rows] == [3, 1]          # the one sampled once is left out
    assert rows[0]["rss_growth"] == 0.0 and rows[0]["rss_mb"] == 300
    r = rows[1]
    assert r["rss_mb"] == 150 and r["rss_last_mb"] == 190 and abs(r["rss_growth"] - 40 / 150) < 1e-3


def test_a_process_warms_up_from_when_it_was_first_seen_not_from_its_first_quiet_sample():
    """Quiet samples come minutes apart: a node started again at 40 s and first sampled
    quietly at 300 s is warm by then (born from the frequent samples), so that sample counts."""
    mb = 2**20
    quiet = [{"t": t, "pid": 3, "role": "friend1 node", "rss": rss * mb, "fds": 12, "threads": 5, "children": 0}
             for t, rss in ((300, 500), (600, 520))]
    assert grew(quiet, warmup_s=60, min_life_s=100) == []                  # its first sample taken as its birth
    (row,) = grew(quiet, warmup_s=60, min_life_s=100, born={3: 40.0})
    assert row["rss_mb"] == 500 and abs(row["rss_growth"] - 0.04) < 1e-3 and row["life_s"] == 300


def test_growth_is_judged_beyond_what_a_node_holds_window_against_window():
    """A node that took more layers grew by their weights, not by a leak; one noisy quiet
    moment does not decide; a steady climb does."""
    mb = 2**20

    def row(points):
        ss = [{"t": t, "pid": 1, "role": "friend1 node", "rss": rss * mb, "held": held * mb, "fds": 12,
               "threads": 5, "children": 0} for t, rss, held in points]
        (r,) = grew(ss, warmup_s=0)
        return r

    took_layers = row([(0, 800, 135), (600, 860, 189), (1200, 855, 189)])
    assert took_layers["rss_growth"] > 0.06 and abs(took_layers["rss_own_growth"]) < 0.01
    noisy = row([(t, 800 + (250 if i == 4 else 0), 135) for i, t in enumerate(range(0, 3600, 300))])
    assert noisy["rss_window_growth"] == 0.0 and abs(noisy["rss_trend_mb_h"]) < 60
    leaking = row([(t, 800 + t // 20, 135) for t in range(0, 3600, 300)])     # +180 MB an hour
    assert leaking["rss_window_growth"] > 0.10 and leaking["rss_trend_mb_h"] > 100
