"""A friend's busy CPU answers late: what that does to the sender's link estimate.

A stage acknowledges each piece from its event loop (engine/pipeline/stage_server.py), and
answers the link's pings from the same loop, so a busy CPU (a game, a browser, its own
prompt step holding the loop) adds a hold to both. The sender reads its goodput from the
acknowledgements and keeps about B_est x RTT_min + a piece in flight (engine/pipeline/
link.py, `cap`). This runs the simulator (bench/simulator.py: the engine's own LinkSender
sizing, GoodputMeter and schedulers on a simulated clock) over the 70B pipeline of home
GPUs, every receiver holding each answer for each of --holds-ms, three ways side by side:
pongs held as the acknowledgements are (live), from the start; the same hold beginning
--late seconds in, after the links were measured without it (a friend starts a game
mid-evening); and acknowledgements alone (what an RTT figure that leaves the receiver's
hold out would give the cap).

What should hold: live, a hold costs about what it adds to the round trip, and the
estimate stays near the link's real rate, whenever the hold begins. The second column shows why the RTT must keep
the hold: a cap sized below the acknowledgements' clock shrinks the goodput it measures,
which shrinks the cap, and the estimate spirals to the floor.

    .venv/bin/python bench/ack_hold.py                  # ~30 s
    .venv/bin/python bench/ack_hold.py --mbits 20 100 --holds-ms 0 10 30 100
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import simulator as sim  # noqa: E402


def cell(stages: int, mbits: float, delay: float, hold: float, rate: float, n: int, seed: int,
         hold_pongs: bool = True, hold_from: float = 0.0) -> dict:
    pipe = dataclasses.replace(sim.llama70b(stages, mbits * 1e6, delay), ack_hold=hold, hold_pongs=hold_pongs,
                               hold_from=hold_from)
    s = sim.Simulation(pipe, sim.POLICIES["dynamic"])
    out = sim.summarize(s.run(sim.workload(rate, n, seed)))
    est = [link.sched.link.bandwidth for link in s.links]
    out["estimate"] = min(est) / pipe.bandwidth   # the worst link's estimate, of the true rate
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--mbits", type=float, nargs="+", default=[20, 100])
    ap.add_argument("--delay-ms", type=float, default=15.0, help="one-way delay of each hop")
    ap.add_argument("--holds-ms", type=float, nargs="+", default=[0, 10, 30, 100])
    ap.add_argument("--rate", type=float, default=0.05, help="requests/s (a light evening)")
    ap.add_argument("-n", "--requests", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--late", type=float, default=300.0, help="s into the run the late hold begins")
    a = ap.parse_args(argv)
    print(f"{a.stages} stages of a 70B model, {a.delay_ms:g} ms one way, {a.requests} requests at "
          f"{a.rate:g}/s; every receiver answers late by the hold")
    ways = [("live, from the start", {}), (f"live, from {a.late:g} s", {"hold_from": a.late}),
            ("acknowledgements alone", {"hold_pongs": False})]
    print(f"{'':16} " + "   ".join(f"{name:^34}" for name, _ in ways))
    head = f"{'estimate':>9} {'TTFT s':>8} {'x hold 0':>8} {'TPOT x':>7}"
    print(f"{'Mbit/s':>7} {'hold ms':>8} " + "   ".join(head for _ in ways))
    for mbits in a.mbits:
        base = None
        for hold_ms in a.holds_ms:
            row = []
            for _, way in ways:
                r = cell(a.stages, mbits, a.delay_ms / 1e3, hold_ms / 1e3, a.rate, a.requests, a.seed, **way)
                base = base or r
                row.append(f"{r['estimate']:9.2f} {r['ttft_mean']:8.2f} {r['ttft_mean'] / base['ttft_mean']:8.2f} "
                           f"{r['tpot_mean'] / base['tpot_mean']:7.2f}")
            print(f"{mbits:7g} {hold_ms:8g} " + "   ".join(row), flush=True)
    print("estimate: the worst link's goodput estimate at the end, of its true rate; x hold 0: against "
          "the same link with no hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
