"""Friends come and go all evening: a seeded chaos run across three emulated homes, and
whether anything was lost.

    sudo .venv/bin/python bench/chaos.py [--minutes 60] [--seed 7] [--clients 3] [--json out.json]

Three homes in network namespaces (NAT routers, a relay, shaped links), each running
`potluck node` as the app does: the host serves the default model with two friends who
joined with its invite code, clients use the host's API the whole time, and faults are
injected one episode after another (testkit/chaos.py). Printed: faults injected by kind,
requests completed / failed with a reason / lost / wrong, the worst recovery, and each
process's growth after warm-up (sampled at quiet moments: the clients held every few
minutes until nothing is in flight, since under load a node's memory is mostly its
conversations' cache).

Targets (issue 44): 0 lost, 0 wrong; under 10% RSS growth after warm-up, descriptors
flat; no process outlives the run. Needs root (namespaces, iptables) and Debian's
iptables, miniupnpd, coturn and conntrack (`make net-test-tools` installs them).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

RSS_TARGET = 0.10


def stall_episode(report: dict) -> str:
    """Which episode the longest pause ended in (the last one started before it ended)."""
    at, wall0 = report["verdict"].get("worst_stall_at"), report.get("wall0")
    if at is None or wall0 is None:
        return ""
    started = [e for e in report["episodes"] if wall0 + e["t"] <= at]
    if not started:
        return " (before the first episode)"
    e = started[-1]
    return f" (ended {at - wall0 - e['t']:.0f} s into the episode '{e['name']}': {', '.join(e['faults'])})"


def _judged(g: dict) -> float:
    """The growth the target is judged on: beyond what the process holds (weights, cache),
    the median of its last third of quiet samples against that of its first third."""
    return g.get("rss_window_growth", g.get("rss_own_growth", g["rss_growth"]))


def _layers(r) -> str:
    return f"{r[0]}-{r[1]}" if r else "-"


def table(report: dict) -> str:
    v = report["verdict"]
    c = v["counts"]
    lines = [f"seed {report['seed']}, {report['seconds'] / 60:.0f} min, {report['clients']} clients, "
             f"{report['requests']} requests, {len(report['episodes'])} episodes", "",
             "faults injected by kind:",
             "  " + ", ".join(f"{k} {n}" for k, n in report["injected"].items()),
             "episodes: " + ", ".join(f"{e['name']} {e['whole_after_s'] if e['whole_after_s'] is not None else 'NOT WHOLE'}"
                                      for e in report["episodes"]), "",
             "| kind | ok | failed (with a reason) | lost | wrong |", "|---|---:|---:|---:|---:|"]
    for kind, k in sorted(v["by_kind"].items()):
        lines.append(f"| {kind} | {k['ok']} | {k['failed']} | {k['lost']} | {k['wrong']} |")
    lines.append(f"| **all** | {c['ok']} | {c['failed']} | {c['lost']} | {c['wrong']} |")
    lines += ["", "failed requests by reason:"]
    lines += [f"  {n:4d}  {why}" for why, n in sorted(v["reasons"].items(), key=lambda x: -x[1])] or ["  none"]
    for b in v["bad"][:10]:
        lines.append(f"  {b['verdict'].upper()} {b['id']} ({b['key']}): {b['why'][:300]}")
    def worst(kind):
        secs = [r["seconds"] for r in report["recoveries"] if r["event"] == kind and r.get("seconds") is not None]
        return (f"{len(secs)}, worst {max(secs):.1f} s, median {sorted(secs)[len(secs) // 2]:.1f} s" if secs
                else "none")

    lines += ["", f"rearrangements after a loss: {worst('recovered')} (noticing -> serving again)",
              f"rearrangements taking a machine back: {worst('rejoined')}",
              f"longest pause inside a streamed reply: {v['worst_stall_s']:.1f} s{stall_episode(report)}",
              "", "| process | life s | quiet samples | layers | holds MB | RSS MB | RSS growth | beyond what it holds "
              "| first third -> last third | trend MB/h | peak | fds | fds last (max) | threads | children |",
              "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g in report["growth"]:
        lay = g.get("layers") or [None, None]
        held = g.get("held_mb") or [0, 0]
        lines.append(f"| {g['role']} ({g['pid']}) | {g['life_s']:.0f} | {g.get('samples', '')} | "
                     f"{_layers(lay[0])}->{_layers(lay[1])} | "
                     f"{held[0]}->{held[1]} | {g['rss_mb']:.0f}->{g['rss_last_mb']:.0f} | "
                     f"{100 * g['rss_growth']:+.1f}% | {100 * g.get('rss_own_growth', g['rss_growth']):+.1f}% | "
                     f"{100 * _judged(g):+.1f}% | {g.get('rss_trend_mb_h', 0):+.0f} | "
                     f"{100 * g['rss_peak_growth']:+.1f}% | {g['fds']} | "
                     f"{g['fds_last']} ({g['fds_max']}) | {g['threads']}->{g['threads_last']} | "
                     f"{g['children']}->{g['children_last']} |")
    lines.append(f"(each process's first sample after its warm-up against its last, of {report.get('quiet_samples', 0)} "
                 "taken at quiet moments: the ring whole after an episode, the clients held, nothing in flight; "
                 "'beyond what it holds': the growth less the change in its slice of the weights and its cache; "
                 "the target is judged on the same, the median of the last third of its quiet samples against "
                 "that of the first third; trend: the least-squares slope of the same over all of them; "
                 "peak RSS by role over the run: "
                 + ", ".join(f"{r} {mb:.0f} MB" for r, mb in (report.get("peak_rss_mb") or {}).items()) + ")")
    grows = [g for g in report["growth"] if _judged(g) > RSS_TARGET]
    fds = [g for g in report["growth"] if g["fds_last"] > g["fds"] + 8]
    lines += ["", f"lost 0: {'PASS' if c['lost'] == 0 else 'MISS'} ({c['lost']})   "
                  f"wrong 0: {'PASS' if c['wrong'] == 0 else 'MISS'} ({c['wrong']})   "
                  f"RSS growth (beyond what it holds, first third -> last third) < {RSS_TARGET:.0%}: "
                  f"{'PASS' if not grows else 'MISS'}   "
                  f"descriptors flat: {'PASS' if not fds else 'MISS'}   "
                  f"no process outlives the run: {'PASS' if not report['outlived'] else 'MISS ' + str(report['outlived'])}   "
                  f"whole at the end: {'yes' if report['whole_at_end'] else 'NO'}"]
    return "\n".join(lines)


def main() -> int:
    from testkit.chaos import chaos_available, evening

    # a SIGTERM (a timeout, a stop) still tears the homes down: namespaces, routers, nodes
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--kinds", default=None, help="only these fault kinds, comma-separated "
                    "(default: all of testkit/chaos_plan.py's KINDS and COMBOS)")
    ap.add_argument("--short", action="store_true", help="faults of at most 20 s (more of them in a short run)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None, help="where the nodes' homes and logs go (default: a temp folder)")
    args = ap.parse_args()
    ok, why = chaos_available()
    if not ok:
        print(f"cannot run the chaos evening here: {why}", file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="potluck-chaos-"))
    t = time.monotonic()
    kinds = tuple(k.strip() for k in args.kinds.split(",")) if args.kinds else None
    report = evening(args.seed, args.minutes * 60, args.clients, workdir, kinds=kinds, short=args.short,
                     say=lambda s: print(s, flush=True))
    report["wall_s"] = round(time.monotonic() - t)
    print()
    print(table(report))
    print(f"\nwall {report['wall_s']} s; logs in {workdir}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    c = report["verdict"]["counts"]
    return 0 if c["lost"] == 0 and c["wrong"] == 0 and not report["outlived"] else 1


if __name__ == "__main__":
    sys.exit(main())
